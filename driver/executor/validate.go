package executor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// validateMounts checks the mounts of a spec in the caller's (the host's)
// mount namespace: absolute paths, known propagation, an existing source,
// and for bidirectional propagation a privileged task and a source that is
// a shared mount point of its own.
func validateMounts(m mounter.Interface, spec *Spec) error {
	for _, mnt := range spec.LateMounts {
		if !filepath.IsAbs(mnt.Target) {
			return fmt.Errorf("late mount: target %q must be an absolute path", mnt.Target)
		}
		switch mnt.Propagation {
		case "", PropagationPrivate, PropagationHostToTask:
		default:
			return fmt.Errorf("late mount %q: propagation %q: want %q or %q", mnt.Target, mnt.Propagation,
				PropagationPrivate, PropagationHostToTask)
		}
	}
	var table []mounter.MountPoint
	for _, mnt := range spec.Mounts {
		if !filepath.IsAbs(mnt.Source) {
			return fmt.Errorf("mount %q: source must be an absolute path", mnt.Source)
		}
		if !filepath.IsAbs(mnt.Target) {
			return fmt.Errorf("mount %q: target %q must be an absolute path", mnt.Source, mnt.Target)
		}
		if _, err := os.Stat(mnt.Source); err != nil {
			return fmt.Errorf("mount %q: %w", mnt.Source, err)
		}
		switch mnt.Propagation {
		case "", PropagationPrivate, PropagationHostToTask:
			continue
		case PropagationBidirectional:
		default:
			return fmt.Errorf("mount %q: unknown propagation %q: want %q, %q or %q", mnt.Source, mnt.Propagation,
				PropagationPrivate, PropagationHostToTask, PropagationBidirectional)
		}
		if !spec.Privileged {
			return fmt.Errorf("mount %q: bidirectional propagation needs a privileged task", mnt.Source)
		}
		if table == nil {
			var err error
			if table, err = m.List(); err != nil {
				return fmt.Errorf("failed to check mount %q: %w", mnt.Source, err)
			}
		}
		src, err := filepath.EvalSymlinks(mnt.Source)
		if err != nil {
			return fmt.Errorf("mount %q: %w", mnt.Source, err)
		}
		mp, ok := mounter.FindMount(table, src)
		if !ok || !mp.Shared {
			return fmt.Errorf("mount %q: bidirectional propagation needs %q on a shared mount on the host", mnt.Source, src)
		}
		if mp.Path != src {
			return fmt.Errorf("mount %q: bidirectional propagation needs %q to be a shared mount point of its own on the host (it is inside %q; bind it onto itself and make it shared)",
				mnt.Source, src, mp.Path)
		}
	}
	return nil
}

func validateSpec(spec *Spec) error {
	switch {
	case spec.TaskID == "":
		return errors.New("task_id must not be empty")
	case spec.Command == "":
		return errors.New("command must not be empty")
	case strings.Contains(spec.GroupName(), "/"):
		return fmt.Errorf("cgroup name %q must not contain a slash", spec.GroupName())
	case !filepath.IsAbs(spec.StateDir):
		return fmt.Errorf("state_dir %q must be an absolute path", spec.StateDir)
	}
	if fi, err := os.Stat(spec.StateDir); err != nil {
		return fmt.Errorf("state_dir %q: %w", spec.StateDir, err)
	} else if !fi.IsDir() {
		return fmt.Errorf("state_dir %q is not a directory", spec.StateDir)
	}
	if spec.Dir != "" && !filepath.IsAbs(spec.Dir) {
		return fmt.Errorf("dir %q must be an absolute path", spec.Dir)
	}
	if err := CheckArgv(spec); err != nil {
		return err
	}
	if img := spec.Image; img != nil {
		if len(img.Layers) == 0 {
			return fmt.Errorf("image %q has no layers", img.Ref)
		}
		for _, l := range img.Layers {
			if !filepath.IsAbs(l) {
				return fmt.Errorf("image %q: layer %q must be an absolute path", img.Ref, l)
			}
			if fi, err := os.Stat(l); err != nil {
				return fmt.Errorf("image %q: layer %q: %w", img.Ref, l, err)
			} else if !fi.IsDir() {
				return fmt.Errorf("image %q: layer %q is not a directory", img.Ref, l)
			}
		}
	}
	if spec.Capabilities != nil {
		if _, err := ParseCapabilities(spec.Capabilities); err != nil {
			return err
		}
	}
	return validateMounts(mounter.New(), spec)
}
