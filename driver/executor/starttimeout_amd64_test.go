package executor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
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
// forked and daemonised: it is never reported as a failed start, which
// would have Nomad start the task again beside it. The supervisor took
// the go token, so Start, once it waited for the report twice, returns the
// task, with its cgroup and without its main process's pid, and killing
// it ends all of it; once the supervisor is gone the task has exited, and
// Destroy leaves nothing. With a PID namespace of the task's and without,
// in a group made for the task and in one a spare made ahead under its
// own name and the task claimed.
//
// The supervisor's launching thread is held (ptrace) as it is about to
// write its report, after the go-ahead, until the command and what it
// forked run; it never writes the report.
func TestStart_TimeoutAfterGoAhead_Root(t *testing.T) {
	requireTaskRoot(t)
	defer func(d time.Duration) { startTimeout = d }(startTimeout)
	startTimeout = 4 * time.Second
	for _, spared := range []bool{false, true} {
		for _, privatePID := range []bool{true, false} {
			t.Run(fmt.Sprintf("spare=%v,private_pid=%v", spared, privatePID), func(t *testing.T) {
				if spared && !cgroups.AheadAvailable() {
					t.Skip("groups are made ahead on cgroup v1 only")
				}
				marker := fmt.Sprintf("late-timeout-%d-%d", os.Getpid(), time.Now().UnixNano())
				// A child, and a grandchild daemonised in a session of
				// its own; neither is exec'd over, so both keep the
				// marker in their command lines.
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
				vol := t.TempDir()
				held := make(chan error, 1)
				var sup wire.SupervisorRecord
				p, err := start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
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
					})
					if err := <-seized; err != nil {
						return nil, err
					}
					return []Mount{{Source: vol, Target: "/vol"}}, nil
				})
				must.NoError(t, err, must.Sprint("a start whose command ran was reported as failed"))
				must.NotNil(t, p)
				// Nothing of the supervisor is left held, whatever fails.
				supFD, ferr := unix.PidfdOpen(sup.PID, 0)
				must.NoError(t, ferr)
				t.Cleanup(func() {
					_ = unix.PidfdSendSignal(supFD, unix.SIGKILL, nil, 0)
					_ = unix.Close(supFD)
				})
				must.NoError(t, <-held, must.Sprint("the supervisor was not held between its go-ahead and its report"))
				must.StrContains(t, readFile(t, tt.stdout), "ran-"+marker)
				must.Eq(t, 0, p.Pid())
				must.NoError(t, p.Kill())
				must.True(t, pollFor(func() bool { return len(processesMentioning(t, marker)) == 0 }),
					must.Sprintf("processes of the task left after Kill: %v", processesMentioning(t, marker)))
				// The held thread is let go by the supervisor's end: the
				// task has exited then, without a recorded status.
				must.NoError(t, unix.PidfdSendSignal(supFD, unix.SIGKILL, nil, 0))
				st := waitExit(t, p)
				must.Eq(t, -1, st.ExitCode, must.Sprintf("status: %+v", st))
				if spared {
					must.StrContains(t, readFile(t, filepath.Join(tt.spec.StateDir, wire.SupervisorLogFile)),
						"the task took the cgroup made ahead")
				}
				must.NoError(t, p.Destroy())
				must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
				b, err := os.ReadFile("/proc/self/mountinfo")
				must.NoError(t, err)
				must.StrNotContains(t, string(b), vol)
			})
		}
	}
}

// holdReport seizes (ptrace) the thread of the supervisor pid that waits
// for the late mounts (in recvmsg), says so on seized, and lets it run up
// to its report's write, where it is held: once ready() says what the
// command forked runs, held gets nil, and the thread stays stopped until
// the supervisor is killed, when it is reaped here (a traced thread is
// reaped by its tracer, and its process only after).
func holdReport(pid int, seized, held chan<- error, ready func() bool) {
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
	reap()
}
