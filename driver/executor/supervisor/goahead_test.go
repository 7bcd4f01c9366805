//go:build linux && (amd64 || arm64)

package supervisor

import (
	"os"
	"runtime"
	"syscall"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/shimtest"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// startTestStage starts the shim's seccomp stage as startStage does for a
// task (as root here), from a thread of its own with no_new_privs; it is
// killed and reaped when t ends.
func startTestStage(t *testing.T, shim string) *seccompStage {
	t.Helper()
	exe, err := os.Open(shim)
	must.NoError(t, err)
	t.Cleanup(func() { _ = exe.Close() })
	old := selfExe
	selfExe = exe
	t.Cleanup(func() { selfExe = old })
	type result struct {
		s   *seccompStage
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// Never unlocked: no_new_privs stays with this thread.
		runtime.LockOSThread()
		s, err := startStage(&wire.Spec{Command: "true", Isolation: &wire.Isolation{}}, &syscall.SysProcAttr{}, []string{}, 0)
		ch <- result{s, err}
	}()
	r := <-ch
	must.NoError(t, r.err)
	t.Cleanup(func() {
		r.s.close()
		killStarted(r.s.cmd)
	})
	return r.s
}

// testStdio is stdin, stdout and stderr for a stage's command.
func testStdio(t *testing.T) []*os.File {
	t.Helper()
	var files []*os.File
	for i := 0; i < 3; i++ {
		f, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
		must.NoError(t, err)
		t.Cleanup(func() { _ = f.Close() })
		files = append(files, f)
	}
	return files
}

// A go-ahead the stage never gets says why: the send's error, and how the
// stage ended when it was gone before it (its own stdio is /dev/null
// until the go-ahead, so nothing of it is in the task's stderr).
func TestGoAhead_notDelivered_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("test needs root: it starts the seccomp stage as the supervisor does")
	}
	shim := shimtest.Build(t, "")

	t.Run("delivered", func(t *testing.T) {
		s := startTestStage(t, shim)
		must.NoError(t, s.goAhead("/", "/bin/true", testStdio(t)))
		st, err := s.cmd.Process.Wait()
		must.NoError(t, err)
		must.Eq(t, 0, st.ExitCode())
	})

	t.Run("stage gone before it", func(t *testing.T) {
		s := startTestStage(t, shim)
		must.NoError(t, s.cmd.Process.Kill())
		// Dead, not reaped.
		var info unix.Siginfo
		must.NoError(t, unix.Waitid(unix.P_PID, s.cmd.Process.Pid, &info, unix.WEXITED|unix.WNOWAIT, nil))
		err := s.goAhead("/", "/bin/true", testStdio(t))
		must.ErrorContains(t, err, "failed to give the seccomp stage its go-ahead")
		must.ErrorContains(t, err, "signal: killed")
		must.StrNotContains(t, err.Error(), "task's stderr")
	})

	t.Run("send fails", func(t *testing.T) {
		s := startTestStage(t, shim)
		stdio := testStdio(t)
		must.NoError(t, stdio[1].Close())
		err := s.goAhead("/", "/bin/true", stdio)
		must.ErrorContains(t, err, "failed to give the seccomp stage its go-ahead")
		must.ErrorIs(t, err, unix.EBADF)
	})
}
