package supervisor

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// errStartWithdrawn is claimGo's error when Start took the go token first:
// it gave up waiting for the report, and the task's command must not run.
var errStartWithdrawn = errors.New("the driver gave up on the start before the task's command ran (its start timed out)")

// claimGo takes the task's go token (see wire.GoTokenFD) and closes it: nil
// when this process got the byte, and may let the command run; an error
// when Start took it first, or the token is missing or unreadable. The
// write end of the token's pipe is closed, so the read never blocks. It is
// the last step before the command may run: whatever fails after it must
// leave the command not run.
func claimGo(token *os.File) error {
	if token == nil {
		return errors.New("the supervisor has no go token: its driver did not send one")
	}
	defer token.Close()
	var b [1]byte
	for {
		n, err := unix.Read(int(token.Fd()), b[:])
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return fmt.Errorf("failed to take the go token: %w", err)
		case n == 1 && b[0] == wire.GoToken:
			return nil
		case n == 0:
			return errStartWithdrawn
		default:
			return fmt.Errorf("failed to take the go token: got %q, want %q", b[:n], wire.GoToken)
		}
	}
}

// inheritedToken is the go token at wire.GoTokenFD of a supervisor started
// for its task, or nil when that descriptor is not a pipe: the driver
// passed none, and claimGo then refuses the start. It must be called
// before the supervisor opens anything.
func inheritedToken() *os.File {
	var st unix.Stat_t
	if err := unix.Fstat(wire.GoTokenFD, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFIFO {
		return nil
	}
	unix.CloseOnExec(wire.GoTokenFD)
	return os.NewFile(wire.GoTokenFD, "go-token")
}
