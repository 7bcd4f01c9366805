// Package mounter is the only package of the driver that calls mount(2),
// umount(2) or reads mountinfo. Interface is implemented for real by New
// and in memory by Fake, so that code deciding what to mount can be tested
// without root.
package mounter

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"
)

// Propagation modes accepted by SetPropagation.
const (
	PropagationPrivate = "private"
	PropagationSlave   = "slave"
	PropagationShared  = "shared"
	// PropagationUnbindable is private, and a bind (even a recursive one
	// of a parent) never copies the mount.
	PropagationUnbindable = "unbindable"
)

// maskedOption replaces a sensitive mount option in logs and errors.
const maskedOption = "<masked>"

// Interface mounts and unmounts in the calling process's mount namespace.
// Paths should be absolute.
type Interface interface {
	// Mount calls mount(2). data is never logged nor put in errors; use
	// MountSensitive when some options are secret and others are not.
	Mount(source, target, fstype string, flags uintptr, data string) error
	// MountSensitive mounts with options joined by commas into mount(2)'s
	// data; sensitiveOptions are passed too but appear as "<masked>" in
	// logs and errors.
	MountSensitive(source, target, fstype string, flags uintptr, options, sensitiveOptions []string) error
	// BindMount binds source onto target (with its submounts when
	// recursive). When readOnly, the new mount is then remounted read-only
	// keeping source's nosuid, nodev, noexec and atime flags; recursive
	// read-only binds make every submount read-only too. On error nothing
	// stays mounted at target.
	BindMount(source, target string, readOnly, recursive bool) error
	// RemountReadOnly makes the mount at target (and its submounts when
	// recursive) read-only, keeping its other per-mount flags. It changes
	// only this namespace's view: per-mount flags do not propagate.
	RemountReadOnly(target string, recursive bool) error
	// Unmount unmounts target. A target that is missing or not a mount
	// point is success. EBUSY is retried for about a second and then
	// returned: Unmount never detaches lazily, because a lazily detached
	// mount still holds its device and hides the leak.
	Unmount(target string) error
	// UnmountExact unmounts the mount with mount ID id at path, which must
	// be below root. The path is opened beneath root without following any
	// symlink, and only when what it opens is the root of the mount with
	// that very ID is it unmounted, through the open handle and once (EBUSY
	// is returned, never retried by path). A path someone swapped after the
	// mount table was read therefore cannot steer the unmount to another
	// mount, inside root or out of it.
	UnmountExact(root, path string, id int) error
	// SetPropagation sets target's propagation to one of the Propagation*
	// modes, for its submounts too when recursive.
	SetPropagation(target, mode string, recursive bool) error
	// List returns this process's mount table.
	List() ([]MountPoint, error)
	// IsMountPoint reports whether path (symlinks resolved) is the mount
	// point of some mount in the table. A missing path is an error
	// matching fs.ErrNotExist.
	IsMountPoint(path string) (bool, error)
	// EnsureTarget creates target as a directory (with parents) or as an
	// empty file in an existing or created parent, unless it exists with
	// the right type.
	EnsureTarget(target string, isDir bool) error
	// CloneTree returns a detached copy of the mount tree at source (its
	// submounts too when recursive), made with open_tree(2) in the
	// caller's mount namespace. Another process, in another mount
	// namespace, attaches it with AttachTree, so a mount made on the host
	// after that namespace was created can still be given to it. Closing
	// the file drops the copy unless it was attached.
	CloneTree(source string, recursive bool) (*os.File, error)
	// CloneTreeBeneath is CloneTree of source, a path below the directory
	// dir, with the part of source below dir resolved without following
	// any symlink (dir itself is the caller's): for sources where tasks
	// can write, so that a symlink put in place of source, or of a
	// directory on the way, is an error rather than followed.
	CloneTreeBeneath(dir, source string, recursive bool) (*os.File, error)
	// AttachTree mounts a tree from CloneTree at target, which must exist,
	// with move_mount(2) in the caller's mount namespace.
	AttachTree(tree *os.File, target string) error
	// OpenTarget opens the mount target path below root ("/" for the
	// caller's own root), making what is missing on the way: directories,
	// and the last element as a directory or an empty file. It never
	// follows a symlink: one anywhere on the way is an error, so a target
	// cannot be steered out of root by whoever can write below it. The
	// file is an O_PATH handle for AttachTreeAt; its Name is the joined
	// path.
	OpenTarget(root, path string, isDir bool) (*os.File, error)
	// AttachTreeAt is AttachTree onto a target from OpenTarget: the mount
	// lands on the very directory or file that was opened.
	AttachTreeAt(tree, target *os.File) error
	// LockTree makes a detached tree from CloneTree (every mount in it)
	// read-only, nosuid or nodev, as asked, before it is attached: so the
	// flags are on the mounts themselves, never applied later by a path
	// that someone could have swapped meanwhile.
	LockTree(tree *os.File, readOnly, noSuid, noDev bool) error
	// Stale reports whether path is the mount point of a dead mount: a
	// stat of it fails with ENOTCONN, ESTALE or EIO (a FUSE file system
	// whose daemon died, a stale network handle) while the mount table
	// lists it. A healthy or unmounted path is false; see stale.go.
	Stale(path string) (bool, error)
	// DetachLazy unmounts target with MNT_DETACH, never following a
	// symlink at its last element: only for a dead mount that cannot be
	// unmounted otherwise (no access to it can succeed any more, so
	// nothing is hidden by detaching it). Not a mount point is success.
	DetachLazy(target string) error
	// DetachAt is DetachLazy of the element name inside the directory
	// dir (an O_PATH handle from OpenTarget), so that no path that
	// someone else controls is walked again. It changes the calling
	// thread's working directory after unsharing its filesystem context:
	// call it only on a locked OS thread that is never unlocked.
	DetachAt(dir *os.File, name string) error
	// SetTreePropagation sets the propagation of every mount of a tree
	// from CloneTree to one of the Propagation* modes, detached or once
	// attached (in the caller's mount namespace): through the tree's
	// handle, so that no path (which someone could have swapped, or which
	// leads through a magic link into another mount namespace) is walked.
	SetTreePropagation(tree *os.File, mode string) error
	// PrivateTree makes every mount of a detached tree from CloneTree
	// private before it is attached: no later mount on the host reaches it
	// and none made below it leaves.
	PrivateTree(tree *os.File) error
	// MountOverlay mounts an overlay file system of o at target, which
	// must be a directory. On error nothing is mounted. See overlay.go.
	MountOverlay(target string, o Overlay) error
}

// SanitizeOptions joins options for logging, with every sensitive option
// replaced by "<masked>".
func SanitizeOptions(options, sensitiveOptions []string) string {
	out := make([]string, 0, len(options)+len(sensitiveOptions))
	out = append(out, options...)
	for range sensitiveOptions {
		out = append(out, maskedOption)
	}
	return strings.Join(out, ",")
}

// FindMount returns the mount that path lives on: the last (topmost) mount
// whose Path is path or a parent directory of it. path must be clean and
// absolute, with symlinks resolved.
func FindMount(mounts []MountPoint, path string) (MountPoint, bool) {
	var (
		best  MountPoint
		found bool
	)
	for _, mp := range mounts {
		if onTop(path, best, found, mp) {
			best, found = mp, true
		}
	}
	return best, found
}

// onTop reports whether mp, a line after best's, is the mount path lives
// on rather than best: longer mount paths win; among equal ones the later
// line is the one on top.
func onTop(path string, best MountPoint, found bool, mp MountPoint) bool {
	return PathWithin(path, mp.Path) && (!found || len(mp.Path) >= len(best.Path))
}

// PathWithin reports whether path is dir or below it. Both must be clean.
func PathWithin(path, dir string) bool {
	if dir == "/" || path == dir {
		return true
	}
	return strings.HasPrefix(path, dir+"/")
}

// WithinAny reports whether path is within (PathWithin) any of dirs.
func WithinAny(path string, dirs []string) bool {
	for _, d := range dirs {
		if PathWithin(path, d) {
			return true
		}
	}
	return false
}

type mounter struct {
	logger        hclog.Logger
	mountInfoPath string
}

var _ Interface = (*mounter)(nil)

// New returns the real implementation, logging nothing.
func New() Interface { return NewWithLogger(hclog.NewNullLogger()) }

// NewWithLogger returns the real implementation, logging every mount change
// at debug level (without mount data).
func NewWithLogger(logger hclog.Logger) Interface {
	return &mounter{logger: logger.Named("mounter"), mountInfoPath: "/proc/thread-self/mountinfo"}
}

func (m *mounter) Mount(source, target, fstype string, flags uintptr, data string) error {
	masked := ""
	if data != "" {
		masked = maskedOption
	}
	return m.mount(source, target, fstype, flags, data, masked)
}

func (m *mounter) MountSensitive(source, target, fstype string, flags uintptr, options, sensitiveOptions []string) error {
	all := append(append([]string{}, options...), sensitiveOptions...)
	return m.mount(source, target, fstype, flags, strings.Join(all, ","), SanitizeOptions(options, sensitiveOptions))
}

func (m *mounter) mount(source, target, fstype string, flags uintptr, data, logData string) error {
	m.logger.Debug("mounting", "source", source, "target", target, "fstype", fstype, "flags", flags, "options", logData)
	if err := unix.Mount(source, target, fstype, flags, data); err != nil {
		return fmt.Errorf("failed to mount %q on %q (type %q, flags %#x, options %q): %w",
			source, target, fstype, flags, logData, err)
	}
	return nil
}

func (m *mounter) BindMount(source, target string, readOnly, recursive bool) error {
	flags := uintptr(unix.MS_BIND)
	if recursive {
		flags |= unix.MS_REC
	}
	m.logger.Debug("bind mounting", "source", source, "target", target, "read_only", readOnly, "recursive", recursive)
	if err := unix.Mount(source, target, "", flags, ""); err != nil {
		return fmt.Errorf("failed to bind mount %q on %q: %w", source, target, err)
	}
	if !readOnly {
		return nil
	}
	if err := m.RemountReadOnly(target, recursive); err != nil {
		// Take the writable bind away again rather than leave it.
		if uerr := unix.Unmount(target, unix.MNT_DETACH); uerr != nil {
			m.logger.Warn("failed to undo bind mount", "target", target, "error", uerr)
		}
		return err
	}
	return nil
}

func (m *mounter) RemountReadOnly(target string, recursive bool) error {
	if recursive {
		attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
		err := unix.MountSetattr(unix.AT_FDCWD, target, unix.AT_RECURSIVE|unix.AT_NO_AUTOMOUNT, &attr)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.ENOSYS) {
			return fmt.Errorf("failed to make %q read-only recursively: %w", target, err)
		}
		// Kernel older than 5.12: remount each mount in turn.
		mounts, lerr := m.List()
		if lerr != nil {
			return lerr
		}
		real, rerr := filepath.EvalSymlinks(target)
		if rerr != nil {
			return fmt.Errorf("failed to resolve %q: %w", target, rerr)
		}
		for _, mp := range mounts {
			if PathWithin(mp.Path, real) {
				if err := remountReadOnly(mp.Path); err != nil {
					return err
				}
			}
		}
		return nil
	}
	return remountReadOnly(target)
}

// remountReadOnly remounts one bind mount read-only. The flags that a
// remount would otherwise clear are read back with statfs and kept.
func remountReadOnly(target string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(target, &st); err != nil {
		return fmt.Errorf("failed to read mount flags of %q: %w", target, err)
	}
	flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY)
	keep := []struct {
		st, ms uintptr
	}{
		{unix.ST_NOSUID, unix.MS_NOSUID},
		{unix.ST_NODEV, unix.MS_NODEV},
		{unix.ST_NOEXEC, unix.MS_NOEXEC},
		{unix.ST_NOATIME, unix.MS_NOATIME},
		{unix.ST_NODIRATIME, unix.MS_NODIRATIME},
		{unix.ST_RELATIME, unix.MS_RELATIME},
	}
	for _, k := range keep {
		if uintptr(st.Flags)&k.st != 0 {
			flags |= k.ms
		}
	}
	if err := unix.Mount("", target, "", flags, ""); err != nil {
		return fmt.Errorf("failed to remount %q read-only: %w", target, err)
	}
	return nil
}

func (m *mounter) Unmount(target string) error {
	const attempts = 10
	for i := 0; ; i++ {
		err := unix.Unmount(target, 0)
		switch {
		case err == nil:
			m.logger.Debug("unmounted", "target", target)
			return nil
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			// Not a mount point, or nothing there: already done.
			return nil
		case errors.Is(err, unix.EBUSY) && i < attempts-1:
			time.Sleep(100 * time.Millisecond)
		default:
			return fmt.Errorf("failed to unmount %q: %w", target, err)
		}
	}
}

func (m *mounter) UnmountExact(root, path string, id int) error {
	root, path = filepath.Clean(root), filepath.Clean(path)
	if path == root || !PathWithin(path, root) {
		return fmt.Errorf("%q is not below %q", path, root)
	}
	// The parent is held open, found without following a symlink; the
	// mount point is then named inside that very directory, as the last
	// element, which is never followed either. A handle on the mount
	// itself would keep it busy.
	parent, base := filepath.Dir(path), filepath.Base(path)
	dirFD, err := openBeneath(root, parent)
	if err != nil {
		return err
	}
	defer unix.Close(dirFD)
	var stx unix.Statx_t
	if err := unix.Statx(dirFD, base, unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT, unix.STATX_MNT_ID, &stx); err != nil {
		return fmt.Errorf("failed to look at %q: %w", path, err)
	}
	if stx.Mask&unix.STATX_MNT_ID == 0 || stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return fmt.Errorf("cannot tell which mount %q is on: the kernel reports no mount ID (Linux 5.8 or later does)", path)
	}
	if stx.Mode&unix.S_IFMT == unix.S_IFLNK || stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 || int(stx.Mnt_id) != id {
		return fmt.Errorf("%q is no longer the mount point of mount %d (the path now leads to mount %d): left alone", path, id, stx.Mnt_id)
	}
	// The magic link is the held directory itself, wherever its path
	// leads now.
	target := fmt.Sprintf("/proc/self/fd/%d/%s", dirFD, base)
	if err := unix.Unmount(target, unix.UMOUNT_NOFOLLOW); err != nil {
		if errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("mount %d at %q was unmounted meanwhile: %w", id, path, err)
		}
		return fmt.Errorf("failed to unmount %q: %w", path, err)
	}
	m.logger.Debug("unmounted", "target", path, "mount_id", id)
	return nil
}

// openBeneath opens dir, root itself or a directory below it, as an O_PATH
// handle without following a symlink on the way (root itself is the
// caller's).
func openBeneath(root, dir string) (int, error) {
	if dir == root {
		fd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, fmt.Errorf("failed to open %q: %w", root, err)
		}
		return fd, nil
	}
	return openBeneathFlags(root, dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC|unix.O_NOFOLLOW)
}

// openBeneathFlags opens path, below the directory root, with the open
// flags flags, without following a symlink below root.
func openBeneathFlags(root, path string, flags uint64) (int, error) {
	rootFD, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("failed to open %q: %w", root, err)
	}
	defer unix.Close(rootFD)
	rel, err := filepath.Rel(root, path)
	if err != nil {
		return -1, fmt.Errorf("%q is not below %q", path, root)
	}
	fd, err := unix.Openat2(rootFD, rel, &unix.OpenHow{
		Flags:   flags,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return -1, fmt.Errorf("failed to open %q below %q without following symlinks: %w", rel, root, err)
	}
	return fd, nil
}

// PropagationFlags returns the mount(2) flags for a Propagation* mode.
func PropagationFlags(mode string, recursive bool) (uintptr, error) {
	var flags uintptr
	switch mode {
	case PropagationPrivate:
		flags = unix.MS_PRIVATE
	case PropagationSlave:
		flags = unix.MS_SLAVE
	case PropagationShared:
		flags = unix.MS_SHARED
	case PropagationUnbindable:
		flags = unix.MS_UNBINDABLE
	default:
		return 0, fmt.Errorf("unknown propagation mode %q: want %q, %q, %q or %q",
			mode, PropagationPrivate, PropagationSlave, PropagationShared, PropagationUnbindable)
	}
	if recursive {
		flags |= unix.MS_REC
	}
	return flags, nil
}

func (m *mounter) SetPropagation(target, mode string, recursive bool) error {
	flags, err := PropagationFlags(mode, recursive)
	if err != nil {
		return err
	}
	m.logger.Trace("setting propagation", "target", target, "mode", mode, "recursive", recursive)
	if err := unix.Mount("", target, "", flags, ""); err != nil {
		return fmt.Errorf("failed to make %q %s: %w", target, mode, err)
	}
	return nil
}

func (m *mounter) List() ([]MountPoint, error) {
	f, err := os.Open(m.mountInfoPath)
	if err != nil {
		return nil, fmt.Errorf("failed to open %q: %w", m.mountInfoPath, err)
	}
	defer f.Close()
	return ParseMountInfo(f)
}

// MaxProcessMountInfo bounds how much of another process's mount table
// ProcessMountAt reads: far more than a node's (a few hundred bytes a
// mount), far less than a process allowed to mount can make its own (up
// to fs.mount-max mounts, each line up to tens of KiB).
const MaxProcessMountInfo = 16 << 20

// ProcessMountAt returns the mount that path lives on (FindMount) in the
// mount table of process pid as the host's /proc shows it (paths relative
// to that process's root). The table may be a hostile task's: it is read
// a line at a time, keeping only that mount, and no further than
// MaxProcessMountInfo bytes. The caller checks that pid was still the
// process it meant once this returns (its pidfd).
func ProcessMountAt(pid int, path string) (MountPoint, bool, error) {
	name := fmt.Sprintf("/proc/%d/mountinfo", pid)
	f, err := os.Open(name)
	if err != nil {
		return MountPoint{}, false, fmt.Errorf("failed to open %q: %w", name, err)
	}
	defer f.Close()
	mp, ok, err := findMountIn(f, path, MaxProcessMountInfo)
	if err != nil {
		return MountPoint{}, false, fmt.Errorf("failed to read %q: %w", name, err)
	}
	return mp, ok, nil
}

// findMountIn is FindMount over the mountinfo read from r, holding one line
// at a time, and an error once more than limit bytes are read.
func findMountIn(r io.Reader, path string, limit int64) (MountPoint, bool, error) {
	lr := &io.LimitedReader{R: r, N: limit + 1}
	var (
		best  MountPoint
		found bool
	)
	err := eachMountInfo(lr, func(mp MountPoint) {
		if onTop(path, best, found, mp) {
			best, found = mp, true
		}
	})
	// Checked first: the line cut at the limit may not parse.
	if lr.N <= 0 {
		return MountPoint{}, false, fmt.Errorf("the mount table is longer than %d bytes", limit)
	}
	if err != nil {
		return MountPoint{}, false, err
	}
	return best, found, nil
}

func (m *mounter) IsMountPoint(path string) (bool, error) {
	real, err := resolve(path)
	if err != nil {
		return false, err
	}
	if root, ok := mountRoot(real); ok {
		return root, nil
	}
	mounts, err := m.List()
	if err != nil {
		return false, err
	}
	return isMountPoint(mounts, real), nil
}

// mountRoot answers whether path is the root of a mount from statx(2)'s
// STATX_ATTR_MOUNT_ROOT (Linux 5.8), in one call; ok is false when the
// kernel does not say or the call fails (a dead FUSE mount answers
// ENOTCONN), and the mount table must be read instead. Reading the table
// costs a line per mount of the node, two per CSI volume published on it:
// a check per volume per start made hundreds of volumes cost the square of
// their number.
func mountRoot(path string) (root, ok bool) {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_DONT_SYNC, 0, &stx); err != nil {
		return false, false
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, false
	}
	return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, true
}

func isMountPoint(mounts []MountPoint, path string) bool {
	for _, mp := range mounts {
		if mp.Path == path {
			return true
		}
	}
	return false
}

// resolve makes path absolute and clean with symlinks resolved.
func resolve(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("failed to make %q absolute: %w", path, err)
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return "", fmt.Errorf("failed to resolve %q: %w", path, err)
	}
	return real, nil
}

func (m *mounter) CloneTree(source string, recursive bool) (*os.File, error) {
	flags := uint(unix.OPEN_TREE_CLONE | unix.OPEN_TREE_CLOEXEC)
	if recursive {
		flags |= unix.AT_RECURSIVE
	}
	m.logger.Debug("cloning mount tree", "source", source, "recursive", recursive)
	fd, err := unix.OpenTree(unix.AT_FDCWD, source, flags)
	if err != nil {
		return nil, fmt.Errorf("failed to clone the mount tree at %q: %w", source, err)
	}
	return os.NewFile(uintptr(fd), source), nil
}

func (m *mounter) CloneTreeBeneath(dir, source string, recursive bool) (*os.File, error) {
	dir, source = filepath.Clean(dir), filepath.Clean(source)
	if source == dir || !PathWithin(source, dir) {
		return nil, fmt.Errorf("failed to clone the mount tree at %q: it is not below %q", source, dir)
	}
	fd, err := openBeneathFlags(dir, source, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			err = fmt.Errorf("%w: a symlink on the way is never followed", err)
		}
		return nil, fmt.Errorf("failed to clone the mount tree at %q: %w", source, err)
	}
	defer unix.Close(fd)
	// RESOLVE_NO_SYMLINKS still opens a symlink at the last element,
	// as itself, under O_PATH|O_NOFOLLOW.
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("failed to clone the mount tree at %q: %w", source, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return nil, fmt.Errorf("failed to clone the mount tree at %q: it is a symlink, which is never followed", source)
	}
	flags := uint(unix.OPEN_TREE_CLONE | unix.OPEN_TREE_CLOEXEC | unix.AT_EMPTY_PATH)
	if recursive {
		flags |= unix.AT_RECURSIVE
	}
	m.logger.Debug("cloning mount tree", "source", source, "beneath", dir, "recursive", recursive)
	tree, err := unix.OpenTree(fd, "", flags)
	if err != nil {
		return nil, fmt.Errorf("failed to clone the mount tree at %q: %w", source, err)
	}
	return os.NewFile(uintptr(tree), source), nil
}

func (m *mounter) AttachTree(tree *os.File, target string) error {
	m.logger.Debug("attaching mount tree", "source", tree.Name(), "target", target)
	if err := unix.MoveMount(int(tree.Fd()), "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("failed to attach the mount tree of %q at %q: %w", tree.Name(), target, err)
	}
	return nil
}

func (m *mounter) AttachTreeAt(tree, target *os.File) error {
	m.logger.Debug("attaching mount tree", "source", tree.Name(), "target", target.Name())
	err := unix.MoveMount(int(tree.Fd()), "", int(target.Fd()), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH)
	if err != nil {
		return fmt.Errorf("failed to attach the mount tree of %q at %q: %w", tree.Name(), target.Name(), err)
	}
	return nil
}

func (m *mounter) LockTree(tree *os.File, readOnly, noSuid, noDev bool) error {
	var set uint64
	if readOnly {
		set |= unix.MOUNT_ATTR_RDONLY
	}
	if noSuid {
		set |= unix.MOUNT_ATTR_NOSUID
	}
	if noDev {
		set |= unix.MOUNT_ATTR_NODEV
	}
	if set == 0 {
		return nil
	}
	attr := unix.MountAttr{Attr_set: set}
	if err := unix.MountSetattr(int(tree.Fd()), "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
		return fmt.Errorf("failed to set the flags of the mount tree of %q: %w", tree.Name(), err)
	}
	return nil
}

func (m *mounter) SetTreePropagation(tree *os.File, mode string) error {
	flags, err := PropagationFlags(mode, false)
	if err != nil {
		return err
	}
	attr := unix.MountAttr{Propagation: uint64(flags)}
	if err := unix.MountSetattr(int(tree.Fd()), "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
		return fmt.Errorf("failed to make the mount tree of %q %s: %w", tree.Name(), mode, err)
	}
	return nil
}

// ErrSymlinkTarget is returned by OpenTarget for a path that passes
// through a symlink.
var ErrSymlinkTarget = errors.New("mount targets are never made through symlinks")

func (m *mounter) OpenTarget(root, path string, isDir bool) (*os.File, error) {
	return openTarget(root, path, isDir)
}

// openTarget walks path one element at a time from root with O_NOFOLLOW,
// so that no element is ever a symlink that was followed: a symlink is
// opened as itself and refused.
func openTarget(root, path string, isDir bool) (*os.File, error) {
	name := filepath.Join(root, path)
	fail := func(err error) (*os.File, error) {
		return nil, fmt.Errorf("mount target %q: %w", name, err)
	}
	cur, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	rel := strings.Trim(filepath.Clean("/"+path), "/")
	if rel == "" {
		if !isDir {
			_ = unix.Close(cur)
			return fail(errors.New("exists and is a directory, want a file"))
		}
		return os.NewFile(uintptr(cur), name), nil
	}
	elems := strings.Split(rel, "/")
	for i, elem := range elems {
		last := i == len(elems)-1
		wantDir := !last || isDir
		next, err := openElem(cur, elem, wantDir)
		_ = unix.Close(cur)
		if err != nil {
			return fail(fmt.Errorf("%q: %w", "/"+strings.Join(elems[:i+1], "/"), err))
		}
		cur = next
	}
	return os.NewFile(uintptr(cur), name), nil
}

// openElem opens (making it when missing) one element below the directory
// dir as an O_PATH handle of the wanted type.
func openElem(dir int, elem string, wantDir bool) (int, error) {
	for attempt := 0; ; attempt++ {
		fd, err := unix.Openat(dir, elem, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.ENOENT) && attempt == 0 {
			if wantDir {
				err = unix.Mkdirat(dir, elem, 0o755)
			} else {
				var f int
				f, err = unix.Openat(dir, elem, unix.O_CREAT|unix.O_EXCL|unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o644)
				if err == nil {
					_ = unix.Close(f)
				}
			}
			if err != nil && !errors.Is(err, unix.EEXIST) {
				return -1, fmt.Errorf("failed to create it: %w", err)
			}
			continue
		}
		if err != nil {
			return -1, err
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			_ = unix.Close(fd)
			return -1, err
		}
		switch typ := st.Mode & unix.S_IFMT; {
		case typ == unix.S_IFLNK:
			_ = unix.Close(fd)
			return -1, fmt.Errorf("is a symlink: %w", ErrSymlinkTarget)
		case wantDir && typ != unix.S_IFDIR:
			_ = unix.Close(fd)
			return -1, errors.New("exists and is not a directory")
		case !wantDir && typ == unix.S_IFDIR:
			_ = unix.Close(fd)
			return -1, errors.New("exists and is a directory, want a file")
		}
		return fd, nil
	}
}

func (m *mounter) EnsureTarget(target string, isDir bool) error {
	return ensureTarget(target, isDir)
}

func ensureTarget(target string, isDir bool) error {
	fi, err := os.Stat(target)
	switch {
	case err == nil:
		if fi.IsDir() != isDir {
			if isDir {
				return fmt.Errorf("mount target %q exists and is not a directory", target)
			}
			return fmt.Errorf("mount target %q exists and is a directory, want a file", target)
		}
		return nil
	case !errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("failed to check mount target %q: %w", target, err)
	}
	if isDir {
		if err := os.MkdirAll(target, 0o755); err != nil {
			return fmt.Errorf("failed to create mount target %q: %w", target, err)
		}
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return fmt.Errorf("failed to create parent of mount target %q: %w", target, err)
	}
	f, err := os.OpenFile(target, os.O_CREATE|os.O_RDONLY|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return fmt.Errorf("failed to create mount target %q: %w", target, err)
	}
	return f.Close()
}
