package supervisor

import (
	"errors"
	"os"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// goToken is a go token as Start makes it: the read end of a pipe holding
// content, whose write end is closed.
func goToken(t *testing.T, content string) *os.File {
	t.Helper()
	var fds [2]int
	must.NoError(t, unix.Pipe2(fds[:], unix.O_CLOEXEC))
	if content != "" {
		_, err := unix.Write(fds[1], []byte(content))
		must.NoError(t, err)
	}
	must.NoError(t, unix.Close(fds[1]))
	return os.NewFile(uintptr(fds[0]), "go-token")
}

// The supervisor lets the command run only with the token's byte: a token
// Start took first (an empty pipe at its end), a missing one or another
// byte each stop the start, and none of them waits.
func TestClaimGo(t *testing.T) {
	must.NoError(t, claimGo(goToken(t, string(rune(wire.GoToken)))))

	err := claimGo(goToken(t, ""))
	must.True(t, errors.Is(err, errStartWithdrawn), must.Sprintf("got %v", err))

	must.ErrorContains(t, claimGo(nil), "has no go token")
	must.ErrorContains(t, claimGo(goToken(t, "x")), "want")
}

// A spare's task message must carry exactly one descriptor, its go token:
// with it the spare may let the command run; with none, two, or more than
// its buffer holds, the spare takes no task, closes what came, and none of
// it waits.
func TestAwaitTask_GoToken(t *testing.T) {
	openFiles := func() int {
		entries, err := os.ReadDir("/proc/self/fd")
		must.NoError(t, err)
		return len(entries)
	}
	for _, tc := range []struct {
		name    string
		tokens  int
		wantErr string
	}{
		{"one", 1, ""},
		{"none", 0, "carried 0 descriptors, want 1"},
		{"two", 2, "carried 2 descriptors, want 1"},
		{"three", 3, "truncated"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			// awaitTask sends the process's stdout and stderr to the
			// task's supervisor log: the test's own are put back
			// before anything is reported.
			var saved [2]int
			for i, fd := range []int{1, 2} {
				saved[i], err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 10)
				must.NoError(t, err)
			}
			restore := func() {
				for i, fd := range []int{1, 2} {
					_ = unix.Dup3(saved[i], fd, 0)
					_ = unix.Close(saved[i])
				}
			}
			dir := t.TempDir()
			fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
			must.NoError(t, err)
			driver, ctl := os.NewFile(uintptr(fds[0]), "driver"), os.NewFile(uintptr(fds[1]), "control")
			defer driver.Close()
			defer ctl.Close()
			var sent []int
			for range tc.tokens {
				tok := goToken(t, string(rune(wire.GoToken)))
				defer tok.Close()
				sent = append(sent, int(tok.Fd()))
			}
			before := openFiles()
			var oob []byte
			if len(sent) > 0 {
				oob = unix.UnixRights(sent...)
			}
			must.NoError(t, unix.Sendmsg(fds[0], []byte(`{"state_dir":"`+dir+`"}`), oob, nil, 0))
			got, token, err := awaitTask(ctl)
			if err == nil {
				err = claimGo(token)
			}
			after := openFiles()
			restore()
			if tc.wantErr == "" {
				must.NoError(t, err)
				must.Eq(t, dir, got)
			} else {
				must.ErrorContains(t, err, tc.wantErr)
			}
			// Whatever came is closed: by claimGo, or by awaitTask.
			must.Eq(t, before, after)
		})
	}
}
