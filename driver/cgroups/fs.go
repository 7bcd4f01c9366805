package cgroups

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// defaultRoot is where cgroup filesystems are mounted on every distribution
// we support.
const defaultRoot = "/sys/fs/cgroup"

// unifiedKey is the State.Paths key of a cgroup v2 group.
const unifiedKey = "unified"

// v1Controllers are the hierarchies every v1 group is made in. cpuset is
// added only for a group pinned to CPUs (see Create).
var v1Controllers = []string{"memory", "cpu", "cpuacct", "pids", "freezer"}

// v2Controllers must be available in the unified hierarchy; pids is enabled
// as well when the kernel offers it, and cpuset for a pinned group.
var v2Controllers = []string{"cpu", "memory"}

// v2LimitsOptional is false in every build but the test build of
// nocontrollers.go (tag cgroupv2_nocontrollers), which runs the driver in a
// unified hierarchy without controllers: there a limit, usage or OOM file
// of a controller the group does not have is skipped instead of failing.
var v2LimitsOptional = false

// hierarchy is the cgroup layout of the host: either the unified (v2)
// hierarchy mounted at root, or one v1 hierarchy per controller mounted at
// root/<controller>. Tests build one over a fake tree in a temporary
// directory.
type hierarchy struct {
	root    string
	version int
	// magic returns the filesystem type of a path (statfs f_type).
	magic func(path string) (int64, error)
	// newDir, when set, is called for every directory this package makes,
	// before it is used. Tests use it to write the files the kernel would.
	newDir func(dir string) error
}

func statfsMagic(path string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, err
	}
	return int64(st.Type), nil
}

// detect finds the layout under root: unified when root itself is a
// cgroup2 filesystem, v1 otherwise (legacy or hybrid hosts, where a cgroup2
// mount under root/unified usually has no controllers).
func detect(root string, magic func(string) (int64, error)) (*hierarchy, error) {
	m, err := magic(root)
	if err != nil {
		return nil, fmt.Errorf("failed to stat the cgroup root %s: %w", root, err)
	}
	h := &hierarchy{root: root, version: 1, magic: magic}
	if m == unix.CGROUP2_SUPER_MAGIC {
		h.version = 2
	}
	return h, nil
}

func hostHierarchy() (*hierarchy, error) {
	return detect(defaultRoot, statfsMagic)
}

// v1Mount returns the mount point of a v1 controller, or an error saying it
// is not mounted.
func (h *hierarchy) v1Mount(controller string) (string, error) {
	dir := filepath.Join(h.root, controller)
	m, err := h.magic(dir)
	if err != nil || m != unix.CGROUP_SUPER_MAGIC {
		return "", fmt.Errorf("the %s cgroup controller is not mounted at %s", controller, dir)
	}
	return dir, nil
}

// available is Available for this hierarchy.
func (h *hierarchy) available() error {
	if h.version == 1 {
		for _, c := range v1Controllers {
			dir, err := h.v1Mount(c)
			if err != nil {
				return err
			}
			if err := unix.Access(dir, unix.W_OK); err != nil {
				return fmt.Errorf("the %s cgroup hierarchy at %s is not writable (the plugin must run as root): %w", c, dir, err)
			}
		}
		return nil
	}
	have, err := readFields(filepath.Join(h.root, "cgroup.controllers"))
	if err != nil {
		return fmt.Errorf("the cgroup v2 controllers cannot be read: %w", err)
	}
	for _, c := range v2Controllers {
		if !have[c] {
			return fmt.Errorf("the %s controller is not available in the cgroup v2 hierarchy at %s", c, h.root)
		}
	}
	if err := unix.Access(h.root, unix.W_OK); err != nil {
		return fmt.Errorf("the cgroup v2 hierarchy at %s is not writable (the plugin must run as root): %w", h.root, err)
	}
	return nil
}

// writeFile writes value to an existing cgroup file, the way the kernel
// wants it: one write, no creation.
func writeFile(path, value string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return fmt.Errorf("failed to write %q to %s: %w", value, path, err)
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("failed to write %q to %s: %w", value, path, err)
	}
	return nil
}

func readString(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("failed to read %s: %w", path, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// readKeyed reads a flat keyed file ("key value" per line, like memory.stat
// or cpu.stat). Lines that are not a key and an unsigned number are skipped.
func readKeyed(path string) (map[string]uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("failed to read %s: %w", path, err)
	}
	return parseKeyed(string(b)), nil
}

// readFields reads a space-separated list such as cgroup.controllers. A
// leading "+" is ignored.
func readFields(path string) (map[string]bool, error) {
	s, err := readString(path)
	if err != nil {
		return nil, err
	}
	out := make(map[string]bool)
	for _, f := range strings.Fields(s) {
		out[strings.TrimPrefix(f, "+")] = true
	}
	return out, nil
}

// readPids reads cgroup.procs of dir.
func readPids(dir string) ([]int, error) {
	path := filepath.Join(dir, "cgroup.procs")
	s, err := readString(path)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, f := range strings.Fields(s) {
		pid, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("failed to parse pid %q in %s: %w", f, path, err)
		}
		out = append(out, pid)
	}
	return out, nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// isNotExist reports a missing file or directory, wrapped or not.
func isNotExist(err error) bool {
	return errors.Is(err, os.ErrNotExist)
}
