package mounter

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// deadMountErr reports whether err from stat(2) of a mount point means the
// mount behind it is dead rather than the path missing or forbidden:
// ENOTCONN (a FUSE daemon gone), ESTALE (a stale network handle) or EIO.
func deadMountErr(err error) bool {
	return errors.Is(err, unix.ENOTCONN) || errors.Is(err, unix.ESTALE) || errors.Is(err, unix.EIO)
}

func (m *mounter) Stale(path string) (bool, error) {
	path = filepath.Clean(path)
	var st unix.Stat_t
	err := unix.Stat(path, &st)
	if err == nil || !deadMountErr(err) {
		return false, nil
	}
	// The path cannot be resolved (its mount is dead): look it up in the
	// table by its name as given, which is how the driver mounted it.
	mounts, lerr := m.List()
	if lerr != nil {
		return false, lerr
	}
	return isMountPoint(mounts, path), nil
}

func (m *mounter) DetachLazy(target string) error {
	target = filepath.Clean(target)
	m.logger.Debug("detaching a dead mount", "target", target)
	err := unix.Unmount(target, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return fmt.Errorf("failed to detach the dead mount at %q: %w", target, err)
}

func (m *mounter) DetachAt(dir *os.File, name string) error {
	if name == "" || name == "." || name == ".." || filepath.Base(name) != name {
		return fmt.Errorf("failed to detach %q in %q: the name must be one path element", name, dir.Name())
	}
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("failed to unshare the filesystem context: %w", err)
	}
	if err := unix.Fchdir(int(dir.Fd())); err != nil {
		return fmt.Errorf("failed to enter %q: %w", dir.Name(), err)
	}
	m.logger.Debug("detaching a dead mount", "dir", dir.Name(), "name", name)
	err := unix.Unmount(name, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return fmt.Errorf("failed to detach the dead mount at %q: %w", filepath.Join(dir.Name(), name), err)
}

func (m *mounter) PrivateTree(tree *os.File) error {
	attr := unix.MountAttr{Propagation: unix.MS_PRIVATE}
	if err := unix.MountSetattr(int(tree.Fd()), "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
		return fmt.Errorf("failed to make the mount tree of %q private: %w", tree.Name(), err)
	}
	return nil
}
