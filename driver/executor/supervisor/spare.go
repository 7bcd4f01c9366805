package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// awaitTask is a spare supervisor's wait for its task: the state directory
// from the control socket, with the supervisor's log there made its stdout
// and stderr, and the task's go token that comes with it (see
// wire.GoTokenFD). It returns "" when the driver went away instead.
func awaitTask(ctl *os.File) (string, *os.File, error) {
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4))
	n, noob, flags, _, err := unix.Recvmsg(int(ctl.Fd()), buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return "", nil, fmt.Errorf("failed to read the task from the control socket: %w", err)
	}
	var token *os.File
	received := 0
	fail := func(err error) (string, *os.File, error) {
		if token != nil {
			_ = token.Close()
		}
		return "", nil, err
	}
	if msgs, err := unix.ParseSocketControlMessage(oob[:noob]); err == nil {
		for _, m := range msgs {
			fds, err := unix.ParseUnixRights(&m)
			if err != nil {
				continue
			}
			for _, fd := range fds {
				received++
				if token == nil {
					token = os.NewFile(uintptr(fd), "go-token")
				} else {
					_ = unix.Close(fd)
				}
			}
		}
	}
	if n == 0 {
		return fail(nil)
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		return fail(errors.New("the task's message on the control socket was truncated"))
	}
	// Exactly the go token: a message with none, or with more, is not
	// the driver's, and the task's command must not run on it.
	if received != 1 {
		return fail(fmt.Errorf("the task's message on the control socket carried %d descriptors, want 1 (its go token)", received))
	}
	var h wire.SpareHello
	if err := json.Unmarshal(buf[:n], &h); err != nil {
		return fail(fmt.Errorf("failed to decode the task from the control socket: %w", err))
	}
	if h.StateDir == "" {
		return fail(errors.New("the driver sent no state directory"))
	}
	log, err := os.OpenFile(h.StateDir+"/"+wire.SupervisorLogFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fail(fmt.Errorf("failed to open the supervisor log: %w", err))
	}
	defer log.Close()
	for _, fd := range []int{1, 2} {
		if err := unix.Dup3(int(log.Fd()), fd, 0); err != nil {
			return fail(fmt.Errorf("failed to send output to the supervisor log: %w", err))
		}
	}
	return h.StateDir, token, nil
}
