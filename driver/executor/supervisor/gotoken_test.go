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
