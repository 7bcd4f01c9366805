package driver

import (
	"slices"
	"strconv"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
)

// taskGroup returns the primary group id (decimal) a task running as
// spec ("name", "uid", "name:group" or "uid:gid", as the task's `user`)
// gets, or "" when it runs as root user and group: such a task writes its
// volumes anyway. It is the group the supervisor gives the task
// (taskuser.Resolve).
func taskGroup(spec string) (string, error) { return credentialGroup(taskuser.Resolve(spec)) }

// specGroup is taskGroup for the task of spec, whose user an image task's
// driver resolved already (spec.Credential).
func specGroup(spec *executor.Spec) (string, error) { return credentialGroup(specCredential(spec)) }

func credentialGroup(cred *taskuser.Credential, err error) (string, error) {
	if err != nil {
		return "", err
	}
	if cred.UID == 0 && cred.GID == 0 {
		return "", nil
	}
	return strconv.FormatUint(uint64(cred.GID), 10), nil
}

// specCredential is who the task of spec runs as: the credential the
// driver resolved in its image, or its user on the host
// (taskuser.Resolve), as the supervisor sets it.
func specCredential(spec *executor.Spec) (*taskuser.Credential, error) {
	return credentialOf(spec.User, spec.Credential)
}

// credentialOf is specCredential of a user and its resolved credential.
func credentialOf(user string, resolved *executor.Credential) (*taskuser.Credential, error) {
	if resolved != nil {
		return &taskuser.Credential{UID: resolved.UID, GID: resolved.GID, Groups: slices.Clone(resolved.Groups)}, nil
	}
	return taskuser.Resolve(user)
}
