package driver

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// layeredFS reads an image's files as the task will see them in its
// overlay, from the unpacked layer directories on the host, without
// mounting anything: a path is resolved one element at a time through the
// layers (the topmost entry wins, a whiteout hides what is below it, an
// opaque directory hides the lower layers' entries in it), and a symlink
// is followed inside the image's root (an absolute target starts again at
// the image's root, ".." never goes above it). No host path inside a
// layer is ever followed: each layer path the walk takes is made of
// directories it checked itself, and the file is opened below its layer
// with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS).
type layeredFS struct {
	// top are the layer directories, topmost first.
	top []string
}

// newLayeredFS reads the image whose layers are given lowest first.
func newLayeredFS(layers []string) *layeredFS {
	top := make([]string, 0, len(layers))
	for i := len(layers) - 1; i >= 0; i-- {
		top = append(top, layers[i])
	}
	return &layeredFS{top: top}
}

// maxImageSymlinks bounds the symlinks one look-up follows, as the kernel's
// 40.
const maxImageSymlinks = 40

// errImageNotExist is what a look-up of a missing path returns.
var errImageNotExist = os.ErrNotExist

// entry is what a look-up found: the file in layer (an index into top) at
// rel, or, for a directory, every layer that shows it, topmost first.
type entry struct {
	layer int
	rel   string
	mode  os.FileMode
	// stack are the layers whose directory at rel the merged directory
	// is made of.
	stack []int
}

// isWhiteout reports whether fi is overlay's whiteout: a 0/0 character
// device.
func isWhiteout(fi os.FileInfo) bool {
	if fi.Mode()&os.ModeCharDevice == 0 {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && st.Rdev == 0
}

// isOpaque reports whether the directory at path is marked opaque.
func isOpaque(path string) bool {
	buf := make([]byte, 8)
	n, err := unix.Lgetxattr(path, "trusted.overlay.opaque", buf)
	return err == nil && n == 1 && buf[0] == 'y'
}

// child looks up name in the merged directory dir.
func (l *layeredFS) child(dir entry, name string) (entry, error) {
	rel := filepath.Join(dir.rel, name)
	for i, layer := range dir.stack {
		fi, err := os.Lstat(filepath.Join(l.top[layer], rel))
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENOTDIR) {
			continue
		}
		if err != nil {
			return entry{}, err
		}
		if isWhiteout(fi) {
			return entry{}, errImageNotExist
		}
		if !fi.IsDir() {
			return entry{layer: layer, rel: rel, mode: fi.Mode()}, nil
		}
		e := entry{layer: layer, rel: rel, mode: fi.Mode(), stack: []int{layer}}
		if isOpaque(filepath.Join(l.top[layer], rel)) {
			return e, nil
		}
		// The lower layers' directories of the same name show through,
		// down to one that is opaque; anything else there is hidden.
		for _, lower := range dir.stack[i+1:] {
			p := filepath.Join(l.top[lower], rel)
			fi, err := os.Lstat(p)
			if err != nil || !fi.IsDir() {
				if err == nil {
					break
				}
				continue
			}
			e.stack = append(e.stack, lower)
			if isOpaque(p) {
				break
			}
		}
		return e, nil
	}
	return entry{}, errImageNotExist
}

// root is the image's root directory, merged from every layer.
func (l *layeredFS) root() entry {
	root := entry{rel: ".", mode: os.ModeDir | 0o755}
	for i := range l.top {
		root.stack = append(root.stack, i)
	}
	return root
}

// lookup resolves path in the image, following symlinks (the last
// element's too).
func (l *layeredFS) lookup(path string) (entry, error) {
	todo := splitPath(path)
	cur := []entry{l.root()}
	links := 0
	for len(todo) > 0 {
		name := todo[0]
		todo = todo[1:]
		switch name {
		case ".":
			continue
		case "..":
			if len(cur) > 1 {
				cur = cur[:len(cur)-1]
			}
			continue
		}
		dir := cur[len(cur)-1]
		if !dir.mode.IsDir() {
			return entry{}, fmt.Errorf("%q: %w", path, unix.ENOTDIR)
		}
		e, err := l.child(dir, name)
		if err != nil {
			return entry{}, err
		}
		if e.mode&os.ModeSymlink != 0 {
			links++
			if links > maxImageSymlinks {
				return entry{}, fmt.Errorf("%q: %w", path, unix.ELOOP)
			}
			target, err := os.Readlink(filepath.Join(l.top[e.layer], e.rel))
			if err != nil {
				return entry{}, err
			}
			if strings.HasPrefix(target, "/") {
				cur = cur[:1]
			}
			todo = append(splitPath(target), todo...)
			continue
		}
		cur = append(cur, e)
	}
	return cur[len(cur)-1], nil
}

func splitPath(p string) []string {
	var out []string
	for _, s := range strings.Split(p, "/") {
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}

// readFile reads the regular file at path in the image, at most max bytes.
func (l *layeredFS) readFile(path string, max int64) ([]byte, error) {
	e, err := l.lookup(path)
	if err != nil {
		return nil, err
	}
	if !e.mode.IsRegular() {
		return nil, fmt.Errorf("%q in the image is not a regular file", path)
	}
	dir, err := unix.Open(l.top[e.layer], unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dir)
	fd, err := unix.Openat2(dir, e.rel, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC | unix.O_NONBLOCK,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, fmt.Errorf("failed to open %q in the image: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("%q in the image is larger than %d bytes", path, max)
	}
	return b, nil
}

// isSymlink reports whether path's last element is a symlink in the image
// (its parent resolved as lookup does); false when it is missing.
func (l *layeredFS) isSymlink(path string) (bool, error) {
	dir, err := l.lookup(filepath.Dir(filepath.Clean("/" + path)))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		return false, err
	}
	if !dir.mode.IsDir() {
		return false, nil
	}
	e, err := l.child(dir, filepath.Base(path))
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return e.mode&os.ModeSymlink != 0, nil
}

// lacks reports whether the image has no entry at path and every element
// above it that the image has is a directory: a mount target the start
// would make, with no symlink of the image on the way (an error reading
// the layers counts as not lacking).
func (l *layeredFS) lacks(path string) bool {
	dir := l.root()
	for _, name := range splitPath(path) {
		e, err := l.child(dir, name)
		if errors.Is(err, os.ErrNotExist) {
			return true
		}
		if err != nil || !e.mode.IsDir() {
			return false
		}
		dir = e
	}
	return false
}
