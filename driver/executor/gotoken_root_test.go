package executor

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// The go token never reaches the task: a running task's only descriptors
// are its stdio, whether it is privileged or isolated, in a PID namespace
// of its own or not, with late mounts or without, under a supervisor of
// its own or a spare.
func TestStart_GoTokenNotInTask_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, kind := range []string{"privileged", "isolated", "isolated-shared-pid"} {
		for _, late := range []bool{false, true} {
			for _, spared := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s,late=%v,spare=%v", kind, late, spared), func(t *testing.T) {
					var tt *testTask
					if kind == "privileged" {
						tt = newTestSpec(t, "/bin/sleep", "1000")
					} else {
						tt = isolatedSpec(t, "exec sleep 1000")
						tt.spec.Isolation.PrivatePID = kind == "isolated"
					}
					start, spare := Start, 0
					if spared {
						s := &Spares{}
						t.Cleanup(s.Close)
						s.SetDir(t.TempDir(), tt.spec.Isolation)
						s.Fill("", hclog.NewNullLogger())
						spare = waitSpare(t, s, "")
						start = s.Start
					}
					var late2 func() ([]Mount, error)
					if late {
						vol := t.TempDir()
						tt.spec.LateMounts = []Mount{{Target: "/vol"}}
						late2 = func() ([]Mount, error) { return []Mount{{Source: vol, Target: "/vol"}}, nil }
					}
					p, err := start(hclog.NewNullLogger(), tt.spec, late2)
					must.NoError(t, err)
					t.Cleanup(func() { _ = p.Kill(); waitExit(t, p); _ = p.Destroy() })
					if spared {
						must.Eq(t, spare, p.State().SupervisorPID)
					}
					// The command's loader opens its libraries a moment:
					// its descriptors settle, or stay wrong.
					dir := "/proc/" + strconv.Itoa(p.Pid()) + "/fd"
					var got []string
					settled := pollFor(func() bool {
						fds, err := os.ReadDir(dir)
						must.NoError(t, err)
						got = got[:0]
						for _, fd := range fds {
							l, _ := os.Readlink(dir + "/" + fd.Name())
							got = append(got, fd.Name()+"->"+l)
						}
						return slices.Equal(names(fds), []string{"0", "1", "2"})
					})
					must.True(t, settled, must.Sprintf("the task's descriptors: %v", got))
				})
			}
		}
	}
}

func names(es []os.DirEntry) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

// Starts leave no descriptor behind in the driver: fifty tasks started and
// destroyed, each under a supervisor of its own and each under a spare,
// with late mounts, leave the driver's open files as they were.
func TestStart_NoDescriptorLeak_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, spared := range []bool{false, true} {
		t.Run(fmt.Sprintf("spare=%v", spared), func(t *testing.T) {
			first := isolatedSpec(t, "true")
			start := Start
			var s *Spares
			if spared {
				s = &Spares{}
				t.Cleanup(s.Close)
				s.SetDir(t.TempDir(), first.spec.Isolation)
				s.Fill("", hclog.NewNullLogger())
				waitSpare(t, s, "")
				start = s.Start
			}
			run := func(tt *testTask) {
				vol := t.TempDir()
				tt.spec.LateMounts = []Mount{{Target: "/vol"}}
				p, err := start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
					return []Mount{{Source: vol, Target: "/vol"}}, nil
				})
				must.NoError(t, err)
				must.Eq(t, 0, waitExit(t, p).ExitCode)
				must.NoError(t, p.Destroy())
			}
			// One start first: what a process opens once (its set of
			// exit waits) is open before the count.
			run(first)
			if spared {
				waitSpare(t, s, "")
			}
			before := openFiles(t)
			for range 50 {
				run(isolatedSpec(t, "true"))
			}
			if spared {
				waitSpare(t, s, "")
			}
			must.Eq(t, before, openFiles(t))
		})
	}
}

// A supervisor started for its task without a go token refuses to run the
// command, at once: its report says it has none (it reads no other file
// that took the token's descriptor number), and the command was never
// exec'd, not even for a moment before the supervisor killed it: the
// command is a copy of true of its own, which an inotify watch sees
// opened by any exec of it (checked at the end by one of the test's own).
func TestStart_SupervisorWithoutToken_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, privileged := range []bool{true, false} {
		t.Run(fmt.Sprintf("privileged=%v", privileged), func(t *testing.T) {
			probe := t.TempDir()
			bin := filepath.Join(probe, "true")
			b, err := os.ReadFile("/bin/true")
			must.NoError(t, err)
			must.NoError(t, os.WriteFile(bin, b, 0o755))
			execs := watchOpens(t, bin)

			tt := newTestSpec(t, bin)
			if !privileged {
				tt = isolatedSpec(t, "")
				tt.spec.Command, tt.spec.Args = "/probe/true", nil
				tt.spec.Mounts = []Mount{{Source: probe, Target: "/probe", ReadOnly: true}}
			}
			must.NoError(t, wire.WriteJSON(filepath.Join(tt.spec.StateDir, wire.SpecFile), tt.spec, 0o600, false))
			must.NoError(t, wire.ReserveExit(filepath.Join(tt.spec.StateDir, wire.ExitFile)))
			sp, err := startSupervisor(tt.spec.Supervisor, []string{tt.spec.StateDir}, nil, false, privatePID(tt.spec.Isolation), "", nil, nil, hclog.NewNullLogger())
			must.NoError(t, err)
			defer sp.stop()
			rep, err := readReport(sp.reportR, time.Minute)
			must.NoError(t, err)
			must.StrContains(t, rep.Error, "the supervisor has no go token")
			must.Eq(t, 0, rep.TaskPID)
			<-sp.reaped
			// An exec's open is noted as it happens: with the
			// supervisor reaped, any there was is queued.
			must.Eq(t, 0, execs(), must.Sprint("the command was exec'd"))

			must.NoError(t, exec.Command(bin).Run())
			must.Positive(t, execs(), must.Sprint("the watch did not see the test's own exec of the command"))
		})
	}
}

// watchOpens watches path with inotify and returns a function that says
// how many times it was opened (an exec of it included) since the last
// call, without waiting.
func watchOpens(t *testing.T, path string) func() int {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	must.NoError(t, err)
	t.Cleanup(func() { _ = unix.Close(fd) })
	_, err = unix.InotifyAddWatch(fd, path, unix.IN_OPEN)
	must.NoError(t, err)
	return func() int {
		opens := 0
		buf := make([]byte, 64*unix.SizeofInotifyEvent)
		for {
			n, err := unix.Read(fd, buf)
			if errors.Is(err, unix.EAGAIN) {
				return opens
			}
			must.NoError(t, err)
			for off := 0; off+unix.SizeofInotifyEvent <= n; {
				ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
				if ev.Mask&unix.IN_OPEN != 0 {
					opens++
				}
				off += unix.SizeofInotifyEvent + int(ev.Len)
			}
		}
	}
}
