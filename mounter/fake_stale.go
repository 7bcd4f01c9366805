package mounter

import (
	"os"
	"path/filepath"
	"strings"
)

// ActionDetachLazy is the kind of FakeAction that DetachLazy and DetachAt
// record.
const ActionDetachLazy = "detach-lazy"

// SetStale makes Stale report path as dead (true) or alive (false) from
// now on, while it is in the mount table. Safe for concurrent use.
func (f *Fake) SetStale(path string, dead bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	path = filepath.Clean(path)
	if !dead {
		delete(f.stale, path)
		return
	}
	if f.stale == nil {
		f.stale = map[string]bool{}
	}
	f.stale[path] = true
}

// SetStaleHang makes Stale of path block until release is closed, as a
// stat of a hung network mount does (nil: no hang).
func (f *Fake) SetStaleHang(path string, release chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.staleHang == nil {
		f.staleHang = map[string]chan struct{}{}
	}
	f.staleHang[filepath.Clean(path)] = release
}

// Stale reports paths marked by SetStale that are still mount points.
func (f *Fake) Stale(path string) (bool, error) {
	path = filepath.Clean(path)
	f.mu.Lock()
	hang := f.staleHang[path]
	f.mu.Unlock()
	if hang != nil {
		<-hang
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stale[path] && isMountPoint(f.MountPoints, path), nil
}

// DetachLazy records an ActionDetachLazy and removes the topmost mount at
// target; UnmountErrs fail it too.
func (f *Fake) DetachLazy(target string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	target = filepath.Clean(target)
	f.record(FakeAction{Kind: ActionDetachLazy, Target: target})
	if err := f.UnmountErrs[target]; err != nil {
		return err
	}
	for i := len(f.MountPoints) - 1; i >= 0; i-- {
		if f.MountPoints[i].Path == target {
			f.MountPoints = append(f.MountPoints[:i], f.MountPoints[i+1:]...)
			break
		}
	}
	delete(f.stale, target)
	return nil
}

// DetachAt is DetachLazy of name joined to dir's name.
func (f *Fake) DetachAt(dir *os.File, name string) error {
	return f.DetachLazy(filepath.Join(dir.Name(), name))
}

// ActionPrivateTree is the kind of FakeAction that PrivateTree records.
const ActionPrivateTree = "private-tree"

// PrivateTree records an ActionPrivateTree with the tree's source.
func (f *Fake) PrivateTree(tree *os.File) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	source, _ := strings.CutPrefix(tree.Name(), fakeTreePrefix)
	f.record(FakeAction{Kind: ActionPrivateTree, Source: source})
	return nil
}

// ActionTreePropagation is the kind of FakeAction that SetTreePropagation
// records.
const ActionTreePropagation = "tree-propagation"

// SetTreePropagation records an ActionTreePropagation with the tree's
// source and the mode.
func (f *Fake) SetTreePropagation(tree *os.File, mode string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	source, _ := strings.CutPrefix(tree.Name(), fakeTreePrefix)
	f.record(FakeAction{Kind: ActionTreePropagation, Source: source, Mode: mode})
	_, err := PropagationFlags(mode, false)
	return err
}
