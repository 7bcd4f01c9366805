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
// and stderr. It returns "" when the driver went away instead.
func awaitTask(ctl *os.File) (string, error) {
	buf := make([]byte, 4096)
	n, _, _, _, err := unix.Recvmsg(int(ctl.Fd()), buf, nil, 0)
	if err != nil {
		return "", fmt.Errorf("failed to read the task from the control socket: %w", err)
	}
	if n == 0 {
		return "", nil
	}
	var h wire.SpareHello
	if err := json.Unmarshal(buf[:n], &h); err != nil {
		return "", fmt.Errorf("failed to decode the task from the control socket: %w", err)
	}
	if h.StateDir == "" {
		return "", errors.New("the driver sent no state directory")
	}
	log, err := os.OpenFile(h.StateDir+"/"+wire.SupervisorLogFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return "", fmt.Errorf("failed to open the supervisor log: %w", err)
	}
	defer log.Close()
	for _, fd := range []int{1, 2} {
		if err := unix.Dup3(int(log.Fd()), fd, 0); err != nil {
			return "", fmt.Errorf("failed to send output to the supervisor log: %w", err)
		}
	}
	return h.StateDir, nil
}
