package mounter

import (
	"errors"
	"fmt"
	"io"
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
//
// Where the file's mount cannot be cloned (an unbindable mount: EINVAL) or
// locked, the file is copied into a sealed memfd instead (sealedCopy):
// slower to open, as safe.
func OpenSealed(m Interface, path string) (*os.File, error) {
	f, err := openClone(m, path)
	if err == nil {
		return f, nil
	}
	f, cerr := sealedCopy(path)
	if cerr != nil {
		return nil, errors.Join(err, cerr)
	}
	return f, nil
}

func openClone(m Interface, path string) (*os.File, error) {
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

// sealedCopy copies the file at path into a memfd sealed against writes,
// truncation and growth, and returns it opened read-only (exec refuses a
// file someone holds open for writing). A process exec'd from it has the
// memfd as its /proc/<pid>/exe: no host file, and one nobody can change.
func sealedCopy(path string) (*os.File, error) {
	src, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("failed to copy %q into a sealed memfd: %w", path, err)
	}
	defer src.Close()
	fd, err := unix.MemfdCreate("nomad-driver-csi-sealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("failed to copy %q into a sealed memfd: %w", path, err)
	}
	rw := os.NewFile(uintptr(fd), path)
	defer rw.Close()
	if _, err := io.Copy(rw, src); err != nil {
		return nil, fmt.Errorf("failed to copy %q into a sealed memfd: %w", path, err)
	}
	if err := unix.Fchmod(fd, 0o555); err != nil {
		return nil, fmt.Errorf("failed to copy %q into a sealed memfd: %w", path, err)
	}
	seals := unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		return nil, fmt.Errorf("failed to seal the memfd copy of %q: %w", path, err)
	}
	ro, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to reopen the memfd copy of %q: %w", path, err)
	}
	return os.NewFile(uintptr(ro), path), nil
}
