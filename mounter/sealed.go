package mounter

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// OpenSealed opens the file at path for reading through a detached clone of
// its mount that m makes read-only, nosuid and nodev (CloneTree, LockTree).
// The clone is in no mount table and goes away with the last descriptor or
// process image that uses it.
//
// It is for binaries the driver runs inside a task's namespaces (its own,
// the supervisor's): a process exec'd from the returned file has it as its
// /proc/<pid>/exe, and whoever opens that link gets the file on the
// read-only clone, never on the host's mount, so writing, truncating,
// chmod, chown, extended attributes and times all fail with EROFS.
func OpenSealed(m Interface, path string) (*os.File, error) {
	tree, err := m.CloneTree(path, false)
	if err != nil {
		return nil, err
	}
	defer tree.Close()
	if err := m.LockTree(tree, true, true, true); err != nil {
		return nil, err
	}
	// The tree is an O_PATH handle on the clone's root, the file itself:
	// opened again through it, the file keeps the clone as its mount.
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", tree.Fd()), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to open %q through its read-only clone: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}
