package cgroups

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// ErrUnfit says that a group made ahead cannot serve a task, which needs a
// group made for it (Create): the group is left as it was.
var ErrUnfit = errors.New("the group made ahead does not fit the task")

// Ahead is a cgroup v1 group made before its task is known, by a spare
// supervisor while it waits: its directories in every hierarchy, under
// the parent its tasks use, with a name of its own and limits of its own.
// A v1 group is a directory in each of five to seven hierarchies, each
// made and given its limits with a write or more, about a millisecond and
// a half of a task's start on these machines, beside the task's volume
// calls. Claim gives it its task's name and limits instead: a rename per
// hierarchy and the limits that differ.
//
// Nothing joins the group before Claim, so its limits made ahead never
// apply to anything. On cgroup v2, where a group cannot be renamed and a
// task's group may be one Nomad laid out, no group is made ahead.
type Ahead struct {
	h      *hierarchy
	parent string
	g      *Group
	l      Limits
	// spent is set once Claim renamed the group (its own or not) or
	// removed it: Destroy has nothing left to do.
	spent bool
}

// AheadAvailable reports whether groups can be made ahead here: on cgroup
// v1.
func AheadAvailable() bool {
	h, err := hostHierarchy()
	return err == nil && h.version == 1
}

// CreateAhead makes the group parent/name with the limits l, for Claim.
// l has no cpuset (a task's cpuset group is Nomad's or made for it).
func CreateAhead(parent, name string, l Limits) (*Ahead, error) {
	h, err := hostHierarchy()
	if err != nil {
		return nil, err
	}
	return h.createAhead(parent, name, l)
}

func (h *hierarchy) createAhead(parent, name string, l Limits) (*Ahead, error) {
	if h.version != 1 {
		return nil, errors.New("a cgroup is made ahead on cgroup v1 only: a v2 group cannot be renamed")
	}
	if l.CpusetCpus != "" || l.CpusetCgroupPath != "" {
		return nil, errors.New("a cgroup made ahead has no cpuset")
	}
	g, err := h.create(parent, name, l)
	if err != nil {
		return nil, err
	}
	return &Ahead{h: h, parent: parent, g: g, l: l}, nil
}

// Claim makes the group made ahead the group Create(parent, name, l) would
// make, and returns it: renamed to name in every hierarchy, with the limits
// l. It fails with ErrUnfit, and changes nothing, when the task needs
// another parent, a device filter where the group has none (or none where
// it has one), or a cpuset group of its own; and when a group of that name
// exists already (a start retried after its supervisor died), which Create
// takes over as it is. On any other error nothing is left: the group,
// renamed or not, is removed. Either way Claim is called once.
func (a *Ahead) Claim(parent, name string, l Limits) (*Group, error) {
	if a.spent {
		return nil, errors.New("the cgroup made ahead was claimed already")
	}
	if err := validName("name", name, false, false); err != nil {
		return nil, err
	}
	if err := validLimits(l); err != nil {
		return nil, err
	}
	switch {
	case parent != a.parent:
		return nil, fmt.Errorf("%w: it was made under %q, the task's parent is %q", ErrUnfit, a.parent, parent)
	case (l.Devices == nil) != (a.l.Devices == nil):
		return nil, fmt.Errorf("%w: the task's device filter", ErrUnfit)
	case l.CpusetCpus != "" && l.CpusetCgroupPath == "":
		return nil, fmt.Errorf("%w: the task needs a cpuset group of its own", ErrUnfit)
	}
	ctrls := slices.Sorted(maps.Keys(a.g.paths))
	for _, ctrl := range ctrls {
		to := filepath.Join(filepath.Dir(a.g.paths[ctrl]), name)
		if _, err := os.Lstat(to); err == nil {
			return nil, fmt.Errorf("%w: cgroup %s exists", ErrUnfit, to)
		}
	}
	a.spent = true
	g := &Group{version: 1, paths: make(map[string]string, len(ctrls)), mounts: maps.Clone(a.g.mounts), devices: l.Devices}
	renamed := map[string]string{} // directory before -> after; controllers may share one
	fail := func(err error) (*Group, error) {
		// Back to the name made ahead, then removed with it; nothing ever
		// joined the group.
		for from, to := range renamed {
			if rerr := os.Rename(to, from); rerr != nil {
				err = errors.Join(err, fmt.Errorf("failed to rename cgroup %s back: %w", to, rerr))
			}
		}
		if derr := a.g.Destroy(); derr != nil {
			err = errors.Join(err, derr)
		}
		return nil, err
	}
	// Controllers mounted together (cpu,cpuacct, behind a symlink for
	// each) share one directory, renamed once.
	real := make(map[string]string, len(ctrls))
	for _, ctrl := range ctrls {
		r, err := filepath.EvalSymlinks(a.g.paths[ctrl])
		if err != nil {
			return fail(fmt.Errorf("failed to find cgroup %s: %w", a.g.paths[ctrl], err))
		}
		real[ctrl] = r
	}
	for _, ctrl := range ctrls {
		from := real[ctrl]
		if _, ok := renamed[from]; !ok {
			to := filepath.Join(filepath.Dir(from), name)
			if err := os.Rename(from, to); err != nil {
				return fail(fmt.Errorf("failed to rename cgroup %s to %s: %w", from, name, err))
			}
			renamed[from] = to
		}
		g.paths[ctrl] = filepath.Join(filepath.Dir(a.g.paths[ctrl]), name)
	}
	g.cpusetPath = a.h.v1CpusetPath(l.CpusetCgroupPath)
	if _, ok := g.mounts["cpuset"]; !ok && g.cpusetPath != "" {
		if m, err := a.h.v1Mount("cpuset"); err == nil {
			g.mounts["cpuset"] = m
		}
	}
	if err := g.applyV1Since(l, &a.l); err != nil {
		// Under the task's name now: removed as the task's group.
		renamed = nil
		a.g = g
		return fail(err)
	}
	return g, nil
}

// Destroy removes the group made ahead, unless Claim renamed or removed
// it.
func (a *Ahead) Destroy() error {
	if a == nil || a.spent {
		return nil
	}
	a.spent = true
	return a.g.Destroy()
}

// Dirs are the group's directories, made ahead.
func (a *Ahead) Dirs() []string { return a.g.dirs() }

// aheadMounts are the mounts of the hierarchies a group made ahead may
// have a directory in (a cpuset is never made ahead), each once.
func (h *hierarchy) aheadMounts() []string {
	var out []string
	for _, ctrl := range append(slices.Clone(v1Controllers), "devices") {
		if m, err := h.v1Mount(ctrl); err == nil && !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	return out
}

// RemoveAhead removes the group parent/name made ahead by a spare that is
// gone (it exited or was killed before it claimed or removed it): its
// directory in every v1 hierarchy, where it is there and empty. A group
// with a process or a group below it is left (EBUSY), and named in the
// error.
func RemoveAhead(parent, name string) error {
	h, err := hostHierarchy()
	if err != nil || h.version != 1 {
		return err
	}
	if err := validName("parent", parent, true, true); err != nil {
		return err
	}
	if err := validName("name", name, false, false); err != nil {
		return err
	}
	return removeAhead(h.aheadMounts(), parent, name)
}

// removeAhead removes parent/name under each of mounts, where it is empty.
func removeAhead(mounts []string, parent, name string) error {
	var errs []error
	for _, m := range mounts {
		dir := filepath.Join(m, parent, name)
		if err := rmdir(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("failed to remove cgroup %s: %w", dir, err))
		}
	}
	return errors.Join(errs...)
}

// RemoveAheadAll removes every group under parent whose name begins with
// prefix and that keep does not keep (groups made ahead by spares that are
// gone: a driver killed with them), in every v1 hierarchy, where it is
// empty. Nothing is removed on v2, where nothing is made ahead.
func RemoveAheadAll(parent, prefix string, keep func(name string) bool) error {
	h, err := hostHierarchy()
	if err != nil || h.version != 1 {
		return err
	}
	if err := validName("parent", parent, true, true); err != nil {
		return err
	}
	if prefix == "" {
		return errors.New("cgroups made ahead are removed by a prefix of their names")
	}
	mounts := h.aheadMounts()
	names := map[string]bool{}
	for _, m := range mounts {
		entries, err := os.ReadDir(filepath.Join(m, parent))
		if err != nil {
			continue
		}
		for _, e := range entries {
			if e.IsDir() && strings.HasPrefix(e.Name(), prefix) && !keep(e.Name()) {
				names[e.Name()] = true
			}
		}
	}
	var errs []error
	for name := range names {
		errs = append(errs, removeAhead(mounts, parent, name))
	}
	return errors.Join(errs...)
}
