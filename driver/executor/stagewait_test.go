package executor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// pollFor polls cond for up to 10 s.
func pollFor(cond func() bool) bool {
	for i := 0; i < 1000; i++ {
		if cond() {
			return true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cond()
}

// A task that is not privileged has its seccomp stage forked before its
// volumes come: when they fail, or the supervisor dies while the stage
// waits, no stage is left behind (with a PID namespace of the task's and
// without, where the stage ends at its socket's EOF), the command never
// runs, and no cgroup is left: the supervisor removes it when the start
// fails in it, the driver when the supervisor was killed (endTaskGroup).
func TestStart_StageWaitingForVolumes_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, privatePID := range []bool{true, false} {
		for _, kill := range []bool{false, true} {
			t.Run(fmt.Sprintf("private_pid=%v,supervisor_killed=%v", privatePID, kill), func(t *testing.T) {
				marker := fmt.Sprintf("stage-wait-marker-%d-%d", os.Getpid(), time.Now().UnixNano())
				tt := isolatedSpec(t, "echo ran-"+marker)
				tt.spec.Isolation.PrivatePID = privatePID
				tt.spec.LateMounts = []Mount{{Target: "/vol"}}
				boom := errors.New("NodePublishVolume failed")
				p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
					// The stage is there, waiting, before the volume comes.
					if !pollFor(func() bool {
						return len(processesMentioning(t, wire.StageSeccomp+"\x00/bin/sh\x00-c\x00echo ran-"+marker)) > 0
					}) {
						return nil, errors.New("no seccomp stage waited for the volume")
					}
					if kill {
						var rec wire.SupervisorRecord
						if err := wire.ReadJSON(filepath.Join(tt.spec.StateDir, wire.SupervisorFile), &rec); err != nil {
							return nil, err
						}
						if err := unix.Kill(rec.PID, unix.SIGKILL); err != nil {
							return nil, err
						}
					}
					return nil, boom
				})
				must.Nil(t, p)
				must.ErrorIs(t, err, boom)
				must.True(t, pollFor(func() bool { return len(processesMentioning(t, marker)) == 0 }),
					must.Sprintf("processes left: %v", processesMentioning(t, marker)))
				must.Eq(t, "", readFile(t, tt.stdout))
				// A supervisor killed mid-start cleans up nothing: the
				// driver removes the task's cgroup it left.
				must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
			})
		}
	}
}

// stopProcess stops pid with SIGSTOP and returns once every thread of it
// is stopped. kill(2) returns once the signal is queued: the kernel wakes
// one thread to take it, and the others stop only when that thread gets a
// CPU and passes the stop on. Until then a thread blocked in a read runs
// on when its data comes (the supervisor's launching thread receives its
// volumes, hands the stage its go-ahead and is stopped only then, its
// command running), so a stopped process is one whose threads all say so.
func stopProcess(pid int) error {
	if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
		return err
	}
	var states string
	if !pollFor(func() bool {
		states = threadStates(pid)
		return states != "" && strings.Trim(states, "T") == ""
	}) {
		return fmt.Errorf("pid %d did not stop: its threads are in states %q", pid, states)
	}
	return nil
}

// threadStates is the state letter (proc(5)) of each thread of pid, ""
// when it cannot be read.
func threadStates(pid int) string {
	dir := fmt.Sprintf("/proc/%d/task", pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return ""
	}
	var states strings.Builder
	for _, task := range tasks {
		b, err := os.ReadFile(filepath.Join(dir, task.Name(), "stat"))
		if err != nil {
			return ""
		}
		// The state follows the command name, which may hold spaces
		// and parentheses: it is the first field after the last ')'.
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if len(f) == 0 {
			return ""
		}
		states.WriteString(f[0])
	}
	return states.String()
}

// A supervisor that never reports (stopped while its stage waits for the
// volumes, which are sent once it is stopped) is killed once startTimeout
// passes: it never took the go token, the start takes it, and the start
// fails leaving nothing: no stage, no command, no cgroup.
func TestStart_SupervisorSilent_Root(t *testing.T) {
	requireTaskRoot(t)
	defer func(d time.Duration) { startTimeout = d }(startTimeout)
	startTimeout = 2 * time.Second
	for _, privatePID := range []bool{true, false} {
		t.Run(fmt.Sprintf("private_pid=%v", privatePID), func(t *testing.T) {
			marker := fmt.Sprintf("silent-marker-%d-%d", os.Getpid(), time.Now().UnixNano())
			tt := isolatedSpec(t, "echo ran-"+marker)
			tt.spec.Isolation.PrivatePID = privatePID
			tt.spec.LateMounts = []Mount{{Target: "/vol"}}
			vol := t.TempDir()
			p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
				if !pollFor(func() bool {
					return len(processesMentioning(t, wire.StageSeccomp+"\x00/bin/sh\x00-c\x00echo ran-"+marker)) > 0
				}) {
					return nil, errors.New("no seccomp stage waited for the volume")
				}
				var rec wire.SupervisorRecord
				if err := wire.ReadJSON(filepath.Join(tt.spec.StateDir, wire.SupervisorFile), &rec); err != nil {
					return nil, err
				}
				if err := stopProcess(rec.PID); err != nil {
					return nil, err
				}
				return []Mount{{Source: vol, Target: "/vol"}}, nil
			})
			must.Nil(t, p)
			must.ErrorContains(t, err, "did not report within")
			// The start got the token: it did not wait a second time,
			// as for a supervisor that let the command run.
			must.StrNotContains(t, err.Error(), "let the command run")
			must.True(t, pollFor(func() bool { return len(processesMentioning(t, marker)) == 0 }),
				must.Sprintf("processes left: %v", processesMentioning(t, marker)))
			must.Eq(t, "", readFile(t, tt.stdout))
			must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
		})
	}
}
