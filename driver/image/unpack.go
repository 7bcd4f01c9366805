package image

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// A layer is unpacked into a directory of its own that overlayfs stacks
// later, so its tar is written in overlay's form: a whiteout ".wh.x" becomes
// a 0/0 character device x, an opaque marker ".wh..wh..opq" the xattr
// trusted.overlay.opaque on its directory.
//
// Nothing is ever written by following a path: every parent directory is
// resolved from the layer's root with openat2(RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS) (or created one component at a time from a directory
// fd), and each entry is made with the *at call on that parent. An entry
// that names ".." or goes through a symlink fails the layer; a symlink's
// target is stored as written, never resolved; a hard link's target must be
// an entry of the same layer.

const (
	whiteoutPrefix = ".wh."
	opaqueMarker   = ".wh..wh..opq"
	// whiteoutMeta prefixes aufs' own entries (hard link directories);
	// they mean nothing to overlay.
	whiteoutMeta = ".wh..wh."
	opaqueXattr  = "trusted.overlay.opaque"
)

// ErrUnsafeLayer is a layer that tries to write outside its root or holds
// an entry the store refuses.
var ErrUnsafeLayer = errors.New("unsafe layer")

// keptXattr says which extended attributes of a layer's entries are
// written: file capabilities (privileged plugins need them), user
// attributes and ACLs. trusted.* (overlay's own attributes among them:
// redirect, metacopy, origin could steer the overlay), user.overlay.*
// (the same attributes, which overlay reads instead on a mount with
// userxattr) and other security.* attributes (labels of another host's
// policy) are dropped.
func keptXattr(name string) bool {
	if strings.HasPrefix(name, "user.overlay.") {
		return false
	}
	return name == "security.capability" || strings.HasPrefix(name, "user.") ||
		name == "system.posix_acl_access" || name == "system.posix_acl_default"
}

// resolveFlags resolve a path inside a layer's root: never above it, never
// through a symlink.
const resolveFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// unpacker writes one layer's entries under root.
type unpacker struct {
	root int // O_PATH fd of the layer's root directory
	// dirTimes are set last, deepest first: writing a directory's entries
	// changes its mtime.
	dirTimes []dirTime
	// parent caches the fd of the last parent directory.
	parentRel string
	parentFd  int
	// size is the bytes of regular files written.
	size int64
	// bounds (nil: none) is what the image may still take; charged is
	// what this layer took of it, given back by the caller on failure.
	bounds  *bounds
	charged *atomic.Int64
}

type dirTime struct {
	rel  string
	hdr  *tar.Header
	root bool
}

// unpackTar writes the tar stream r into the directory dir (which exists
// and is empty); it returns the bytes of file content written. dir is the
// store's own, made by the caller: nothing in it is followed. The caller
// bounds r (charging b.size and charged as it is read); b (when not nil)
// bounds the entries made, and the bytes of sparse files, which a tar
// holds in far fewer bytes than they unpack to.
func unpackTar(r io.Reader, dir string, b *bounds, charged *atomic.Int64) (_ int64, err error) {
	root, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("failed to open layer directory %q: %w", dir, err)
	}
	u := &unpacker{root: root, parentFd: -1, bounds: b, charged: charged}
	var entries *atomic.Int64
	if b != nil {
		entries = &b.entries
	}
	defer u.close()
	var made int64
	defer func() {
		// A layer that fails gives its entries back: it is tried again,
		// or the pull fails.
		if err != nil && entries != nil {
			entries.Add(made)
		}
	}()
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return 0, fmt.Errorf("failed to read the layer's tar: %w", err)
		}
		if entries != nil {
			made++
			if entries.Add(-1) < 0 {
				return 0, errTooManyEntries
			}
		}
		if err := u.entry(hdr, tr); err != nil {
			return 0, err
		}
	}
	for i := len(u.dirTimes) - 1; i >= 0; i-- {
		u.setDirTime(u.dirTimes[i])
	}
	return u.size, nil
}

func (u *unpacker) close() {
	if u.parentFd >= 0 {
		unix.Close(u.parentFd)
	}
	unix.Close(u.root)
}

// errTooLarge and errTooManyEntries are turned into errors that name the
// image by the caller, which knows it.
var (
	errTooLarge       = errors.New("the image unpacks to more than image_max_size")
	errTooManyEntries = errors.New("the image has more files than the store takes")
)

// MaxEntries bounds the files, directories and links of one image: its
// inodes on root_dir's file system (a real image has thousands; a hostile
// one of small files could take the node's inodes within image_max_size).
const MaxEntries = 1 << 20

// cleanName turns a tar entry name into a path relative to the layer's
// root ("" for the root itself). A name with a ".." component is refused,
// not clamped: no honest image has one. A leading "/" is read as the root.
func cleanName(name string) (string, error) {
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", fmt.Errorf("%w: entry %q climbs out of the layer's root", ErrUnsafeLayer, name)
		}
	}
	if strings.ContainsRune(name, 0) {
		return "", fmt.Errorf("%w: entry %q has a NUL byte", ErrUnsafeLayer, name)
	}
	rel := strings.TrimPrefix(path.Clean("/"+name), "/")
	return rel, nil
}

func (u *unpacker) entry(hdr *tar.Header, content io.Reader) error {
	if hdr.Typeflag == tar.TypeXGlobalHeader {
		return nil
	}
	rel, err := cleanName(hdr.Name)
	if err != nil {
		return err
	}
	if rel == "" {
		// The root directory's own entry ("./").
		if hdr.Typeflag != tar.TypeDir {
			return fmt.Errorf("%w: the root entry %q is not a directory", ErrUnsafeLayer, hdr.Name)
		}
		fd, err := unix.Openat(u.root, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("failed to open the layer's root: %w", err)
		}
		defer unix.Close(fd)
		if err := applyMeta(fd, hdr); err != nil {
			return fmt.Errorf("entry %q: %w", hdr.Name, err)
		}
		u.dirTimes = append(u.dirTimes, dirTime{hdr: hdr, root: true})
		return nil
	}
	dir, base := path.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	if hdr.Uid < 0 || hdr.Gid < 0 || hdr.Uid > 1<<32-2 || hdr.Gid > 1<<32-2 {
		return fmt.Errorf("%w: entry %q has owner %d:%d", ErrUnsafeLayer, hdr.Name, hdr.Uid, hdr.Gid)
	}
	parent, err := u.parentDir(dir, hdr.Name)
	if err != nil {
		return err
	}
	if strings.HasPrefix(base, whiteoutPrefix) {
		return u.whiteout(parent, dir, base, hdr.Name)
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		return u.mkdir(parent, rel, base, hdr)
	case tar.TypeReg: // the reader gives old tars' TypeRegA as TypeReg
		return u.file(parent, base, hdr, content)
	case tar.TypeSymlink:
		if err := u.replace(parent, base, false); err != nil {
			return fmt.Errorf("entry %q: %w", hdr.Name, err)
		}
		if strings.ContainsRune(hdr.Linkname, 0) || hdr.Linkname == "" {
			return fmt.Errorf("%w: symlink %q has an empty or NUL target", ErrUnsafeLayer, hdr.Name)
		}
		if err := unix.Symlinkat(hdr.Linkname, parent, base); err != nil {
			return fmt.Errorf("failed to create symlink %q: %w", hdr.Name, err)
		}
		return u.metaAt(parent, base, hdr, false)
	case tar.TypeLink:
		return u.hardlink(parent, base, hdr)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		if err := u.replace(parent, base, false); err != nil {
			return fmt.Errorf("entry %q: %w", hdr.Name, err)
		}
		mode := uint32(hdr.Mode) & 0o7777
		switch hdr.Typeflag {
		case tar.TypeChar:
			mode |= unix.S_IFCHR
		case tar.TypeBlock:
			mode |= unix.S_IFBLK
		default:
			mode |= unix.S_IFIFO
		}
		if hdr.Devmajor < 0 || hdr.Devminor < 0 || hdr.Devmajor > 1<<12-1 || hdr.Devminor > 1<<20-1 {
			return fmt.Errorf("%w: device %q has number %d:%d", ErrUnsafeLayer, hdr.Name, hdr.Devmajor, hdr.Devminor)
		}
		if err := unix.Mknodat(parent, base, mode, int(unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor)))); err != nil {
			return fmt.Errorf("failed to create %q: %w", hdr.Name, err)
		}
		return u.metaAt(parent, base, hdr, true)
	default:
		return fmt.Errorf("%w: entry %q has tar type %q, which an image layer does not hold", ErrUnsafeLayer, hdr.Name, string(hdr.Typeflag))
	}
}

// parentDir returns an fd of the directory rel (relative to the root),
// creating missing directories (root's, 0755: the tar may name them only
// later, or never). A component that is not a directory (a symlink above
// all) fails the entry.
func (u *unpacker) parentDir(rel, name string) (int, error) {
	if rel == "" {
		return u.root, nil
	}
	if u.parentFd >= 0 && u.parentRel == rel {
		return u.parentFd, nil
	}
	fd, err := unix.Openat2(u.root, rel, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolveFlags})
	if errors.Is(err, unix.ENOENT) {
		fd, err = u.mkdirAll(rel, name)
	}
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.EXDEV) {
			return -1, fmt.Errorf("%w: entry %q goes through a symlink or a file (%s)", ErrUnsafeLayer, name, rel)
		}
		return -1, fmt.Errorf("failed to open the directory of entry %q: %w", name, err)
	}
	if u.parentFd >= 0 {
		unix.Close(u.parentFd)
	}
	u.parentFd, u.parentRel = fd, rel
	return fd, nil
}

// mkdirAll walks rel one component at a time from the root, creating what
// is missing; it never follows a symlink.
func (u *unpacker) mkdirAll(rel, name string) (int, error) {
	cur, err := unix.Dup(u.root)
	if err != nil {
		return -1, err
	}
	for _, c := range strings.Split(rel, "/") {
		next, err := unix.Openat(cur, c, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.ENOENT) {
			if err = unix.Mkdirat(cur, c, 0o755); err == nil || errors.Is(err, unix.EEXIST) {
				next, err = unix.Openat(cur, c, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			}
		}
		unix.Close(cur)
		if err != nil {
			return -1, err
		}
		cur = next
	}
	return cur, nil
}

// replace makes room for an entry named base: a later entry of the same
// name wins, as when a tar is extracted. An existing directory stays when
// the new entry is one too (keepDir).
func (u *unpacker) replace(parent int, base string, keepDir bool) error {
	var st unix.Stat_t
	err := unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		if keepDir {
			return nil
		}
		// The cached parent may be inside what goes.
		if u.parentFd >= 0 && u.parentFd != parent {
			unix.Close(u.parentFd)
			u.parentFd, u.parentRel = -1, ""
		}
		return removeAllAt(parent, base)
	}
	return unix.Unlinkat(parent, base, 0)
}

// removeAllAt removes the directory name in parent and everything in it,
// through directory fds only.
func removeAllAt(parent int, name string) error {
	fd, err := unix.Openat(parent, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	names, err := f.Readdirnames(-1)
	if err != nil {
		f.Close()
		return err
	}
	for _, n := range names {
		if err := unix.Unlinkat(fd, n, 0); err != nil {
			if !errors.Is(err, unix.EISDIR) {
				f.Close()
				return err
			}
			if err := removeAllAt(fd, n); err != nil {
				f.Close()
				return err
			}
		}
	}
	f.Close()
	return unix.Unlinkat(parent, name, unix.AT_REMOVEDIR)
}

func (u *unpacker) whiteout(parent int, dir, base, name string) error {
	if base == opaqueMarker {
		fd, err := u.openDir(dir)
		if err != nil {
			return fmt.Errorf("entry %q: %w", name, err)
		}
		defer unix.Close(fd)
		if err := unix.Fsetxattr(fd, opaqueXattr, []byte("y"), 0); err != nil {
			return fmt.Errorf("failed to mark %q opaque: %w", dir, err)
		}
		return nil
	}
	if strings.HasPrefix(base, whiteoutMeta) {
		return nil
	}
	target := strings.TrimPrefix(base, whiteoutPrefix)
	if target == "" || target == "." || target == ".." {
		return fmt.Errorf("%w: whiteout %q names nothing", ErrUnsafeLayer, name)
	}
	// A whiteout hides what lower layers have; an entry of this layer
	// with the same name stays (the image spec's rule).
	var st unix.Stat_t
	if err := unix.Fstatat(parent, target, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		return nil
	}
	if err := unix.Mknodat(parent, target, unix.S_IFCHR, 0); err != nil {
		return fmt.Errorf("failed to write whiteout %q: %w", name, err)
	}
	return unix.Fchownat(parent, target, 0, 0, unix.AT_SYMLINK_NOFOLLOW)
}

// openDir opens the directory rel for reading (to set xattrs and times).
func (u *unpacker) openDir(rel string) (int, error) {
	if rel == "" {
		return unix.Openat(u.root, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	}
	return unix.Openat2(u.root, rel, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolveFlags})
}

func (u *unpacker) mkdir(parent int, rel, base string, hdr *tar.Header) error {
	if err := u.replace(parent, base, true); err != nil {
		return fmt.Errorf("entry %q: %w", hdr.Name, err)
	}
	if err := unix.Mkdirat(parent, base, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("failed to create directory %q: %w", hdr.Name, err)
	}
	fd, err := unix.Openat(parent, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failed to open directory %q: %w", hdr.Name, err)
	}
	defer unix.Close(fd)
	if err := applyMeta(fd, hdr); err != nil {
		return fmt.Errorf("entry %q: %w", hdr.Name, err)
	}
	u.dirTimes = append(u.dirTimes, dirTime{rel: rel, hdr: hdr})
	return nil
}

// sparse says whether hdr is a sparse file (PAX's GNU.sparse records: the
// tar reader fills its holes with zeros as it is read).
func sparse(hdr *tar.Header) bool {
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}

func (u *unpacker) file(parent int, base string, hdr *tar.Header, content io.Reader) error {
	if sparse(hdr) && u.bounds != nil {
		// Its holes are written as zeros: their bytes are charged as
		// the rest of the tar's are, before they are written.
		if u.charged != nil {
			u.charged.Add(hdr.Size)
		}
		if u.bounds.size.Add(-hdr.Size) < 0 {
			return errTooLarge
		}
	}
	if err := u.replace(parent, base, false); err != nil {
		return fmt.Errorf("entry %q: %w", hdr.Name, err)
	}
	fd, err := unix.Openat(parent, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("failed to create %q: %w", hdr.Name, err)
	}
	f := os.NewFile(uintptr(fd), base)
	defer f.Close()
	n, err := io.Copy(f, content)
	if err != nil {
		return fmt.Errorf("failed to write %q: %w", hdr.Name, err)
	}
	if n != hdr.Size {
		return fmt.Errorf("failed to write %q: the tar holds %d of its %d bytes", hdr.Name, n, hdr.Size)
	}
	u.size += n
	if err := applyMeta(fd, hdr); err != nil {
		return fmt.Errorf("entry %q: %w", hdr.Name, err)
	}
	return setTimes(parent, base, hdr)
}

func (u *unpacker) hardlink(parent int, base string, hdr *tar.Header) error {
	target, err := cleanName(hdr.Linkname)
	if err != nil {
		return fmt.Errorf("%w: hard link %q to %q climbs out of the layer's root", ErrUnsafeLayer, hdr.Name, hdr.Linkname)
	}
	if target == "" {
		return fmt.Errorf("%w: hard link %q to the layer's root", ErrUnsafeLayer, hdr.Name)
	}
	// O_PATH|O_NOFOLLOW takes a symlink itself; RESOLVE_NO_SYMLINKS
	// refuses one on the way.
	src, err := unix.Openat2(u.root, target, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: resolveFlags})
	if err != nil {
		return fmt.Errorf("%w: hard link %q to %q, which is not an entry of the layer before it", ErrUnsafeLayer, hdr.Name, hdr.Linkname)
	}
	defer unix.Close(src)
	var st unix.Stat_t
	if err := unix.Fstat(src, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return fmt.Errorf("%w: hard link %q to the directory %q", ErrUnsafeLayer, hdr.Name, hdr.Linkname)
	}
	if err := u.replace(parent, base, false); err != nil {
		return fmt.Errorf("entry %q: %w", hdr.Name, err)
	}
	if err := unix.Linkat(src, "", parent, base, unix.AT_EMPTY_PATH); err != nil {
		return fmt.Errorf("failed to link %q to %q: %w", hdr.Name, hdr.Linkname, err)
	}
	return nil
}

// applyMeta sets owner, mode and xattrs through an open fd: owner first
// (chown clears setuid bits and file capabilities), then mode, then the
// xattrs.
func applyMeta(fd int, hdr *tar.Header) error {
	if err := unix.Fchown(fd, hdr.Uid, hdr.Gid); err != nil {
		return fmt.Errorf("failed to set owner %d:%d: %w", hdr.Uid, hdr.Gid, err)
	}
	if err := unix.Fchmod(fd, uint32(hdr.Mode)&0o7777); err != nil {
		return fmt.Errorf("failed to set mode %o: %w", hdr.Mode&0o7777, err)
	}
	return setXattrs(fd, hdr)
}

func setXattrs(fd int, hdr *tar.Header) error {
	for k, v := range hdr.PAXRecords {
		name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok || !keptXattr(name) {
			continue
		}
		if err := unix.Fsetxattr(fd, name, []byte(v), 0); err != nil {
			return fmt.Errorf("failed to set xattr %q: %w", name, err)
		}
	}
	return nil
}

// metaAt sets owner (and, for a device or fifo, mode) and times of an
// entry that cannot be opened for writing, without following it.
func (u *unpacker) metaAt(parent int, base string, hdr *tar.Header, chmod bool) error {
	if err := unix.Fchownat(parent, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("failed to set the owner of %q: %w", hdr.Name, err)
	}
	if chmod {
		// A device node or fifo this call just made: not a symlink.
		if err := unix.Fchmodat(parent, base, uint32(hdr.Mode)&0o7777, 0); err != nil {
			return fmt.Errorf("failed to set the mode of %q: %w", hdr.Name, err)
		}
	}
	return setTimes(parent, base, hdr)
}

func setTimes(parent int, base string, hdr *tar.Header) error {
	atime := hdr.AccessTime
	if atime.IsZero() {
		atime = hdr.ModTime
	}
	ts := []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
	if err := unix.UtimesNanoAt(parent, base, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("failed to set the times of %q: %w", hdr.Name, err)
	}
	return nil
}

// setDirTime sets a directory's times once its entries are written. A
// directory a later entry replaced is skipped: it is resolved again,
// without following symlinks.
func (u *unpacker) setDirTime(d dirTime) {
	if d.root {
		_ = setTimes(u.root, ".", d.hdr)
		return
	}
	dir, base := path.Split(d.rel)
	parent := u.root
	if dir = strings.TrimSuffix(dir, "/"); dir != "" {
		fd, err := unix.Openat2(u.root, dir, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolveFlags})
		if err != nil {
			return
		}
		defer unix.Close(fd)
		parent = fd
	}
	var st unix.Stat_t
	if err := unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return
	}
	_ = setTimes(parent, base, d.hdr)
}
