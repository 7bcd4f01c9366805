package driver

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// maxImageDBFile bounds what is read of an image's /etc/passwd or
// /etc/group.
const maxImageDBFile = 4 << 20

// dbEntry is one line of /etc/passwd ([name, password, uid, gid, ...]) or
// /etc/group ([name, password, gid, members]).
type dbEntry []string

// readImageDB reads an image's /etc/passwd or /etc/group; a missing file
// is an empty database.
func readImageDB(fs *layeredFS, path string, fields int) ([]dbEntry, error) {
	b, err := fs.readFile(path, maxImageDBFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("failed to read the image's %s: %w", path, err)
	}
	var out []dbEntry
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Split(line, ":")
		if len(f) < fields {
			continue
		}
		if _, err := strconv.ParseUint(f[2], 10, 32); err != nil {
			continue
		}
		out = append(out, f)
	}
	return out, nil
}

func parseID(s string) (uint32, bool) {
	n, err := strconv.ParseUint(s, 10, 32)
	return uint32(n), err == nil
}

// imageUser is a user resolved in an image.
type imageUser struct {
	cred executor.Credential
	// home is the user's home directory in the image ("/" when the
	// image does not say).
	home string
}

// resolveImageUser resolves user ("name", "uid", "name:group",
// "uid:gid", as Docker takes it) in the image's /etc/passwd and
// /etc/group, never the host's: a name must be there; a uid that is not
// runs with the gid of the same number (as on the host). Without a
// group, the supplementary groups are those the image's /etc/group lists
// the user in; a group given after the colon is the only group.
func resolveImageUser(fs *layeredFS, user string) (*imageUser, error) {
	name, group, hasGroup := strings.Cut(user, ":")
	if name == "" || hasGroup && group == "" {
		return nil, fmt.Errorf("user %q must be a name or uid, optionally with \":group\" or \":gid\"", user)
	}
	passwd, err := readImageDB(fs, "/etc/passwd", 4)
	if err != nil {
		return nil, err
	}
	u := &imageUser{home: "/"}
	var pw dbEntry
	if uid, ok := parseID(name); ok {
		u.cred.UID, u.cred.GID = uid, uid
		for _, e := range passwd {
			if e[2] == name {
				pw = e
				break
			}
		}
	} else {
		for _, e := range passwd {
			if e[0] == name {
				pw = e
				break
			}
		}
		if pw == nil {
			return nil, fmt.Errorf("user %q is not in the image's /etc/passwd: use a user the image has, or a numeric uid", name)
		}
	}
	if pw != nil {
		u.cred.UID, _ = parseID(pw[2])
		if gid, ok := parseID(pw[3]); ok {
			u.cred.GID = gid
		}
		if len(pw) > 5 && strings.HasPrefix(pw[5], "/") {
			u.home = pw[5]
		}
	}
	groups, err := readImageDB(fs, "/etc/group", 3)
	if err != nil {
		return nil, err
	}
	if hasGroup {
		gid, ok := parseID(group)
		if !ok {
			found := false
			for _, e := range groups {
				if e[0] == group {
					gid, _ = parseID(e[2])
					found = true
					break
				}
			}
			if !found {
				return nil, fmt.Errorf("group %q of user %q is not in the image's /etc/group: use a group the image has, or a numeric gid", group, user)
			}
		}
		u.cred.GID = gid
	}
	if pw != nil && !hasGroup {
		// Only a user named without a group gets the groups the image
		// lists it in: "name:group" runs with that group alone, as Docker's
		// USER and the OCI image spec's User say.
		for _, e := range groups {
			if len(e) < 4 || !slices.Contains(strings.Split(e[3], ","), pw[0]) {
				continue
			}
			if gid, ok := parseID(e[2]); ok && gid != u.cred.GID && !slices.Contains(u.cred.Groups, gid) {
				u.cred.Groups = append(u.cred.Groups, gid)
			}
		}
	}
	return u, nil
}

// checkDeniedIDs refuses a resolved user whose uid, primary gid or a
// supplementary group the operator denied (denied_host_uids,
// denied_host_gids): the ids an image task runs with are the host's ids,
// whatever names the image gives them.
func checkDeniedIDs(conf *Config, user string, cred executor.Credential) error {
	uids, gids, err := conf.deniedIDs()
	if err != nil {
		return err
	}
	if inRanges(uids, uint64(cred.UID)) {
		return fmt.Errorf("user %q: running as uid %d is denied on this node (denied_host_uids = %q)", user, cred.UID, conf.DeniedHostUIDs)
	}
	for _, g := range append([]uint32{cred.GID}, cred.Groups...) {
		if inRanges(gids, uint64(g)) {
			return fmt.Errorf("user %q: running with gid %d is denied on this node (denied_host_gids = %q)", user, g, conf.DeniedHostGIDs)
		}
	}
	return nil
}
