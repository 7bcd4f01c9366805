package driver

import (
	"strconv"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
)

// taskGroup returns the primary group id (decimal) a task running as
// spec ("name", "uid", "name:group" or "uid:gid", as the task's `user`)
// gets, or "" when it runs as root user and group: such a task writes its
// volumes anyway. It is the group the supervisor gives the task
// (taskuser.Resolve).
func taskGroup(spec string) (string, error) {
	cred, err := taskuser.Resolve(spec)
	if err != nil {
		return "", err
	}
	if cred.UID == 0 && cred.GID == 0 {
		return "", nil
	}
	return strconv.FormatUint(uint64(cred.GID), 10), nil
}
