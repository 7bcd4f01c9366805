package executor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// supKillTask starts an isolated task with a volume that, once running,
// leaves two children behind, sends sig to its parent ($PPID: its
// supervisor in the host's PID namespace, the namespace's init when it has
// one of its own) and waits. It returns, once the task says what the kill
// did, the task's children and its mount namespace, read before the kill
// (which it then has the task send).
func supKillTask(t *testing.T, privatePID bool, sig string) (*testTask, *Process, []int, string) {
	t.Helper()
	tt := isolatedSpec(t, fmt.Sprintf(
		`sleep 1000 & sleep 1000 & while [ ! -e /vol/go ]; do sleep 0.05; done; kill -%s $PPID; echo "ppid=$PPID kill=$?" > /dev/stderr; wait`, sig))
	tt.spec.Isolation.PrivatePID = privatePID
	// A volume, as a CSI volume comes to a task.
	vol := t.TempDir()
	p, err := startWithLateMount(tt, vol, "/vol")
	must.NoError(t, err)
	t.Cleanup(func() {
		_ = p.Kill()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = p.Wait(ctx)
		_ = p.Destroy()
	})
	must.NotNil(t, p.group)
	// The children as the host sees them, in the task's cgroup.
	var kids []int
	waitFor(t, "the task's children", func() bool {
		pids, err := p.group.Pids()
		must.NoError(t, err)
		kids = kids[:0]
		for _, pid := range pids {
			if pid != p.Pid() && strings.HasPrefix(readFile(t, fmt.Sprintf("/proc/%d/cmdline", pid)), "sleep\x001000") {
				kids = append(kids, pid)
			}
		}
		return len(kids) == 2
	})
	must.StrContains(t, readFile(t, fmt.Sprintf("/proc/%d/mountinfo", kids[0])), " /vol ")
	mntNS, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", kids[0]))
	must.NoError(t, err)
	// Held open until the test ends, so that the namespace's inode
	// number, which the kernel hands out again once a namespace is freed,
	// names no other process's namespace when the test looks for what is
	// left in it (it holds the volume's mount in there until then, which
	// no process sees).
	held, err := os.Open(fmt.Sprintf("/proc/%d/ns/mnt", kids[0]))
	must.NoError(t, err)
	t.Cleanup(func() { _ = held.Close() })
	var st unix.Stat_t
	must.NoError(t, unix.Fstat(int(held.Fd()), &st))
	must.Eq(t, fmt.Sprintf("mnt:[%d]", st.Ino), mntNS, must.Sprint("the namespace held is the task's"))

	must.NoError(t, os.WriteFile(filepath.Join(vol, "go"), nil, 0o644))
	return tt, p, kids, mntNS
}

// sentToParent waits for the task of supKillTask to say that its kill
// was sent, and to whom. The kill is sent either way: in a PID namespace of
// the task's, the supervisor is its init, and the kernel drops every signal
// from inside the namespace that init does not handle.
func sentToParent(t *testing.T, tt *testTask, p *Process, privatePID bool) {
	t.Helper()
	var line string
	waitFor(t, "the task's report", func() bool {
		line = readFile(t, tt.stderr)
		return strings.Contains(line, "kill=")
	})
	t.Logf("task: %s", strings.TrimSpace(line))
	must.StrContains(t, line, "kill=0")
	if privatePID {
		must.StrContains(t, line, "ppid=1 ")
	} else {
		must.StrContains(t, line, fmt.Sprintf("ppid=%d ", p.State().SupervisorPID))
	}
}

// gone reports whether pid has ended (a zombie has).
func gone(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(f) == 0 || f[0] == "Z"
}

// A task that kills its own supervisor (in the host's PID namespace it is
// the task's parent, and a root task may signal it) ends with it: the
// driver sees the supervisor go, reports a failed exit, and nothing of the
// task runs on outside what Nomad tracks. In a PID namespace of its own
// the task cannot reach its supervisor at all.
func TestSupervisorKilledByTask_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, privatePID := range []bool{false, true} {
		t.Run(fmt.Sprintf("private_pid=%v", privatePID), func(t *testing.T) {
			tt, p, kids, mntNS := supKillTask(t, privatePID, "KILL")
			sup := p.State().SupervisorPID
			if privatePID {
				// The task outlives a kill that cannot reach its
				// supervisor. (Where it reaches it, the task goes
				// with it, maybe before it says so.)
				sentToParent(t, tt, p, privatePID)
				must.False(t, gone(sup), must.Sprint("the supervisor died of a kill the task could not send"))
				must.NoError(t, p.Shutdown(syscall.SIGTERM, time.Second))
			}
			st := waitExit(t, p)
			t.Logf("exit: %+v", st)
			if !privatePID {
				must.StrContains(t, st.Err, "without recording")
			}
			for _, pid := range append([]int{p.Pid(), sup}, kids...) {
				waitFor(t, fmt.Sprintf("pid %d to end", pid), func() bool { return gone(pid) })
			}
			must.NoError(t, p.Destroy())
			must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
			_, err := os.Stat(tt.spec.StateDir)
			must.True(t, os.IsNotExist(err))
			// No process is left in the task's mount namespace: its
			// volume's mount went with it.
			noneInMountNS(t, mntNS)
		})
	}
}

// A task that stops its own supervisor (SIGSTOP, which the supervisor
// cannot catch) must not keep Nomad's StopTask from ending it: Shutdown
// ends the task and the supervisor within the grace and the kill's wait,
// and Destroy leaves nothing.
func TestSupervisorStoppedByTask_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, privatePID := range []bool{false, true} {
		t.Run(fmt.Sprintf("private_pid=%v", privatePID), func(t *testing.T) {
			old := killWaitTimeout
			killWaitTimeout = 5 * time.Second
			t.Cleanup(func() { killWaitTimeout = old })
			tt, p, kids, mntNS := supKillTask(t, privatePID, "STOP")
			sup := p.State().SupervisorPID
			// A supervisor left stopped by a failure ends with the test.
			supFD, err := unix.PidfdOpen(sup, 0)
			must.NoError(t, err)
			t.Cleanup(func() {
				_ = unix.PidfdSendSignal(supFD, unix.SIGKILL, nil, 0)
				_ = unix.Close(supFD)
			})
			stopped := func() bool {
				b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", sup))
				return err == nil && strings.Contains(string(b), ") T ")
			}
			sentToParent(t, tt, p, privatePID)
			if privatePID {
				must.False(t, stopped(), must.Sprint("the supervisor stopped on a signal the task could not send"))
			} else {
				waitFor(t, "the supervisor to stop", stopped)
			}
			// Stats read the cgroup, and exec joins the task by its main
			// process: neither needs the supervisor.
			_, err = p.Stats()
			must.NoError(t, err)
			var out strings.Builder
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			code, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c", "echo in-task"}, Stdout: &out, Stderr: &out})
			cancel()
			must.NoError(t, err)
			must.Eq(t, 0, code, must.Sprint(out.String()))
			must.StrContains(t, out.String(), "in-task")
			must.NoError(t, p.Shutdown(syscall.SIGTERM, 200*time.Millisecond))
			t.Logf("exit: %+v", waitExit(t, p))
			for _, pid := range append([]int{p.Pid(), sup}, kids...) {
				waitFor(t, fmt.Sprintf("pid %d to end", pid), func() bool { return gone(pid) })
			}
			must.NoError(t, p.Destroy())
			must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
			noneInMountNS(t, mntNS)
		})
	}
}

// noneInMountNS waits until no process is left in the mount namespace ns
// (which the caller holds open, so that its name is not another's), and
// names what stays in the failure.
func noneInMountNS(t *testing.T, ns string) {
	t.Helper()
	var left []string
	deadline := time.Now().Add(10 * time.Second)
	for left = inMountNS(t, ns); len(left) > 0; left = inMountNS(t, ns) {
		if time.Now().After(deadline) {
			var what []string
			for _, pid := range left {
				b, _ := os.ReadFile("/proc/" + pid + "/stat")
				what = append(what, strings.TrimSpace(string(b)))
			}
			t.Fatalf("processes left in the task's mount namespace %s: %s", ns, strings.Join(what, "; "))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// inMountNS lists the processes in the mount namespace ns (a readlink of
// /proc/PID/ns/mnt).
func inMountNS(t *testing.T, ns string) []string {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	must.NoError(t, err)
	var out []string
	for _, e := range entries {
		if got, err := os.Readlink("/proc/" + e.Name() + "/ns/mnt"); err == nil && got == ns {
			out = append(out, e.Name())
		}
	}
	return out
}

// What a root task can signal outside its own processes. In a PID
// namespace of its own it reaches neither another task, its supervisor,
// nor the driver. With private_pid off it is in the host's PID namespace
// (the driver's; no namespace shared with other tasks only), and, root
// with exec's kill capability, signals all of them: why pid_mode "host"
// needs allow_host_namespaces or the operator's default
// (docs/security.md).
func TestSupervisorOfAnotherTask_Root(t *testing.T) {
	requireTaskRoot(t)
	other := isolatedSpec(t, "exec sleep 1000")
	op := startTest(t, other)
	targets := fmt.Sprintf("%d %d %d", op.State().SupervisorPID, op.Pid(), os.Getpid())
	for _, privatePID := range []bool{false, true} {
		t.Run(fmt.Sprintf("private_pid=%v", privatePID), func(t *testing.T) {
			// The task names its own PID namespace: it may have ended
			// before the test could read its /proc entry. A namespace's
			// inode is the same seen from any namespace.
			tt := isolatedSpec(t, `echo "ns=$(readlink /proc/self/ns/pid)"; for pid in `+targets+`; do kill -0 $pid 2>/dev/null; echo "kill$pid=$?"; done`)
			tt.spec.Isolation.PrivatePID = privatePID
			p := startTest(t, tt)
			hostNS, err := os.Readlink("/proc/self/ns/pid")
			must.NoError(t, err)
			got := exitLines(t, tt, p)
			taskNS := got["ns"]
			must.StrHasPrefix(t, "pid:[", taskNS)
			must.Eq(t, !privatePID, taskNS == hostNS, must.Sprintf("task's %s, host's %s", taskNS, hostNS))
			want := "1"
			if !privatePID {
				want = "0"
			}
			for _, pid := range strings.Fields(targets) {
				must.Eq(t, want, got["kill"+pid], must.Sprintf("kill -0 %s", pid))
			}
		})
	}
	must.False(t, op.exited())
}

// A driver restarted while a task keeps its supervisor stopped recovers
// the task with a pidfd of the supervisor (checked against its start time),
// and its StopTask resumes the supervisor just as a started task's does.
func TestSupervisorStoppedByTaskRecovered_Root(t *testing.T) {
	requireTaskRoot(t)
	old := killWaitTimeout
	killWaitTimeout = 5 * time.Second
	t.Cleanup(func() { killWaitTimeout = old })
	tt, started, kids, mntNS := supKillTask(t, false, "STOP")
	sup := started.State().SupervisorPID
	supFD, err := unix.PidfdOpen(sup, 0)
	must.NoError(t, err)
	t.Cleanup(func() {
		_ = unix.PidfdSendSignal(supFD, unix.SIGKILL, nil, 0)
		_ = unix.Close(supFD)
	})
	sentToParent(t, tt, started, false)
	waitFor(t, "the supervisor to stop", func() bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", sup))
		return err == nil && strings.Contains(string(b), ") T ")
	})

	p, err := Recover(hclog.NewNullLogger(), started.State())
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.NoError(t, p.Shutdown(syscall.SIGTERM, 200*time.Millisecond))
	t.Logf("exit: %+v", waitExit(t, p))
	for _, pid := range append([]int{p.Pid(), sup}, kids...) {
		waitFor(t, fmt.Sprintf("pid %d to end", pid), func() bool { return gone(pid) })
	}
	must.NoError(t, p.Destroy())
	must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
	noneInMountNS(t, mntNS)
}

// A started task holds pidfds of its supervisor and of its main process
// while it runs; Destroy closes both, whether the task ended by itself or
// was killed, so that a node that runs tasks for months runs out of none.
func TestStart_DestroyClosesPidfds_Root(t *testing.T) {
	requireTaskRoot(t)
	run := func(kill bool) {
		tt := newTestSpec(t, "/bin/sh", "-c", `[ -n "$KILL" ] && exec sleep 1000; exit 0`)
		if kill {
			tt.spec.Env = append(tt.spec.Env, "KILL=1")
		}
		p := startTest(t, tt)
		if kill {
			must.False(t, p.exited(), must.Sprint("the task to kill ended by itself"))
			must.NoError(t, p.Kill())
		}
		waitExit(t, p)
		must.NoError(t, p.Destroy())
	}
	// The first start sets up what lives as long as the process (the
	// exit set, the runtime's poller).
	run(false)
	before := openFDs(t)
	for _, kill := range []bool{false, true, false, true} {
		run(kill)
	}
	must.Eq(t, before, openFDs(t), must.Sprint("descriptors left open by started and destroyed tasks"))
}
