// Package taskuser resolves a task's user to the credential it runs as.
// The supervisor sets the task's process to it; the driver reads it to
// check, before the task starts, what the task will be able to do (its
// volume's group, whether it can write a volume). One resolution for both
// sides, so that the driver's checks are about the user the task really
// runs as. Users and groups are looked up on the host, whose /etc the
// task's root is built from.
package taskuser

import (
	"fmt"
	"os/user"
	"strconv"
	"strings"
)

// Credential is who a task runs as.
type Credential struct {
	UID, GID uint32
	Groups   []uint32
}

// Resolve turns a task's user ("name", "uid", "name:group" or "uid:gid")
// into a Credential. "" is root. Supplementary groups are the user's groups in
// /etc/group (none for a numeric uid without a passwd entry). When a group
// is given it becomes the primary group.
func Resolve(spec string) (*Credential, error) {
	if spec == "" {
		return &Credential{}, nil
	}
	name, group, hasGroup := strings.Cut(spec, ":")
	if name == "" || (hasGroup && group == "") {
		return nil, fmt.Errorf("invalid user %q: want name, uid, name:group or uid:gid", spec)
	}

	cred := &Credential{}
	u, err := lookupUser(name)
	if err != nil {
		return nil, err
	}
	if u != nil {
		uid, err := strconv.ParseUint(u.Uid, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("user %q has a bad uid %q: %w", name, u.Uid, err)
		}
		gid, err := strconv.ParseUint(u.Gid, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("user %q has a bad gid %q: %w", name, u.Gid, err)
		}
		cred.UID, cred.GID = uint32(uid), uint32(gid)
		gids, err := u.GroupIds()
		if err != nil {
			return nil, fmt.Errorf("failed to list the groups of user %q: %w", name, err)
		}
		for _, g := range gids {
			n, err := strconv.ParseUint(g, 10, 32)
			if err != nil {
				continue
			}
			if uint32(n) != cred.GID {
				cred.Groups = append(cred.Groups, uint32(n))
			}
		}
	} else {
		// A numeric uid without a passwd entry: gid of the same number.
		uid, _ := strconv.ParseUint(name, 10, 32)
		cred.UID, cred.GID = uint32(uid), uint32(uid)
	}

	if hasGroup {
		gid, err := lookupGroup(group)
		if err != nil {
			return nil, err
		}
		cred.GID = gid
	}
	return cred, nil
}

// lookupUser finds a user by name or uid. A numeric uid that has no entry
// returns nil, nil.
func lookupUser(name string) (*user.User, error) {
	if _, err := strconv.ParseUint(name, 10, 32); err == nil {
		u, err := user.LookupId(name)
		if err != nil {
			if _, ok := err.(user.UnknownUserIdError); ok {
				return nil, nil
			}
			return nil, fmt.Errorf("failed to look up uid %q: %w", name, err)
		}
		return u, nil
	}
	u, err := user.Lookup(name)
	if err != nil {
		if _, ok := err.(user.UnknownUserError); ok {
			return nil, fmt.Errorf("user %q not found", name)
		}
		return nil, fmt.Errorf("failed to look up user %q: %w", name, err)
	}
	return u, nil
}

// GroupID is a group's gid, by name or number, as Resolve reads the
// group of "name:group".
func GroupID(group string) (uint32, error) { return lookupGroup(group) }

func lookupGroup(group string) (uint32, error) {
	if n, err := strconv.ParseUint(group, 10, 32); err == nil {
		return uint32(n), nil
	}
	g, err := user.LookupGroup(group)
	if err != nil {
		if _, ok := err.(user.UnknownGroupError); ok {
			return 0, fmt.Errorf("group %q not found", group)
		}
		return 0, fmt.Errorf("failed to look up group %q: %w", group, err)
	}
	n, err := strconv.ParseUint(g.Gid, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("group %q has a bad gid %q: %w", group, g.Gid, err)
	}
	return uint32(n), nil
}
