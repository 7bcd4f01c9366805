//go:build e2e

package e2e

// Task CPU stats through a real agent: the driver counts a task's CPU time
// in MHz ("ticks") with the core speed it reads on the node (the plugin SDK
// it is built against does not carry the agent's CPU topology), and that
// speed is the one the agent fingerprints for the node itself.

import (
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/nomad/api"
	"github.com/shoenig/test/must"
)

func TestTaskCPUStats(t *testing.T) {
	t.Parallel()
	a := shared(t)
	node := a.Node(t)
	total, err := strconv.ParseFloat(node.Attributes["cpu.totalcompute"], 64)
	must.NoError(t, err, must.Sprintf("cpu.totalcompute = %q", node.Attributes["cpu.totalcompute"]))
	cores, err := strconv.ParseFloat(node.Attributes["cpu.numcores"], 64)
	must.NoError(t, err, must.Sprintf("cpu.numcores = %q", node.Attributes["cpu.numcores"]))
	must.Positive(t, cores)
	agentMHz := total / cores

	job := a.RunJob(t, "busy", vars())
	defer a.StopJob(t, job.ID)
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "busy", 20*time.Second)

	// A busy task uses a good share of a core at once; the ticks are that
	// share of the speed of one core.
	var cpu *api.CpuStats
	deadline := time.Now().Add(30 * time.Second)
	for {
		var usage api.AllocResourceUsage
		err := a.GetJSON("/v1/client/allocation/"+al.ID+"/stats", &usage)
		if tu := usage.Tasks["t"]; err == nil && tu != nil && tu.ResourceUsage != nil && tu.ResourceUsage.CpuStats != nil {
			cpu = tu.ResourceUsage.CpuStats
			if cpu.Percent >= 5 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no CPU use of the busy task within 30s (last: %+v, err %v)", cpu, err)
		}
		time.Sleep(time.Second)
	}
	must.Positive(t, cpu.TotalTicks, must.Sprintf("%.1f%% of a core shows as %v MHz", cpu.Percent, cpu.TotalTicks))
	mhz := cpu.TotalTicks / (cpu.Percent / 100)
	t.Logf("%.1f%% of a core = %.1f MHz: %.1f MHz a core (the agent's cpu.totalcompute / cpu.numcores: %.1f)", cpu.Percent, cpu.TotalTicks, mhz, agentMHz)
	must.InDelta(t, agentMHz, mhz, agentMHz*0.02, must.Sprintf("the driver counts %.1f MHz a core, the agent %.1f", mhz, agentMHz))
}
