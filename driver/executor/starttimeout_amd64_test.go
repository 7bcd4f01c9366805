package executor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// A start whose supervisor goes silent after the go-ahead (stuck between
// the go-ahead and its report) has a command that runs, and that may have
// forked and daemonised. The supervisor took the go token, so Start waits
// for the report once more. A supervisor still silent after the second
// wait is killed with everything in the task's cgroup, and the start fails
// saying so, leaving nothing: no process of the task, no cgroup, no mount.
// One that reports during the second wait gives a task like any other,
// with its pid. With a PID namespace of the task's and without, in a group
// made for the task and in one a spare made ahead under its own name and
// the task claimed.
//
// The supervisor's launching thread is held (ptrace) as it is about to
// write its report, after the go-ahead, until the command and what it
// forked run; it is let go once Start says it waits once more, or never.
func TestStart_TimeoutAfterGoAhead_Root(t *testing.T) {
	requireTaskRoot(t)
	defer func(d time.Duration) { startTimeout = d }(startTimeout)
	startTimeout = 4 * time.Second
	for _, released := range []bool{false, true} {
		for _, spared := range []bool{false, true} {
			for _, privatePID := range []bool{true, false} {
				t.Run(fmt.Sprintf("released=%v,spare=%v,private_pid=%v", released, spared, privatePID), func(t *testing.T) {
					if spared && !cgroups.AheadAvailable() {
						t.Skip("groups are made ahead on cgroup v1 only")
					}
					testTimeoutAfterGoAhead(t, released, spared, privatePID)
				})
			}
		}
	}
}

func testTimeoutAfterGoAhead(t *testing.T, released, spared, privatePID bool) {
	marker := fmt.Sprintf("late-timeout-%d-%d", os.Getpid(), time.Now().UnixNano())
	// A child, and a grandchild daemonised in a session of its own;
	// neither is exec'd over, so both keep the marker in their command
	// lines.
	tt := isolatedSpec(t, fmt.Sprintf(
		`sh -c 'sleep 1000; :' child-%[1]s & (setsid sh -c 'sleep 1000; :' daemon-%[1]s &); echo ran-%[1]s; sleep 1000; : %[1]s`, marker))
	tt.spec.Isolation.PrivatePID = privatePID
	tt.spec.Limits = cgroups.Limits{Devices: cgroups.DefaultDevices}
	tt.spec.LateMounts = []Mount{{Target: "/vol"}}
	t.Cleanup(func() {
		for _, pid := range processesMentioning(t, marker) {
			var n int
			if _, err := fmt.Sscan(pid, &n); err == nil {
				_ = unix.Kill(n, unix.SIGKILL)
			}
		}
	})
	start := Start
	if spared {
		s := &Spares{}
		s.SetDir(t.TempDir(), tt.spec.Isolation)
		s.SetGroup(tt.spec.CgroupParent, cgroups.Limits{Devices: cgroups.DefaultDevices}, hclog.NewNullLogger())
		t.Cleanup(s.Close)
		s.Fill("", hclog.NewNullLogger())
		waitSpare(t, s, "")
		start = s.Start
	}
	// Start's warning that it waits once more lets the held thread go
	// when released.
	again := &logWatch{want: "waiting once more", seen: make(chan struct{})}
	var release <-chan struct{}
	if released {
		release = again.seen
	}
	logger := hclog.New(&hclog.LoggerOptions{Output: again, Level: hclog.Warn})
	vol := t.TempDir()
	held := make(chan error, 1)
	var sup wire.SupervisorRecord
	p, err := start(logger, tt.spec, func() ([]Mount, error) {
		if !pollFor(func() bool {
			return len(processesMentioning(t, wire.StageSeccomp+"\x00/bin/sh\x00-c\x00sh -c")) > 0 &&
				len(processesMentioning(t, marker)) > 0
		}) {
			return nil, errors.New("no seccomp stage waited for the volume")
		}
		if err := wire.ReadJSON(filepath.Join(tt.spec.StateDir, wire.SupervisorFile), &sup); err != nil {
			return nil, err
		}
		seized := make(chan error, 1)
		go holdReport(sup.PID, seized, held, func() bool {
			return len(processesMentioning(t, "child-"+marker)) > 0 &&
				len(processesMentioning(t, "daemon-"+marker)) > 0
		}, release)
		if err := <-seized; err != nil {
			return nil, err
		}
		return []Mount{{Source: vol, Target: "/vol"}}, nil
	})
	must.NoError(t, <-held, must.Sprint("the supervisor was not held between its go-ahead and its report"))
	must.StrContains(t, readFile(t, tt.stdout), "ran-"+marker)
	select {
	case <-again.seen:
	default:
		t.Fatalf("start did not wait once more for a supervisor that took the go token (err: %v)", err)
	}
	if spared {
		must.StrContains(t, readFile(t, filepath.Join(tt.spec.StateDir, wire.SupervisorLogFile)),
			"the task took the cgroup made ahead")
	}
	if !released {
		must.Nil(t, p)
		must.ErrorContains(t, err, "the supervisor let the command run but never reported")
		must.ErrorContains(t, err, "so the task was killed")
		must.ErrorContains(t, err, startTimeout.String())
		// Start returns once the supervisor is reaped, and its
		// clean-up killed the task's cgroup: nothing of the task runs.
		must.Eq(t, []string(nil), processesMentioning(t, marker))
		must.True(t, unix.Kill(sup.PID, 0) == unix.ESRCH, must.Sprintf("supervisor %d still exists", sup.PID))
	} else {
		must.NoError(t, err, must.Sprint("a supervisor that reported in the second wait failed its start"))
		must.NotNil(t, p)
		must.Positive(t, p.Pid())
		must.SliceContains(t, processesMentioning(t, marker), fmt.Sprint(p.Pid()))
		must.NoError(t, p.Kill())
		st := waitExit(t, p)
		must.Eq(t, 9, st.Signal, must.Sprintf("status: %+v", st))
		must.True(t, pollFor(func() bool { return len(processesMentioning(t, marker)) == 0 }),
			must.Sprintf("processes of the task left after Kill: %v", processesMentioning(t, marker)))
		must.NoError(t, p.Destroy())
	}
	must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
	b, err := os.ReadFile("/proc/self/mountinfo")
	must.NoError(t, err)
	must.StrNotContains(t, string(b), vol)
}

// logWatch is a logger's output that closes seen once a line has want.
type logWatch struct {
	mu   sync.Mutex
	want string
	seen chan struct{}
	done bool
}

func (w *logWatch) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done && strings.Contains(string(b), w.want) {
		w.done = true
		close(w.seen)
	}
	return len(b), nil
}

// holdReport seizes (ptrace) the thread of the supervisor pid that waits
// for the late mounts (in recvmsg), says so on seized, and lets it run up
// to its report's write, where it is held: once ready() says what the
// command forked runs, held gets nil, and the thread stays stopped until
// the supervisor is killed, when it is reaped here (a traced thread is
// reaped by its tracer, and its process only after), or until release
// is closed, when it is let go to write its report (nil: never).
func holdReport(pid int, seized, held chan<- error, ready func() bool, release <-chan struct{}) {
	runtime.LockOSThread() // ptrace requests come from the tracing thread
	defer runtime.UnlockOSThread()
	// The stage is forked before the thread goes on to wait for the
	// mounts: it is waited for.
	tid := 0
	pollFor(func() bool {
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		for _, task := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/syscall", pid, task.Name()))
			if err == nil && strings.HasPrefix(string(b), fmt.Sprintf("%d ", unix.SYS_RECVMSG)) {
				_, _ = fmt.Sscan(task.Name(), &tid)
			}
		}
		return tid != 0
	})
	if tid == 0 {
		seized <- fmt.Errorf("no thread of supervisor %d waits in recvmsg", pid)
		held <- errors.New("not seized")
		return
	}
	if err := unix.PtraceSeize(tid); err != nil {
		seized <- fmt.Errorf("failed to seize thread %d: %w", tid, err)
		held <- errors.New("not seized")
		return
	}
	var ws unix.WaitStatus
	err := unix.PtraceInterrupt(tid)
	if err == nil {
		_, err = unix.Wait4(tid, &ws, unix.WALL, nil)
	}
	if err == nil {
		err = unix.PtraceSetOptions(tid, unix.PTRACE_O_TRACESYSGOOD)
	}
	seized <- err
	if err != nil {
		_ = unix.PtraceDetach(tid)
		held <- err
		return
	}
	reap := func() {
		for {
			if _, err := unix.Wait4(tid, &ws, unix.WALL, nil); err != nil || ws.Exited() || ws.Signaled() {
				return
			}
		}
	}
	sig := 0
	for {
		if err := unix.PtraceSyscall(tid, sig); err != nil {
			held <- fmt.Errorf("thread %d: %w", tid, err)
			reap()
			return
		}
		sig = 0
		if _, err := unix.Wait4(tid, &ws, unix.WALL, nil); err != nil {
			held <- err
			return
		}
		switch {
		case ws.Exited() || ws.Signaled():
			held <- fmt.Errorf("thread %d ended before its report", tid)
			return
		case !ws.Stopped():
			continue
		case ws.TrapCause() == unix.PTRACE_EVENT_STOP:
			continue
		case ws.StopSignal() != unix.SIGTRAP|0x80:
			sig = int(ws.StopSignal()) // the thread's own signal
			continue
		}
		var regs unix.PtraceRegs
		if err := unix.PtraceGetRegs(tid, &regs); err != nil {
			held <- err
			reap()
			return
		}
		// The entry of write(ReportFD, ...): rax is -ENOSYS there.
		if regs.Orig_rax == unix.SYS_WRITE && regs.Rdi == wire.ReportFD && int64(regs.Rax) == -int64(unix.ENOSYS) {
			break
		}
	}
	if !pollFor(ready) {
		held <- errors.New("the command's child and daemon did not run")
	} else {
		held <- nil
	}
	if release == nil {
		reap()
		return
	}
	// Let go once released, unless the thread ends first (its
	// supervisor killed): then it is reaped here.
	for {
		select {
		case <-release:
			// A thread its supervisor's end woke is no longer
			// stopped, and is reaped here.
			if err := unix.PtraceDetach(tid); err != nil {
				reap()
			}
			return
		default:
		}
		wpid, err := unix.Wait4(tid, &ws, unix.WALL|unix.WNOHANG, nil)
		if err != nil || (wpid == tid && (ws.Exited() || ws.Signaled())) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}
