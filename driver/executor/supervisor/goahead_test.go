//go:build linux && (amd64 || arm64)

package supervisor

import (
	"os"
	"runtime"
	"strconv"
	"strings"
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

// The Go stage takes the same go-ahead as the shim's entry point
// (TestStageEntry_Root): "dir\x00path\x00", the path not empty, nothing
// after it, exactly three descriptors, nothing truncated; the descriptors
// it got are returned whatever else is wrong.
func TestGoAheadMessage(t *testing.T) {
	rights := func(n int) []byte {
		fds := make([]int, n)
		for i := range fds {
			fds[i] = 10 + i
		}
		return unix.UnixRights(fds...)
	}
	cases := []struct {
		name      string
		msg       string
		fds       int
		flags     int
		dir, path string
		err       string
	}{
		{"directory and path", "/d\x00/bin/sh\x00", 3, 0, "/d", "/bin/sh", ""},
		{"no directory", "\x00/bin/sh\x00", 3, 0, "", "/bin/sh", ""},
		{"no path", "/d\x00\x00", 3, 0, "", "", "not a directory and a path"},
		{"directory alone", "/d\x00", 3, 0, "", "", "not a directory and a path"},
		{"not NUL-terminated", "\x00/bin/sh", 3, 0, "", "", "not a directory and a path"},
		{"a third part", "\x00/bin/sh\x00x\x00", 3, 0, "", "", "not a directory and a path"},
		{"no bytes", "", 3, 0, "", "", "not a directory and a path"},
		{"two descriptors", "\x00/bin/sh\x00", 2, 0, "", "", "with 2 descriptors"},
		{"four descriptors", "\x00/bin/sh\x00", 4, 0, "", "", "with 4 descriptors"},
		{"truncated", "\x00/bin/sh\x00", 3, unix.MSG_TRUNC, "", "", "truncated"},
		{"control truncated", "\x00/bin/sh\x00", 3, unix.MSG_CTRUNC, "", "", "truncated"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir, path, fds, err := goAheadMessage([]byte(c.msg), rights(c.fds), c.flags)
			must.Eq(t, c.fds, len(fds), must.Sprint("the descriptors received are returned"))
			if c.err != "" {
				must.ErrorContains(t, err, c.err)
				return
			}
			must.NoError(t, err)
			must.Eq(t, c.dir, dir)
			must.Eq(t, c.path, path)
		})
	}
}

// The entry points' own copies of the stage's wire constants, and their
// layout of stageScratch, agree with the Go side: a GO_MAX past
// len(stageGoAhead) would have recvmsg write past the buffer.
func TestStageEntryConstants(t *testing.T) {
	want := map[string]int{
		"ERROR_FD": wire.SeccompErrorFD,
		"ENV_FD":   wire.SeccompEnvFD,
		"GO_FD":    wire.SeccompGoFD,
		"GO_MAX":   len(stageGoAhead),
	}
	must.Eq(t, wire.SeccompGoMax, len(stageGoAhead))
	for _, file := range []string{"stage_entry_amd64.s", "stage_entry_arm64.s"} {
		t.Run(file, func(t *testing.T) {
			b, err := os.ReadFile(file)
			must.NoError(t, err)
			defs := map[string]int{}
			for _, line := range strings.Split(string(b), "\n") {
				f := strings.Fields(line)
				if len(f) >= 3 && f[0] == "#define" {
					if n, err := strconv.ParseInt(f[2], 0, 64); err == nil {
						defs[f[1]] = int(n)
					}
				}
			}
			for name, v := range want {
				must.Eq(t, v, defs[name], must.Sprintf("%s in %s", name, file))
			}
			must.LessEq(t, 8*len(stageScratch), defs["CMSG"]+defs["CMSG_SPACE"], must.Sprint("the control buffer ends inside stageScratch"))
			must.LessEq(t, defs["MSGHDR"], defs["FAILED"]+3, must.Sprint("the failure's message ends before the msghdr"))
		})
	}
}
