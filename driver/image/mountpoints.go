package image

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
	"unicode"

	"golang.org/x/sys/unix"
)

// MountPoint is the target of one of a task's mounts: a path in the task's
// root, and whether the mount is of a directory.
type MountPoint struct {
	Path string
	Dir  bool
}

const (
	// mountPointsDir, in the store, holds the mount-point layers.
	mountPointsDir = "mountpoints"
	// maxMountEntries bounds the entries of one layer, the targets' parent
	// directories counted, and maxMountPath the length of a target.
	maxMountEntries = 64
	maxMountPath    = 1024
	// staleMountLayerTmp is how old a half-made layer must be before a
	// later creation removes it (a driver killed while making it).
	staleMountLayerTmp = time.Minute
)

// maxMountLayers bounds how many mount-point layers the store keeps: each
// is a few empty directories, one per distinct set of targets (those of
// Nomad's directories, a plugin's socket directory and the host's
// resolv.conf and hosts are the same for every task of a kind, but a host
// volume's destination is the job's to choose). Past it, tasks go without
// one. With maxMountEntries, what a job that chooses its mounts' targets
// can make the store keep is bounded: 64 layers of 64 entries.
// A variable for tests.
var maxMountLayers = 64

// ErrMountLayersFull is MountLayer's error when the store keeps as many
// mount-point layers as it may.
var ErrMountLayersFull = errors.New("the store keeps as many mount-point layers as it may")

// MountLayer returns the directory of a read-only layer that has each of
// points as an empty directory or an empty file (and their parent
// directories), to go below an image's layers (the lowest): the targets of
// a task's mounts, made once and shared by every task whose targets are the
// same, instead of made in each task's writable layer at its start, each
// with a lookup in every layer and a create on disk.
//
// Below the image's layers the layer changes nothing a task could see but
// the targets it gets anyway: a file, a symlink or a whiteout of the image
// at the same path hides its entry, as an opaque directory hides what is
// below it, and the task's mount is then made where it would be without
// the layer; a directory of the image merges with the layer's, as any two
// layers' directories do, and keeps its own mode and owner. A layer is complete
// before its name exists and never changed after; one that lost entries
// with a crash only leaves those targets to be made at the start, as
// before.
//
// It returns "" and no error when there is nothing to make, and
// ErrMountLayersFull when the store already keeps maxMountLayers layers.
func (s *Store) MountLayer(points []MountPoint) (string, error) {
	paths, err := mountLayerPaths(points)
	if err != nil || len(paths) == 0 {
		return "", err
	}
	// JSON names each list one way: no two lists of paths encode alike.
	key, err := json.Marshal(paths)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(key)
	dir := filepath.Join(s.dir, mountPointsDir)
	final := filepath.Join(dir, hex.EncodeToString(sum[:]))
	if _, err := os.Lstat(final); err == nil {
		return final, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("failed to make the store's mount-point layers: %w", err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return "", fmt.Errorf("failed to read the store's mount-point layers: %w", err)
	}
	kept := 0
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), ".tmp-") {
			kept++
			continue
		}
		if fi, err := e.Info(); err == nil && s.now().Sub(fi.ModTime()) > staleMountLayerTmp {
			_ = os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
	if kept >= maxMountLayers {
		return "", fmt.Errorf("%w (%d)", ErrMountLayersFull, maxMountLayers)
	}
	tmp, err := os.MkdirTemp(dir, ".tmp-")
	if err != nil {
		return "", fmt.Errorf("failed to make a mount-point layer: %w", err)
	}
	if err := makeMountPoints(tmp, paths); err != nil {
		_ = os.RemoveAll(tmp)
		return "", err
	}
	// The layer's root is never seen (the task's root is its writable
	// layer's); overlay reads it, as root.
	if err := os.Chmod(tmp, 0o755); err != nil {
		_ = os.RemoveAll(tmp)
		return "", fmt.Errorf("failed to make a mount-point layer: %w", err)
	}
	if err := os.Rename(tmp, final); err != nil {
		_ = os.RemoveAll(tmp)
		// Another start made the same layer first.
		if errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) {
			return final, nil
		}
		return "", fmt.Errorf("failed to make a mount-point layer: %w", err)
	}
	return final, nil
}

// mountLayerPaths are points as the layer's entries, sorted and unique:
// "d/alloc" for a directory, "f/etc/hosts" for a file, relative to the
// layer's root. A path that is not absolute and clean, is the root, or
// has a file as an ancestor of another entry, is refused.
func mountLayerPaths(points []MountPoint) ([]string, error) {
	var out []string
	files := map[string]bool{}
	for _, p := range points {
		if !filepath.IsAbs(p.Path) || filepath.Clean(p.Path) != p.Path || p.Path == "/" || len(p.Path) > maxMountPath {
			return nil, fmt.Errorf("mount target %q: want a clean absolute path below / of at most %d bytes", p.Path, maxMountPath)
		}
		if strings.ContainsFunc(p.Path, unicode.IsControl) {
			return nil, fmt.Errorf("mount target %q: a mount-point layer takes no control characters", p.Path)
		}
		kind := "f"
		if p.Dir {
			kind = "d"
		} else {
			files[p.Path] = true
		}
		out = append(out, kind+p.Path)
	}
	slices.Sort(out)
	out = slices.Compact(out)
	dirs := map[string]bool{}
	for _, e := range out {
		for dir := filepath.Dir(e[1:]); dir != "/"; dir = filepath.Dir(dir) {
			if files[dir] {
				return nil, fmt.Errorf("mount target %q is inside %q, a file's target", e[1:], dir)
			}
			dirs[dir] = true
		}
		if e[0] == 'f' && slices.Contains(out, "d"+e[1:]) {
			return nil, fmt.Errorf("mount target %q is both a file's and a directory's", e[1:])
		}
	}
	if n := len(out) + len(dirs); n > maxMountEntries {
		return nil, fmt.Errorf("a mount-point layer holds at most %d entries, and these targets need %d", maxMountEntries, n)
	}
	return out, nil
}

// makeMountPoints makes paths (mountLayerPaths) under root, a directory
// this process just made and no one else can write: directories 0755 and
// files 0644 and empty, whatever the process's umask.
func makeMountPoints(root string, paths []string) error {
	made := map[string]bool{}
	mkdir := func(p string) error {
		if made[p] {
			return nil
		}
		if err := os.Mkdir(p, 0o755); err != nil {
			return err
		}
		made[p] = true
		return os.Chmod(p, 0o755)
	}
	for _, e := range paths {
		rel := strings.Split(strings.TrimPrefix(e[1:], "/"), "/")
		p := root
		for _, elem := range rel[:len(rel)-1] {
			p = filepath.Join(p, elem)
			if err := mkdir(p); err != nil {
				return fmt.Errorf("failed to make a mount-point layer: %w", err)
			}
		}
		p = filepath.Join(p, rel[len(rel)-1])
		if e[0] == 'd' {
			if err := mkdir(p); err != nil {
				return fmt.Errorf("failed to make a mount-point layer: %w", err)
			}
			continue
		}
		f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o644)
		if err != nil {
			return fmt.Errorf("failed to make a mount-point layer: %w", err)
		}
		err = errors.Join(f.Chmod(0o644), f.Close())
		if err != nil {
			return fmt.Errorf("failed to make a mount-point layer: %w", err)
		}
	}
	return nil
}
