package driver

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"

	"github.com/hashicorp/go-hclog"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/atomicfile"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// sharedSources makes the host side of bidirectional mounts work.
//
// A mount a task makes under a bidirectional mount reaches the host only if
// the host directory is a mount point of its own with shared propagation:
// inside the task the driver turns every other host mount into a slave, so
// that nothing else the task mounts leaks out. When a source is not such a
// mount point, the driver bind-mounts it onto itself and gives it a peer
// group of its own (as the kubelet does for its root). Those self-binds are
// reference-counted by the tasks that use them, recorded in a file under
// root_dir so that a restarted driver still knows they are its own, and
// removed when the last task using one is gone and nothing is mounted
// beneath it any more.
type sharedSources struct {
	logger    hclog.Logger
	mounter   mounter.Interface
	stateFile string

	mu   sync.Mutex
	refs map[string]int
	// ours holds the self-binds this driver made.
	ours map[string]bool
}

func newSharedSources(logger hclog.Logger, m mounter.Interface, stateFile string) *sharedSources {
	s := &sharedSources{
		logger:    logger.Named("shared_mounts"),
		mounter:   m,
		stateFile: stateFile,
		refs:      map[string]int{},
		ours:      map[string]bool{},
	}
	if data, err := os.ReadFile(stateFile); err == nil {
		var paths []string
		if err := json.Unmarshal(data, &paths); err != nil {
			s.logger.Warn("ignoring unreadable record of self-bind mounts", "path", stateFile, "error", err)
		}
		for _, p := range paths {
			s.ours[p] = true
		}
	}
	return s
}

// bidirectionalSources lists the host paths of a task's bidirectional mounts.
func bidirectionalSources(mounts []executor.Mount) []string {
	var out []string
	for _, m := range mounts {
		if m.Propagation == executor.PropagationBidirectional {
			out = append(out, m.Source)
		}
	}
	return out
}

// acquire makes every path a shared mount point and takes a reference on
// it. On error it takes none.
func (s *sharedSources) acquire(paths []string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var done []string
	for _, p := range paths {
		if err := s.acquireOne(p); err != nil {
			for _, d := range done {
				s.releaseOne(d)
			}
			return err
		}
		done = append(done, p)
	}
	return nil
}

func (s *sharedSources) acquireOne(path string) error {
	if s.refs[path] > 0 {
		s.refs[path]++
		return nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("bidirectional mount source %q: %w", path, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("bidirectional mount source %q must be a directory", path)
	}
	mounts, err := s.mounter.List()
	if err != nil {
		return err
	}
	mp, ok := mounter.FindMount(mounts, path)
	switch {
	case ok && mp.Path == path && mp.Shared:
		// Already what we need.
	case ok && mp.Path == path:
		if err := s.mounter.SetPropagation(path, mounter.PropagationShared, false); err != nil {
			return fmt.Errorf("bidirectional mount source %q: %w", path, err)
		}
	default:
		if err := s.mounter.BindMount(path, path, false, true); err != nil {
			return fmt.Errorf("bidirectional mount source %q: %w", path, err)
		}
		// A peer group of its own, apart from the mount it lives on.
		err := s.mounter.SetPropagation(path, mounter.PropagationPrivate, false)
		if err == nil {
			err = s.mounter.SetPropagation(path, mounter.PropagationShared, false)
		}
		if err != nil {
			_ = s.mounter.Unmount(path)
			return fmt.Errorf("bidirectional mount source %q: %w", path, err)
		}
		s.ours[path] = true
		s.persist()
		s.logger.Debug("made a shared mount point", "path", path)
	}
	s.refs[path]++
	return nil
}

// adopt takes references for a recovered task without touching mounts.
func (s *sharedSources) adopt(paths []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range paths {
		s.refs[p]++
	}
}

// release drops a reference on every path, removing self-binds nobody
// needs any more.
func (s *sharedSources) release(paths []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range paths {
		s.releaseOne(p)
	}
}

func (s *sharedSources) releaseOne(path string) {
	if s.refs[path] > 1 {
		s.refs[path]--
		return
	}
	delete(s.refs, path)
	if !s.ours[path] {
		return
	}
	mounts, err := s.mounter.List()
	if err != nil {
		s.logger.Warn("failed to read mounts", "error", err)
		return
	}
	for _, mp := range mounts {
		if mp.Path != path && mounter.PathWithin(mp.Path, path) {
			// Something (a staged volume) is still mounted beneath it: the
			// self-bind stays until a later release finds it empty.
			s.logger.Debug("keeping shared mount point in use", "path", path, "submount", mp.Path)
			return
		}
	}
	// The bind may be stacked if it was made twice; take every layer off.
	for {
		if ok, err := s.mounter.IsMountPoint(path); err != nil || !ok {
			break
		}
		if err := s.mounter.Unmount(path); err != nil {
			s.logger.Warn("failed to remove shared mount point", "path", path, "error", err)
			return
		}
	}
	delete(s.ours, path)
	s.persist()
}

// persist records the self-binds atomically.
func (s *sharedSources) persist() {
	paths := make([]string, 0, len(s.ours))
	for p := range s.ours {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	data, _ := json.Marshal(paths)
	if err := writeFileAtomic(s.stateFile, data, 0o600); err != nil {
		s.logger.Warn("failed to record self-bind mounts", "path", s.stateFile, "error", err)
	}
}

// writeFileAtomic writes data to path through a temporary file and a rename
// (atomicfile.Write, synced), so a crash leaves either the old or the new
// content; path's directory is made when missing.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	return atomicfile.Write(path, data, perm, true)
}
