//go:build e2e

package e2e

// Resources and usage as an operator sees them through a real agent, held
// to what Nomad's own exec driver does on the same host (E2E_DRIVER=exec
// runs the same cases against it).

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/nomad/api"
	"github.com/shoenig/test/must"
)

// A child the OOM killer ended is not the task's failure: the task that
// goes on and exits 0 completes, as under exec, and the Terminated event
// still says the OOM killer struck.
func TestOOMKilledChildTaskCompletes(t *testing.T) {
	t.Parallel()
	a := shared(t)

	job := a.RunJob(t, "oom_child", vars())
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusComplete, StatusFailed)
	logs := a.AllocLogs(t, al.ID, "t", false)
	must.StrNotContains(t, logs, "child survived", must.Sprint("the child got past the task's memory limit"))
	must.StrContains(t, logs, "child exited 137", must.Sprint("the child was not killed by SIGKILL"))
	ev := terminated(t, al, "t")
	t.Logf("terminated: %s", ev.Text())
	must.Eq(t, "true", ev.Details["oom_killed"], must.Sprintf("Nomad does not say the OOM killer struck:\n%s", al.Describe()))
	must.Eq(t, "0", ev.Details["exit_code"])
	must.Eq(t, StatusComplete, al.ClientStatus, must.Sprintf("a task that exited 0 failed:\n%s", al.Describe()))
}

// Reserved cores: the task runs on exactly the cores Nomad reserved for
// it, and a task of the shared cores never on those.
//
// Not parallel: Nomad's core partitions are the host's (on cgroup v1
// cpuset/nomad/reserve and share, whatever the client's cgroup_parent),
// and an agent that starts a task writes the reserve partition as it sees
// it. Beside this case another agent wrote an empty one while the
// reserved task held its core there, the kernel refused it (EBUSY), and
// that agent's task failed in Nomad's cpuparts_hook. The case runs with
// the parallel ones paused, and ends once its core is given back.
func TestReservedCores(t *testing.T) {
	a := shared(t)
	node := a.Node(t)
	if n, _ := strconv.Atoi(node.Attributes["cpu.numcores"]); n < 2 {
		t.Skipf("one core here (cpu.numcores = %q): nothing to reserve apart", node.Attributes["cpu.numcores"])
	}

	job := a.RunJob(t, "cores", vars())
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	defer func() {
		a.StopJob(t, job.ID)
		a.WaitAllocID(t, al.ID, startTimeout, StatusComplete, StatusFailed)
		left := func() []string {
			var groups []string
			for _, g := range []string{
				filepath.Join("/sys/fs/cgroup/cpuset/nomad/reserve", al.ID+".*"),
				filepath.Join("/sys/fs/cgroup/nomad.slice/reserve.slice", al.ID+".*"),
			} {
				m, _ := filepath.Glob(g)
				groups = append(groups, m...)
			}
			return groups
		}
		deadline := time.Now().Add(Scaled(30 * time.Second))
		for len(left()) > 0 && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		must.SliceEmpty(t, left(), must.Sprint("the reserved task's core group is left after its allocation stopped"))
	}()
	// The api package's AllocatedCpuResources has no ReservedCores; the
	// agent's answer does.
	var raw struct {
		AllocatedResources struct {
			Tasks map[string]struct{ Cpu struct{ ReservedCores []int } }
		}
	}
	must.NoError(t, a.GetJSON("/v1/allocation/"+al.ID, &raw))
	want := raw.AllocatedResources.Tasks["reserved"].Cpu.ReservedCores
	must.SliceLen(t, 1, want, must.Sprintf("Nomad reserved %v", want))

	allowed := func(task string) []int {
		// The allocation runs once one of its tasks does: the other may
		// still be starting (its log monitor slow on a loaded node).
		a.WaitEvent(t, al.ID, task, "Started", startTimeout)
		out := a.WaitLogs(t, al.ID, task, "Cpus_allowed_list", 30*time.Second)
		_, list, _ := strings.Cut(out, "Cpus_allowed_list:")
		list, _, _ = strings.Cut(strings.TrimSpace(list), "\n")
		return cpuList(t, strings.TrimSpace(list))
	}
	must.Eq(t, want, allowed("reserved"), must.Sprint("the task does not run on exactly its reserved core"))
	shared := allowed("shared")
	must.SliceNotEmpty(t, shared)
	must.SliceNotContains(t, shared, want[0], must.Sprintf("the shared task runs on %v, the reserved core among them", shared))
}

// The usage Nomad shows keeps coming after "nomad alloc restart", for the
// new run of the task, and lists what exec lists: the CPU percentage among
// the CPU stats (what "nomad alloc status -stats" prints as its CPU
// column) and the memory in use.
func TestStatsAfterAllocRestart(t *testing.T) {
	t.Parallel()
	a := shared(t)

	job := a.RunJob(t, "restart", vars())
	defer a.StopJob(t, job.ID)
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "tick 2", 20*time.Second)

	usage := func(after time.Time) *api.TaskResourceUsage {
		var last *api.TaskResourceUsage
		var err error
		for deadline := time.Now().Add(Scaled(30 * time.Second)); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
			var st api.AllocResourceUsage
			if err = a.GetJSON("/v1/client/allocation/"+al.ID+"/stats", &st); err != nil {
				continue
			}
			tu := st.Tasks["t"]
			if tu == nil || tu.ResourceUsage == nil || tu.ResourceUsage.MemoryStats == nil || tu.ResourceUsage.CpuStats == nil {
				continue
			}
			last = tu
			if time.Unix(0, tu.Timestamp).After(after) {
				return tu
			}
		}
		t.Fatalf("no task usage newer than %s within 30s (last %+v, error %v)", after, last, err)
		return nil
	}
	check := func(when string, tu *api.TaskResourceUsage) {
		ms, cs := tu.ResourceUsage.MemoryStats, tu.ResourceUsage.CpuStats
		t.Logf("%s: memory measured %v (usage %d, rss %d), cpu measured %v (%.2f%%, %.1f MHz)",
			when, ms.Measured, ms.Usage, ms.RSS, cs.Measured, cs.Percent, cs.TotalTicks)
		for _, m := range []string{"RSS", "Usage"} {
			must.SliceContains(t, ms.Measured, m, must.Sprintf("%s: memory stats", when))
		}
		for _, m := range []string{"Percent", "User Mode", "System Mode"} {
			must.SliceContains(t, cs.Measured, m, must.Sprintf("%s: CPU stats", when))
		}
		must.Positive(t, ms.Usage, must.Sprintf("%s: memory usage", when))
	}
	check("first run", usage(time.Time{}))

	restarted := time.Now()
	out, err := a.Nomad("alloc", "restart", al.ID, "t")
	must.NoError(t, err, must.Sprintf("nomad alloc restart: %s", out))
	a.WaitEvent(t, al.ID, "t", "Restarting", 30*time.Second)
	// The new run's samples: newer than the restart, from a task that
	// runs again (its tick count starts over).
	a.WaitLogs(t, al.ID, "t", "got-term", 20*time.Second)
	check("after the restart", usage(time.Now()))
	t.Logf("restart at %s", restarted.Format(time.RFC3339Nano))

	status, err := a.Nomad("alloc", "status", "-stats", al.ID)
	must.NoError(t, err, must.Sprint(status))
	_, cpuPart, ok := strings.Cut(status, "CPU Stats")
	must.True(t, ok, must.Sprintf("nomad alloc status -stats shows no CPU stats:\n%s", status))
	must.StrContains(t, cpuPart, "Percent", must.Sprintf("nomad alloc status -stats shows no CPU percentage:\n%s", status))
}

// memory_max (oversubscription) on the host's own hierarchy: memory_max
// is the hard limit, memory the soft one, and a task holding twice its
// memory, under its memory_max, lives. On cgroup v1 the limits are the
// memory group's limit_in_bytes and soft_limit_in_bytes, as exec writes
// them (TestVMCgroupV2 checks memory.max and memory.low on v2).
func TestMemoryMaxOversubscription(t *testing.T) {
	t.Parallel()
	a := shared(t)
	out, err := a.Nomad("operator", "scheduler", "set-config", "-memory-oversubscription=true")
	must.NoError(t, err, must.Sprint(out))

	job := a.RunJob(t, "memory_max", vars())
	defer a.StopJob(t, job.ID)
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	must.StrContains(t, a.WaitLogs(t, al.ID, "t", "ready", 30*time.Second), "ready holding 64000000 bytes")

	pid, err := TaskPIDByComm(al.ID, "t", "sleep")
	must.NoError(t, err)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	must.NoError(t, err)
	var group string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.SplitN(line, ":", 3); len(f) == 3 && strings.Contains(","+f[1]+",", ",memory,") {
			group = f[2]
		}
	}
	if group == "" {
		t.Skipf("no cgroup v1 memory hierarchy here (/proc/%d/cgroup:\n%s)", pid, b)
	}
	read := func(file string) string {
		b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory", group, file))
		must.NoError(t, err)
		return strings.TrimSpace(string(b))
	}
	t.Logf("memory group %s: limit %s, soft limit %s, usage %s, max usage %s", group,
		read("memory.limit_in_bytes"), read("memory.soft_limit_in_bytes"), read("memory.usage_in_bytes"), read("memory.max_usage_in_bytes"))
	must.Eq(t, strconv.Itoa(256<<20), read("memory.limit_in_bytes"))
	must.Eq(t, strconv.Itoa(32<<20), read("memory.soft_limit_in_bytes"))

	// What watches the task (the csi driver's supervisor, exec's
	// executor) is outside its memory group: the OOM killer, choosing
	// among the group's processes when the task reaches its limit, never
	// takes it, and the task's exit is still recorded.
	sh, err := TaskPIDByComm(al.ID, "t", "sh")
	must.NoError(t, err)
	st, err := ReadProc(sh)
	must.NoError(t, err)
	procs := strings.Fields(read("cgroup.procs"))
	t.Logf("task %d, its parent %d; the memory group holds %v", sh, st.PPID, procs)
	must.SliceContains(t, procs, strconv.Itoa(sh))
	must.SliceNotContains(t, procs, strconv.Itoa(st.PPID), must.Sprintf("the task's parent %d is in its memory group", st.PPID))
}
