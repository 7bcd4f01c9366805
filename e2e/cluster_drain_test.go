//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// clusterLong gates the longer cluster cases (drains, plugin updates):
// make e2e-cluster sets it; make e2e runs TestCluster alone.
func clusterLong(t *testing.T) {
	t.Helper()
	if os.Getenv("E2E_CLUSTER_LONG") == "" {
		t.Skip("a longer cluster case: set E2E_CLUSTER_LONG=1 (make e2e-cluster does)")
	}
}

// drainWorkloads is how many volume workloads the drained client runs.
const drainWorkloads = 2

// Case 2: "nomad node drain" of a client that runs volume workloads and
// the plugin (a system job). The workloads move to the other clients; the
// plugin stops last, and only once the teardown of the workloads' volumes
// is done: each volume's NodeUnstageVolume is made to fail on the drained
// client more often than the workload's stop retries it, so its teardown
// is still retried in the background when Nomad stops the plugin, and the
// plugin's stop waits for it (csi_plugin stop_wait, with a task event). The
// drained client is left with no volume mount under its root_dir and no
// journal record. Needs root.
func TestClusterDrain(t *testing.T) {
	requireCSI(t)
	clusterLong(t)
	csiBin(t, "csi-fixture")
	c := StartCluster(t, clusterClients, AgentOptions{AllowPrivileged: true})
	fx, _ := c.StartClusterFixture(t, "dfx")
	target := c.Clients[1]

	// The workloads go to the target: the other clients take nothing new
	// until the drain.
	for _, a := range c.Clients {
		if a != target {
			must.NoError(t, c.SetEligible(a, false))
		}
	}
	var jobs []Job
	var names, dests []string
	for i := 0; i < drainWorkloads; i++ {
		name := volUniq(fmt.Sprintf("drain%d", i))
		dest := filepath.Join(volDir(c.Server, name), "data")
		dests = append(dests, dest)
		jobs = append(jobs, c.Server.RunVolJob(t, VolJob{
			Type:   "service",
			Script: fmt.Sprintf("echo written > %s/file && %s", dest, volSleeper),
			Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest,
				Access: "single-node-writer", Create: true}},
		}))
		names = append(names, name)
	}
	before := map[string]string{}
	for _, j := range jobs {
		al := c.Server.WaitAlloc(t, j.ID, volTimeout, StatusRunning)
		must.Eq(t, target.NodeID, al.NodeID, must.Sprintf("job %s placed on %s", j.ID, al.NodeID))
		before[j.ID] = al.ID
	}
	for _, a := range c.Clients {
		must.NoError(t, c.SetEligible(a, true))
	}
	must.Len(t, 2*drainWorkloads, target.VolJournalLeft(), must.Sprint("a volume and a task record per workload"))

	p := fx.On(t, target)
	var rules []string
	for _, n := range names {
		// The workload's stop tries the unstage 5 times; the 9th call
		// succeeds, in the background retry.
		rules = append(rules, "NodeUnstageVolume "+n+" fail Unavailable 8")
	}
	must.NoError(t, p.SetFaults(rules...))
	t.Cleanup(func() { _ = p.ClearFaults() })

	start := time.Now()
	must.NoError(t, c.Drain(target, 3*time.Minute, false))
	status, err := c.WaitDrained(target, 4*time.Minute)
	must.NoError(t, err)
	t.Logf("drain of %s with %d volume workloads: %s after %.1fs", target.NodeName(), drainWorkloads, status, time.Since(start).Seconds())

	t.Run("workloads_moved", func(t *testing.T) {
		for i, j := range jobs {
			al := c.Server.WaitAlloc(t, j.ID, volTimeout, StatusRunning)
			must.NotEq(t, before[j.ID], al.ID)
			must.NotEq(t, target.NodeID, al.NodeID, must.Sprintf("job %s still on the drained client", j.ID))
			out := volExec(t, c.Server, al.ID, "cat "+dests[i]+"/file")
			must.StrContains(t, out, "written")
		}
	})

	t.Run("plugin_stopped_last_after_teardown", func(t *testing.T) {
		// Nomad calls the drain complete once the plugin's allocation is
		// told to stop; its stop is what waits.
		pa := pluginAllocOn(t, c, fx, target)
		for deadline := time.Now().Add(2 * time.Minute); !IsTerminal(pa.ClientStatus) && time.Now().Before(deadline); {
			time.Sleep(200 * time.Millisecond)
			pa = c.Server.Allocation(t, pa.ID)
		}
		must.True(t, IsTerminal(pa.ClientStatus), must.Sprint(pa.Describe()))
		text := pa.Describe()
		must.StrContains(t, text, `before stopping CSI plugin "dfx": the volume teardown of`)
		must.StrContains(t, text, `Volume teardowns of CSI plugin "dfx" done after`)
		// Each volume's last unstage reached the plugin before it stopped.
		for _, n := range names {
			must.Eq(t, 9, p.Count("NodeUnstageVolume", p.VolumeID(n)), must.Sprintf("calls: %v", p.Calls()))
		}
	})

	t.Run("drained_client_left_clean", func(t *testing.T) {
		must.SliceEmpty(t, target.WaitVolMountsGone(30*time.Second), must.Sprint("volume mounts left on the drained client"))
		must.SliceEmpty(t, target.WaitVolJournalClear(30*time.Second), must.Sprint("journal records left on the drained client"))
	})
}

// pluginAllocOn returns the newest allocation of the fixture's job on
// client a.
func pluginAllocOn(t *testing.T, c *Cluster, fx *ClusterFixture, a *Agent) *Allocation {
	t.Helper()
	allocs, err := c.Server.JobAllocations(fx.JobID)
	must.NoError(t, err)
	for _, al := range allocs {
		if al.NodeID == a.NodeID {
			return c.Server.Allocation(t, al.ID)
		}
	}
	t.Fatalf("no allocation of %s on %s: %v", fx, a.NodeName(), allocs)
	return nil
}
