//go:build e2e

package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

const (
	startTimeout = 60 * time.Second
	endTimeout   = 60 * time.Second
)

// terminated returns the task's last "Terminated" event.
func terminated(t *testing.T, al *Allocation, task string) TaskEvent {
	t.Helper()
	var ev *TaskEvent
	for _, e := range al.Events(task) {
		if e.Type == "Terminated" {
			e := e
			ev = &e
		}
	}
	if ev == nil {
		t.Fatalf("no Terminated event:\n%s", al.Describe())
	}
	return *ev
}

// eventsText joins everything the task's events say.
func eventsText(al *Allocation, task string) string {
	var parts []string
	for _, e := range al.Events(task) {
		parts = append(parts, e.Text())
	}
	return strings.Join(parts, "\n")
}

// 1. The driver is detected and healthy and reports its version.
func TestFingerprint(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	a := shared(t)

	node := a.Node(t)
	d := node.Drivers[DriverName]
	must.NotNil(t, d, must.Sprintf("node drivers: %v", node.Drivers))
	must.True(t, d.Detected, must.Sprintf("csi not detected: %s", d.HealthDescription))
	must.True(t, d.Healthy, must.Sprintf("csi not healthy: %s", d.HealthDescription))

	version := d.Attributes["driver.csi.version"]
	if version == "" {
		version = node.Attributes["driver.csi.version"]
	}
	must.NotEq(t, "", version, must.Sprintf("no driver.csi.version; driver attributes: %v", d.Attributes))
	must.Eq(t, "1", node.Attributes["driver.csi"], must.Sprint("node attribute driver.csi"))
	t.Logf("driver.csi.version=%s health=%q", version, d.HealthDescription)
}

// 2. A batch task's output is readable with "nomad alloc logs" and its exit
// code is what Nomad reports.
func TestBatchLogsAndExitCode(t *testing.T) {
	t.Parallel()
	a := shared(t)

	for _, tc := range []struct {
		code   int
		status string
	}{
		{0, StatusComplete},
		{7, StatusFailed},
	} {
		t.Run("exit_"+strconv.Itoa(tc.code), func(t *testing.T) {
			t.Parallel()
			job := a.RunJob(t, "exit", vars("ExitCode", strconv.Itoa(tc.code)))
			al := a.WaitAlloc(t, job.ID, startTimeout, tc.status)

			must.StrContains(t, a.AllocLogs(t, al.ID, "t", false), "hello-from-task")
			must.StrContains(t, a.AllocLogs(t, al.ID, "t", true), "hello-on-stderr")

			ev := terminated(t, al, "t")
			must.Eq(t, tc.code, ev.ExitCode, must.Sprint(al.Describe()))
			must.StrContains(t, ev.DisplayMessage, "Exit Code: "+strconv.Itoa(tc.code))
			must.Eq(t, tc.code != 0, al.Task("t").Failed, must.Sprint(al.Describe()))
		})
	}
}

// A task with `logs { disabled = true }` runs (Nomad hands the driver
// /dev/null for its output, as it does exec), and its exit code is what
// Nomad reports.
func TestLogsDisabled(t *testing.T) {
	t.Parallel()
	a := shared(t)

	job := a.RunJob(t, "logs_disabled", vars("ExitCode", "3"))
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusFailed)
	ev := terminated(t, al, "t")
	must.Eq(t, 3, ev.ExitCode, must.Sprint(al.Describe()))
	must.StrNotContains(t, eventsText(al, "t"), "failed to open log", must.Sprint(al.Describe()))
}

// A dispatched job's task carries the child's id ("<parent>/dispatch-..."),
// new at every dispatch, and a grant's job glob matches that id. Nomad's
// client tells the driver the parent (NOMAD_JOB_PARENT_ID; the plugin
// SDK's TaskConfig.ParentJobID does not cross the gRPC boundary), and a
// child refused by the grants is told that "<parent>/*" names its runs.
func TestDispatchedChildGrant(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	a := StartAgent(t, AgentOptions{Drivers: []string{DriverName},
		DriverConfig: `volume_grant {
      namespace = "default"
      job       = "other"
      plugin_id = "nowhere"
      volume_id = "v"
    }`})

	job := a.RunJob(t, "dispatch_volume", vars())
	out, err := a.Nomad("job", "dispatch", "-detach", job.ID)
	must.NoError(t, err, must.Sprint(out))
	m := regexp.MustCompile(`Dispatched Job ID\s*=\s*(\S+)`).FindStringSubmatch(out)
	must.Len(t, 2, m, must.Sprintf("no dispatched job id in %q", out))
	child := m[1]
	must.StrHasPrefix(t, job.ID+"/dispatch-", child)

	al := a.WaitAlloc(t, child, startTimeout, StatusFailed)
	text := eventsText(al, "t")
	must.StrContains(t, text, fmt.Sprintf(`is not granted to job %q in namespace "default"`, child), must.Sprint(al.Describe()))
	must.StrContains(t, text, fmt.Sprintf(`the job is a dispatched or periodic child of job %q, and a grant's job %q matches none of its children, %q matches them all`,
		job.ID, job.ID, job.ID+"/*"), must.Sprint(al.Describe()))
}

// 3. "nomad job stop" delivers kill_signal; a task that ignores it is
// killed after kill_timeout.
func TestStopSignal(t *testing.T) {
	t.Parallel()
	a := shared(t)

	t.Run("trapped", func(t *testing.T) {
		t.Parallel()
		job := a.RunJob(t, "signal_trap", vars())
		al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
		a.WaitLogs(t, al.ID, "t", "ready", 20*time.Second)

		start := time.Now()
		a.StopJob(t, job.ID)
		al = a.WaitAllocID(t, al.ID, endTimeout, StatusComplete, StatusFailed)
		elapsed := time.Since(start)

		must.StrContains(t, a.AllocLogs(t, al.ID, "t", false), "caught-usr1")
		ev := terminated(t, al, "t")
		must.Eq(t, 0, ev.ExitCode, must.Sprint(al.Describe()))
		must.Eq(t, 0, ev.Signal, must.Sprint(al.Describe()))
		// kill_timeout is 20s: ending well before it means the trap ran,
		// not a SIGKILL.
		must.Less(t, 15*time.Second, elapsed, must.Sprintf("stop took %v:\n%s", elapsed, al.Describe()))
		t.Logf("stopped by SIGUSR1 in %v: %s", elapsed.Round(time.Millisecond), ev.DisplayMessage)
	})

	t.Run("ignored", func(t *testing.T) {
		t.Parallel()
		job := a.RunJob(t, "signal_ignore", vars())
		al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
		a.WaitLogs(t, al.ID, "t", "ready", 20*time.Second)

		start := time.Now()
		a.StopJob(t, job.ID)
		al = a.WaitAllocID(t, al.ID, endTimeout, StatusComplete, StatusFailed)
		elapsed := time.Since(start)

		ev := terminated(t, al, "t")
		killed := ev.Signal == int(unix.SIGKILL) || ev.ExitCode == 128+int(unix.SIGKILL)
		must.True(t, killed, must.Sprintf("want a SIGKILL exit, got %q:\n%s", ev.DisplayMessage, al.Describe()))
		// kill_timeout is 3s: the kill must not come before it.
		must.Greater(t, 2500*time.Millisecond, elapsed, must.Sprintf("stop took only %v:\n%s", elapsed, al.Describe()))
		must.Less(t, Scaled(20*time.Second), elapsed, must.Sprintf("stop took %v:\n%s", elapsed, al.Describe()))
		t.Logf("killed after kill_timeout in %v: %s", elapsed.Round(time.Millisecond), ev.DisplayMessage)
	})
}

var startedPID = regexp.MustCompile(`started pid=(\d+)`)

// 4. The agent restarts while a task runs: same process, still alive,
// recovered, and stoppable afterwards with its exit code reported.
func TestAgentRestartRecoversTask(t *testing.T) {
	t.Parallel()
	a := StartAgent(t, AgentOptions{Persistent: true, Drivers: []string{testDriver}})

	job := a.RunJob(t, "restart", vars())
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	logs := a.WaitLogs(t, al.ID, "t", "tick 1", 20*time.Second)
	m := startedPID.FindStringSubmatch(logs)
	must.SliceLen(t, 2, m, must.Sprintf("no pid in the log:\n%s", logs))
	taskPID, _ := strconv.Atoi(m[1])

	shPID := taskShellPID(t, al.ID, "t")
	if taskPID != shPID {
		t.Logf("the task sees itself as pid %d, the host as pid %d (a PID namespace)", taskPID, shPID)
	}
	startedAt := al.Task("t").StartedAt
	ticksBefore := strings.Count(logs, "tick ")

	must.NoError(t, a.Restart())
	t.Logf("agent restarted, pid=%d", a.PID())

	// The restored task runner has the task back once "nomad alloc exec"
	// reaches it through the driver (and with the csi driver, once the
	// driver says it recovered it); a task runner that could not recover
	// it would have started it again, which the checks below see.
	if testDriver == DriverName {
		volWaitRecovered(t, a, []string{al.ID}, 30*time.Second)
	}
	var execOut string
	var execErr error
	for deadline := time.Now().Add(Scaled(30 * time.Second)); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if execOut, execErr = a.AllocExec(al.ID, "t", "echo", "reached"); execErr == nil {
			break
		}
	}
	must.NoError(t, execErr, must.Sprintf("nomad alloc exec after the restart: %s", execOut))
	must.StrContains(t, execOut, "reached")
	al = a.WaitAllocID(t, al.ID, 30*time.Second, StatusRunning)
	ts := al.Task("t")
	must.Eq(t, "running", ts.State, must.Sprint(al.Describe()))
	must.Eq(t, uint64(0), ts.Restarts, must.Sprint(al.Describe()))
	must.True(t, ts.StartedAt.Equal(startedAt), must.Sprintf("task restarted: started %v, then %v", startedAt, ts.StartedAt))

	must.NoError(t, unix.Kill(shPID, 0), must.Sprintf("task process %d is gone after the restart", shPID))
	must.Eq(t, shPID, taskShellPID(t, al.ID, "t"), must.Sprint("the task's process changed across the restart"))

	// Still one start, and the log keeps flowing after the restart.
	logs = a.WaitLogs(t, al.ID, "t", "tick "+strconv.Itoa(ticksBefore+3), 20*time.Second)
	must.Eq(t, 1, strings.Count(logs, "started pid="), must.Sprintf("the task started again:\n%s", logs))

	a.StopJob(t, job.ID)
	al = a.WaitAllocID(t, al.ID, endTimeout, StatusComplete, StatusFailed)
	ev := terminated(t, al, "t")
	must.Eq(t, 3, ev.ExitCode, must.Sprint(al.Describe()))
	must.StrContains(t, a.AllocLogs(t, al.ID, "t", false), "got-term")
	must.Error(t, unix.Kill(shPID, 0), must.Sprintf("task process %d still alive after stop", shPID))
}

// taskShellPID finds the host PID of the task's /bin/sh.
func taskShellPID(t *testing.T, allocID, task string) int {
	t.Helper()
	var found []int
	for _, pid := range TaskPIDs(allocID, task) {
		p, err := ReadProc(pid)
		if err == nil && p.Comm == "sh" {
			found = append(found, pid)
		}
	}
	must.SliceLen(t, 1, found, must.Sprintf("want one sh process of task %s in allocation %s, got %v (all: %v)", task, allocID, found, TaskPIDs(allocID, task)))
	return found[0]
}

// 5. "nomad alloc exec" runs inside the task's mount namespace.
func TestAllocExec(t *testing.T) {
	t.Parallel()
	a := shared(t)

	job := a.RunJob(t, "exec", vars())
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	logs := a.WaitLogs(t, al.ID, "t", "mntns=", 20*time.Second)
	taskNS := strings.TrimSpace(strings.SplitN(strings.SplitN(logs, "mntns=", 2)[1], "\n", 2)[0])

	out, err := a.AllocExec(al.ID, "t", "readlink", "/proc/self/ns/mnt")
	must.NoError(t, err, must.Sprintf("nomad alloc exec: %s", out))
	execNS := strings.TrimSpace(out)
	must.Eq(t, taskNS, execNS, must.Sprint("alloc exec ran outside the task's mount namespace"))

	hostNS, err := os.Readlink("/proc/self/ns/mnt")
	must.NoError(t, err)
	if testDriver == DriverName {
		must.NotEq(t, hostNS, taskNS, must.Sprint("the task shares the host's mount namespace"))
	}

	// The command's exit code comes back through the CLI.
	out, err = a.AllocExec(al.ID, "t", "/bin/sh", "-c", "echo in-task; exit 5")
	must.StrContains(t, out, "in-task")
	var exitErr *exec.ExitError
	must.True(t, errors.As(err, &exitErr), must.Sprintf("want exit status 5 from alloc exec, got %v: %s", err, out))
	must.Eq(t, 5, exitErr.ExitCode(), must.Sprintf("alloc exec output: %s", out))
	t.Logf("task mnt ns %s, exec mnt ns %s, host mnt ns %s", taskNS, execNS, hostNS)
}

// 6. A task that allocates past its memory limit is OOM killed and Nomad
// says so.
func TestMemoryLimitOOMKilled(t *testing.T) {
	t.Parallel()
	a := shared(t)

	job := a.RunJob(t, "oom", vars())
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusFailed)
	ev := terminated(t, al, "t")
	logs := a.AllocLogs(t, al.ID, "t", false)
	must.StrNotContains(t, logs, "survived", must.Sprint("the task got past its memory limit"))
	oom := ev.Details["oom_killed"] == "true" || strings.Contains(ev.DisplayMessage+ev.Message, "OOM")
	must.True(t, oom, must.Sprintf("Nomad does not say the task was OOM killed:\n%s", al.Describe()))
	t.Logf("terminated: %s", ev.Text())
	// What an operator reads in "nomad alloc status" (the oom_killed
	// detail is only in the API unless the driver sets an exit message).
	status, err := a.Nomad("alloc", "status", al.ID)
	must.NoError(t, err, must.Sprint(status))
	t.Logf("nomad alloc status: %s", lineWith(status, "Terminated"))
}

// 7. Bad task configuration fails with an error naming the field.
func TestBadTaskConfig(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	a := shared(t)

	for _, tc := range []struct {
		job   string
		names []string
	}{
		{"bad_unknown_key", []string{"no_such_setting"}},
		{"bad_missing_command", []string{"command"}},
		{"bad_privileged", []string{"privileged", "allow_privileged"}},
	} {
		t.Run(tc.job, func(t *testing.T) {
			t.Parallel()
			job, out, err := a.SubmitJob(t, tc.job, vars())
			var said, where string
			if err != nil {
				said, where = out, "at submit"
			} else {
				al := a.WaitAlloc(t, job.ID, startTimeout, StatusFailed)
				said, where = eventsText(al, "t"), "in the task events"
				// The task must never have run: Nomad has no log for it
				// ("not started yet"), or one without its output.
				logs, err := a.Nomad("alloc", "logs", al.ID, "t")
				if err != nil {
					must.StrContains(t, logs, "not started yet", must.Sprintf("nomad alloc logs failed: %v", err))
				}
				must.StrNotContains(t, logs, "should-not-run")
			}
			for _, name := range tc.names {
				must.StrContains(t, said, name, must.Sprintf("%s the error does not name %q:\n%s", where, name, said))
			}
			t.Logf("rejected %s: %s", where, lineWith(said, tc.names[0]))
		})
	}
}

// lineWith returns the first line of s that contains sub.
func lineWith(s, sub string) string {
	for _, line := range strings.Split(s, "\n") {
		if strings.Contains(line, sub) {
			return strings.TrimSpace(line)
		}
	}
	return ""
}

// 5b. What "nomad alloc exec" runs with in a task that has capabilities:
// in a root task that is not privileged, exactly the default set the
// driver gives such a task (no CAP_SYS_ADMIN), the task's own; as nobody
// (TestAllocExec) there would be none to see. The privileged case is in
// TestCSIPluginTasks, whose agent allows privileged plugin tasks.
func TestAllocExecCapabilities(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	a := shared(t)
	want := defaultCapMask(t)

	job := a.RunJob(t, "escape-task", escJob{Type: "service", Driver: DriverName, User: "root",
		Script: "echo ready; exec sleep 3600"}.vars())
	t.Cleanup(func() { a.stopJobs([]string{job.ID}, escTimeout) })
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "ready", 20*time.Second)
	pid, err := TaskPIDByComm(al.ID, "t", "sleep")
	must.NoError(t, err)
	taskCaps, err := CapEff(pid)
	must.NoError(t, err)
	must.Eq(t, want, taskCaps, must.Sprintf("the root task pid %d has CapEff %016x, want the default set %016x", pid, taskCaps, want))
	// The task's cgroups are under this agent's own driver cgroup_parent,
	// which no other run shares, or, on cgroup v2 where Nomad lays out its
	// tasks' groups, in the group Nomad made for it.
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	must.NoError(t, err)
	wantGroup := "/" + a.DriverCgroupParent() + "/"
	if NomadLaysOutCgroups() {
		wantGroup = NomadTaskCgroup(al.ID, "t", false) + "\n"
	}
	must.StrContains(t, string(cg), wantGroup, must.Sprintf("task pid %d is not in cgroup %s", pid, wantGroup))

	st := execStatus(t, a, al.ID, "t")
	t.Logf("root task: CapEff=%016x; alloc exec: CapEff=%016x CapBnd=%016x Uid=%s", taskCaps, st.capEff, st.capBnd, st.uid)
	must.Eq(t, "0", st.uid, must.Sprint("alloc exec in a root task did not run as root"))
	must.Eq(t, uint64(0), st.capEff&capSysAdmin, must.Sprintf("alloc exec in a root task has CAP_SYS_ADMIN: CapEff=%016x", st.capEff))
	must.Eq(t, want, st.capEff, must.Sprintf("alloc exec in a root task has CapEff %016x, want the default set %016x", st.capEff, want))
	must.Eq(t, want, st.capBnd, must.Sprintf("alloc exec in a root task has CapBnd %016x, want the default set %016x", st.capBnd, want))
}

// defaultCapMask is the default capability set of a task that is not
// privileged, as the kernel's mask.
func defaultCapMask(t *testing.T) uint64 {
	t.Helper()
	nums, err := executor.ParseCapabilities(executor.DefaultCapabilities)
	must.NoError(t, err)
	var mask uint64
	for _, n := range nums {
		mask |= 1 << uint(n)
	}
	return mask
}

// procStatus is what the tests read of a /proc/<pid>/status.
type procStatus struct {
	capEff, capBnd uint64
	uid            string // the real uid
}

// execStatus runs "cat /proc/self/status" in a running task with
// "nomad alloc exec" and parses what the command itself ran with.
func execStatus(t *testing.T, a *Agent, allocID, task string) procStatus {
	t.Helper()
	out, err := a.AllocExec(allocID, task, "cat", "/proc/self/status")
	must.NoError(t, err, must.Sprintf("nomad alloc exec cat /proc/self/status: %s", out))
	var st procStatus
	seen := map[string]bool{}
	for _, line := range strings.Split(out, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		switch k {
		case "CapEff", "CapBnd":
			n, err := strconv.ParseUint(f[0], 16, 64)
			must.NoError(t, err, must.Sprintf("%s in %q", k, line))
			if k == "CapEff" {
				st.capEff = n
			} else {
				st.capBnd = n
			}
		case "Uid":
			st.uid = f[0]
		default:
			continue
		}
		seen[k] = true
	}
	must.MapLen(t, 3, seen, must.Sprintf("alloc exec's /proc/self/status lacks CapEff, CapBnd or Uid:\n%s", out))
	return st
}
