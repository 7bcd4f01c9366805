package executor

import (
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
)

// waitSpare waits until s has a spare of binary ready and returns its pid.
func waitSpare(t *testing.T, s *Spares, binary string) int {
	t.Helper()
	var pid int
	waitFor(t, "a spare supervisor", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		if sp := s.spares[binary]; sp != nil && sp.cmd != nil {
			pid = sp.cmd.Process.Pid
			return true
		}
		return false
	})
	return pid
}

func alive(pid int) bool {
	_, err := os.Stat("/proc/" + strconv.Itoa(pid))
	return err == nil
}

// A spare supervisor takes the next task, with its late mounts, logs into
// the task's state directory, and is replaced by a new spare afterwards.
func TestSpares_StartUsesSpare_Root(t *testing.T) {
	requireTaskRoot(t)
	s := &Spares{}
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	spare := waitSpare(t, s, "")

	tt := newTestSpec(t, "/bin/sh", "-c", "cat /late/data/f")
	vol := t.TempDir()
	must.NoError(t, os.WriteFile(vol+"/f", []byte("through a spare\n"), 0o644))
	tt.spec.LateMounts = []Mount{{Target: "/late/data"}}
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: "/late/data", ReadOnly: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, spare, p.State().SupervisorPID)
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "through a spare\n", readFile(t, tt.stdout))
	must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+supervisorLogFile), "task started")

	next := waitSpare(t, s, "")
	must.NotEq(t, spare, next)
	s.Close()
	waitFor(t, "the spare to exit", func() bool { return !alive(next) })
	// Closed: no more spares.
	s.Fill("", hclog.NewNullLogger())
	time.Sleep(50 * time.Millisecond)
	must.Nil(t, s.spares)
}

// A spare that died meanwhile is not used: the task gets a supervisor of
// its own, and a failing task through a spare leaves nothing behind.
func TestSpares_DeadSpareAndErrors_Root(t *testing.T) {
	requireTaskRoot(t)
	s := &Spares{}
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	dead := waitSpare(t, s, "")
	must.NoError(t, syscallKill(dead))
	waitFor(t, "the spare to be reaped", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		select {
		case <-s.spares[""].reaped:
			return true
		default:
			return false
		}
	})
	tt := newTestSpec(t, "/bin/sh", "-c", "echo own")
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.NotEq(t, dead, p.State().SupervisorPID)
	must.Eq(t, 0, waitExit(t, p).ExitCode)
	must.Eq(t, "own\n", readFile(t, tt.stdout))

	spare := waitSpare(t, s, "")
	tt = newTestSpec(t, "definitely-not-a-command")
	failed, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.Nil(t, failed)
	must.ErrorContains(t, err, `command "definitely-not-a-command" not found in PATH`)
	waitFor(t, "the failed spare to exit", func() bool { return !alive(spare) })
	must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
}

func syscallKill(pid int) error {
	p, err := os.FindProcess(pid)
	if err != nil {
		return err
	}
	return p.Kill()
}

// A spare with a directory prepares the task's root ahead: a task whose
// mounts all come late runs in it (the directory is gone once entered),
// with its mounts and a sealed root; a task with other mounts gets a root
// made for it, and the prepared one is let go.
func TestSpares_PreparedRoot_Root(t *testing.T) {
	requireTaskRoot(t)
	dir := t.TempDir()
	s := &Spares{}
	s.SetDir(dir, nil)
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	waitSpare(t, s, "")
	// The spare made its directory and removed it once it entered the
	// root it prepared there.
	waitFor(t, "the spare to enter its prepared root", func() bool {
		entries, err := os.ReadDir(dir)
		return err == nil && len(entries) == 0
	})

	vol := t.TempDir()
	must.NoError(t, os.WriteFile(vol+"/f", []byte("prepared\n"), 0o644))
	top := "/ncsi-prepared-" + strconv.Itoa(os.Getpid())
	tt := newTestSpec(t, "/bin/sh", "-c", `cat "$TOP/f"
if touch /top-level-file 2>/dev/null; then echo root-writable; else echo root-read-only; fi`)
	tt.spec.Env = append(tt.spec.Env, "TOP="+top)
	tt.spec.LateMounts = []Mount{{Target: top}}
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: top, ReadOnly: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "prepared\nroot-read-only\n", readFile(t, tt.stdout))
	must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+supervisorLogFile), "root_prepared_ahead=true")
	_, err = os.Stat(top)
	must.True(t, os.IsNotExist(err))

	// Early mounts: the prepared root does not serve.
	waitSpare(t, s, "")
	src := t.TempDir()
	must.NoError(t, os.WriteFile(src+"/g", []byte("early\n"), 0o644))
	tt = newTestSpec(t, "/bin/cat", "/early/g")
	tt.spec.Mounts = []Mount{{Source: src, Target: "/early"}}
	p2, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	t.Cleanup(func() { _ = p2.Kill(); _ = p2.Destroy() })
	must.Eq(t, 0, waitExit(t, p2).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "early\n", readFile(t, tt.stdout))
	must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+supervisorLogFile), "root_prepared_ahead=false")

	// Spares are replaced when they get old, and leave no directory.
	old := spareMaxAge
	spareMaxAge = 50 * time.Millisecond
	t.Cleanup(func() { spareMaxAge = old })
	first := waitSpare(t, s, "")
	s.mu.Lock()
	sp := s.spares[""]
	s.mu.Unlock()
	s.replace("", sp, hclog.NewNullLogger())
	waitFor(t, "a new spare", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		sp := s.spares[""]
		return sp != nil && sp.cmd != nil && sp.cmd.Process.Pid != first
	})
	s.Close()
	waitFor(t, "no spare directories", func() bool {
		entries, _ := os.ReadDir(dir)
		return len(entries) == 0
	})
}
