package supervisor

import (
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
)

// resolveUser is who the task runs as (taskuser.Resolve, which the driver's
// checks use too).
func resolveUser(spec string) (*taskuser.Credential, error) { return taskuser.Resolve(spec) }

// specCredential is who a task (or a command exec'd in it) runs as: the
// credential the driver resolved (an image task's, from the image's own
// /etc/passwd and /etc/group), or its user looked up here.
func specCredential(spec *wire.Spec) (*taskuser.Credential, error) {
	if c := spec.Credential; c != nil {
		return &taskuser.Credential{UID: c.UID, GID: c.GID, Groups: append([]uint32(nil), c.Groups...)}, nil
	}
	return resolveUser(spec.User)
}
