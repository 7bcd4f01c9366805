package metrics

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// A unix socket is the endpoint's safest place: a TCP port, loopback
// included, is open to every process in the host's network namespace, and
// every task with host networking (the default of Nomad's exec and raw_exec,
// and of this driver's tasks without a network block) is one. A socket is
// reached through the file system, where a task sees none of the host's
// directories, and only root can connect to it: it is made mode 0600,
// owned by root, in a directory only root can write, on a path every
// directory of which only root can change.

// maxSocketPath is the longest unix socket path Linux takes (sun_path
// holds 108 bytes with the NUL).
const maxSocketPath = 107

// listenUnix listens on a unix socket at path: made in path's directory
// (created 0700 when missing) under a temporary name, given mode 0600 and
// renamed into place, so that nobody can connect in between. A socket left
// at path (by an earlier driver process) is replaced; anything else there
// is an error.
func listenUnix(path string) (net.Listener, uint64, error) {
	if !filepath.IsAbs(path) || filepath.Clean(path) != path {
		return nil, 0, fmt.Errorf("the socket path %q must be absolute and clean, such as \"unix:///run/nomad-driver-csi/metrics.sock\"", path)
	}
	dir := filepath.Dir(path)
	tmp := filepath.Join(dir, ".metrics-"+strconv.Itoa(os.Getpid()))
	if len(path) > maxSocketPath || len(tmp) > maxSocketPath {
		return nil, 0, fmt.Errorf("the socket path %q is too long: unix socket paths are at most %d bytes, with room for a temporary name beside it (%d)", path, maxSocketPath, len(tmp))
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, 0, err
	}
	if err := checkSocketDir(dir); err != nil {
		return nil, 0, err
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, 0, fmt.Errorf("%q exists and is not a socket (%s): remove it or choose another path", path, fi.Mode().Type())
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, 0, err
	}
	_ = os.Remove(tmp)
	ln, err := net.Listen("unix", tmp)
	if err != nil {
		return nil, 0, err
	}
	// Close removes the socket at path (removeSocket), never at tmp.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	fail := func(err error) (net.Listener, uint64, error) {
		_ = ln.Close()
		_ = os.Remove(tmp)
		return nil, 0, err
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail(err)
	}
	fi, err := os.Lstat(tmp)
	if err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(err)
	}
	return ln, fi.Sys().(*syscall.Stat_t).Ino, nil
}

// checkSocketDir checks that only root can change what dir holds: dir (its
// real path) is a directory owned by root that neither its group nor
// others can write, and every directory above it is owned by root and
// either not writable by group and others or sticky (/tmp: nobody else
// can move what root made there).
func checkSocketDir(dir string) error {
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return err
	}
	for p, own := real, true; ; p, own = filepath.Dir(p), false {
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok || !fi.IsDir() {
			return fmt.Errorf("%q is not a directory", p)
		}
		writable := fi.Mode().Perm()&0o022 != 0
		switch {
		case st.Uid != 0:
			return fmt.Errorf("the socket's directory %q (or one above it) is owned by uid %d, not root: whoever owns it could replace the socket; use a directory of root's, such as /run/nomad-driver-csi", p, st.Uid)
		case writable && (own || fi.Mode()&fs.ModeSticky == 0):
			return fmt.Errorf("the socket's directory %q (or one above it) is writable by others (mode %v): they could replace the socket; use a directory only root can write, such as /run/nomad-driver-csi", p, fi.Mode().Perm())
		}
		if p == "/" {
			return nil
		}
	}
}

// removeSocket removes the socket at path if it is still the one the
// listener was bound to (inode ino): another driver process may have
// replaced it since.
func removeSocket(path string, ino uint64) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); !ok || st.Ino != ino || fi.Mode().Type() != fs.ModeSocket {
		return nil
	}
	return os.Remove(path)
}
