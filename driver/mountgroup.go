package driver

import (
	"fmt"
	"os/user"
	"strconv"
	"strings"
)

// taskGroup returns the primary group id (decimal) a task running as
// spec ("name", "uid", "name:group" or "uid:gid", as the task's `user`)
// gets, or "" when it runs as root user and group: such a task writes its
// volumes anyway. It follows the supervisor's rules (supervisor/user.go):
// a given group wins, else the user's passwd group, else for a uid
// without a passwd entry the gid of the same number. The names are looked
// up on the host, whose /etc the task's root is built from.
func taskGroup(spec string) (string, error) {
	if spec == "" {
		return "", nil
	}
	name, group, hasGroup := strings.Cut(spec, ":")
	if name == "" || (hasGroup && group == "") {
		return "", fmt.Errorf("user %q: want name, uid, name:group or uid:gid", spec)
	}
	var uid, gid uint64
	if n, err := strconv.ParseUint(name, 10, 32); err == nil {
		uid, gid = n, n
		if u, err := user.LookupId(name); err == nil {
			if gid, err = strconv.ParseUint(u.Gid, 10, 32); err != nil {
				return "", fmt.Errorf("user %q has a bad gid %q", name, u.Gid)
			}
		}
	} else {
		u, err := user.Lookup(name)
		if err != nil {
			return "", fmt.Errorf("user %q: %w", name, err)
		}
		if uid, err = strconv.ParseUint(u.Uid, 10, 32); err != nil {
			return "", fmt.Errorf("user %q has a bad uid %q", name, u.Uid)
		}
		if gid, err = strconv.ParseUint(u.Gid, 10, 32); err != nil {
			return "", fmt.Errorf("user %q has a bad gid %q", name, u.Gid)
		}
	}
	if hasGroup {
		if n, err := strconv.ParseUint(group, 10, 32); err == nil {
			gid = n
		} else {
			g, err := user.LookupGroup(group)
			if err != nil {
				return "", fmt.Errorf("user %q: group %q: %w", spec, group, err)
			}
			if gid, err = strconv.ParseUint(g.Gid, 10, 32); err != nil {
				return "", fmt.Errorf("group %q has a bad gid %q", group, g.Gid)
			}
		}
	}
	if uid == 0 && gid == 0 {
		return "", nil
	}
	return strconv.FormatUint(gid, 10), nil
}
