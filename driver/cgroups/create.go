package cgroups

import (
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Defaults written when a limit is zero, so that Create on an existing group
// always leaves exactly the limits it was given.
const (
	defaultShares    = 1024
	defaultWeight    = 100
	defaultCPUPeriod = 100000
	minShares        = 2
	maxShares        = 262144
)

// Available reports whether tasks can be placed in cgroups here: nil, or an
// error of one sentence saying what is missing (e.g. "the memory cgroup
// controller is not mounted at /sys/fs/cgroup/memory"). The driver's
// fingerprint uses it.
func Available() error {
	h, err := hostHierarchy()
	if err != nil {
		return err
	}
	return h.available()
}

// Create makes the group parent/name and applies l to it.
//
// On cgroup v1 the group is made in the memory, cpu, cpuacct, pids and
// freezer hierarchies, in devices when l.Devices is not nil, and in cpuset
// when l.CpusetCpus is set and l.CpusetCgroupPath is not (a process is in
// one cpuset group per hierarchy, and when Nomad made one for the task,
// that one wins, as in Nomad's own executors, which write l.CpusetCpus to
// it). On cgroup v2 it is one directory under the unified root, with the
// controllers Nomad enables for its own tasks (cpuset, cpu, io, memory,
// pids; cpu and memory must be offered, the others are enabled when they
// are) enabled in the cgroup.subtree_control of every directory above it,
// so that a task can be pinned to cores and given io limits under any
// parent, and a device program attached when l.Devices is not nil.
//
// On cgroup v2, when l.CpusetCgroupPath is a group Nomad laid out for the
// task (nomad.slice/share.slice/ALLOC.TASK.scope, or reserve.slice for a
// task with reserved cores; see NomadGroup), the task's group is that one
// and parent/name is not used: Nomad keeps the CPUs of its share and
// reserve partitions apart there, and a task elsewhere would run on cores
// that other tasks reserved.
//
// parent is relative to the hierarchy root ("" for the root itself) and is
// made when missing; it is never removed. Create is idempotent for the same
// name, and every limit is written (zero writes the kernel default), so the
// group ends with exactly l, whatever limits a group of that name had. On
// error, the directories this call made are removed again (controllers it
// enabled in a parent stay enabled).
//
// Memory: l.MemoryBytes also caps swap: v1 sets memory.memsw.limit_in_bytes
// to the same value when the kernel has swap accounting, and v2 writes
// memory.swap.max "0" when memory is limited ("max" otherwise), as Nomad
// does for its own tasks.
func Create(parent, name string, l Limits) (*Group, error) {
	h, err := hostHierarchy()
	if err != nil {
		return nil, err
	}
	return h.create(parent, name, l)
}

// Load finds a group again from its State, e.g. after the driver restarts.
// It fails when one of its directories is gone.
func Load(st State) (*Group, error) {
	return load(st, true)
}

// Reported is Load for the state the supervisor that made the group
// reports once its task runs in it, read from the supervisor's report
// pipe: the state is checked as Load checks it, but its directories are
// not looked for (one stat per v1 hierarchy, about a quarter of a
// millisecond on a task's start), since the task was just started in them.
func Reported(st State) (*Group, error) {
	return load(st, false)
}

func load(st State, look bool) (*Group, error) {
	var required, allowed []string
	switch st.Version {
	case 1:
		required = v1Controllers
		allowed = append([]string{"cpuset", "devices"}, v1Controllers...)
	case 2:
		required = []string{unifiedKey}
		allowed = required
	default:
		return nil, fmt.Errorf("failed to load cgroup: version %d is not 1 or 2", st.Version)
	}
	for _, k := range required {
		if st.Paths[k] == "" {
			return nil, fmt.Errorf("failed to load cgroup: state has no %s path", k)
		}
	}
	for k := range st.Paths {
		if !slices.Contains(allowed, k) {
			return nil, fmt.Errorf("failed to load cgroup: unexpected %q path in a v%d state", k, st.Version)
		}
	}
	g := &Group{version: st.Version, paths: make(map[string]string, len(st.Paths)), cpusetPath: st.CpusetCgroupPath}
	for k, p := range st.Paths {
		if !filepath.IsAbs(p) || filepath.Clean(p) != p {
			return nil, fmt.Errorf("failed to load cgroup: %s path %q is not a clean absolute path", k, p)
		}
		// Every cgroup directory has cgroup.procs; this also keeps a bad
		// state from making Destroy remove some other directory.
		if look {
			if _, err := os.Stat(filepath.Join(p, "cgroup.procs")); err != nil {
				return nil, fmt.Errorf("failed to load cgroup %s: %w", p, err)
			}
		}
		g.paths[k] = p
	}
	return g, nil
}

func validName(what, s string, allowEmpty, allowSlash bool) error {
	if s == "" {
		if allowEmpty {
			return nil
		}
		return fmt.Errorf("cgroup %s must not be empty", what)
	}
	if strings.HasPrefix(s, "/") || filepath.Clean(s) != s {
		return fmt.Errorf("cgroup %s %q must be a clean relative path", what, s)
	}
	for _, part := range strings.Split(s, "/") {
		if part == "." || part == ".." {
			return fmt.Errorf("cgroup %s %q must not contain %q", what, s, part)
		}
	}
	if !allowSlash && strings.Contains(s, "/") {
		return fmt.Errorf("cgroup %s %q must not contain a slash", what, s)
	}
	return nil
}

func validLimits(l Limits) error {
	for _, f := range []struct {
		name string
		v    int64
	}{
		{"MemoryBytes", l.MemoryBytes},
		{"MemoryReservationBytes", l.MemoryReservationBytes},
		{"CPUShares", l.CPUShares},
		{"CPUQuota", l.CPUQuota},
		{"CPUPeriod", l.CPUPeriod},
		{"PidsMax", l.PidsMax},
	} {
		if f.v < 0 {
			return fmt.Errorf("cgroup limit %s must not be negative, got %d", f.name, f.v)
		}
	}
	if l.MemoryBytes > 0 && l.MemoryReservationBytes > l.MemoryBytes {
		return fmt.Errorf("cgroup limit MemoryReservationBytes (%d) must not be above MemoryBytes (%d)", l.MemoryReservationBytes, l.MemoryBytes)
	}
	if strings.ContainsAny(l.CpusetCpus, " \n") {
		return fmt.Errorf("cgroup limit CpusetCpus %q must be a CPU list like \"0-1,3\"", l.CpusetCpus)
	}
	for i, r := range l.Devices {
		if err := r.validate(); err != nil {
			return fmt.Errorf("cgroup limit Devices[%d] (%s): %w", i, r, err)
		}
	}
	return nil
}

// creation records what one Create made, to undo it on error.
type creation struct {
	made []string
}

func (c *creation) undo() {
	for i := len(c.made) - 1; i >= 0; i-- {
		_ = rmdir(c.made[i])
	}
}

// mkdirs makes base/rel one component at a time and calls each for every
// directory along the way (made or not), parent first; each gets the
// directory, its parent and whether this call made it.
func (h *hierarchy) mkdirs(c *creation, base, rel string, each func(dir, parent string, made bool) error) error {
	dir := base
	for _, part := range strings.Split(rel, "/") {
		if part == "" {
			continue
		}
		parent := dir
		dir = filepath.Join(dir, part)
		made := false
		if err := os.Mkdir(dir, 0o755); err == nil {
			made = true
			c.made = append(c.made, dir)
			if h.newDir != nil {
				if err := h.newDir(dir); err != nil {
					return err
				}
			}
		} else if !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("failed to create cgroup %s: %w", dir, err)
		}
		if each != nil {
			if err := each(dir, parent, made); err != nil {
				return err
			}
		}
	}
	return nil
}

func (h *hierarchy) create(parent, name string, l Limits) (g *Group, err error) {
	if err := validName("parent", parent, true, true); err != nil {
		return nil, err
	}
	if err := validName("name", name, false, false); err != nil {
		return nil, err
	}
	if err := validLimits(l); err != nil {
		return nil, err
	}
	rel := filepath.Join(parent, name)
	c := &creation{}
	defer func() {
		if err != nil {
			c.undo()
		}
	}()
	if h.version == 2 {
		if nomad, ok := h.nomadGroup(l.CpusetCgroupPath); ok {
			rel = nomad
		}
		return h.createV2(c, rel, l)
	}
	return h.createV1(c, rel, l)
}

func (h *hierarchy) createV1(c *creation, rel string, l Limits) (*Group, error) {
	controllers := append([]string(nil), v1Controllers...)
	ownCpuset := l.CpusetCpus != "" && l.CpusetCgroupPath == ""
	if ownCpuset {
		controllers = append(controllers, "cpuset")
	}
	if l.Devices != nil {
		controllers = append(controllers, "devices")
	}
	mounts := make(map[string]string, len(controllers))
	for _, ctrl := range controllers {
		m, err := h.v1Mount(ctrl)
		if err != nil {
			return nil, err
		}
		mounts[ctrl] = m
	}
	g := &Group{version: 1, paths: make(map[string]string), cpusetPath: h.v1CpusetPath(l.CpusetCgroupPath), mounts: mounts, devices: l.Devices}
	if _, ok := mounts["cpuset"]; !ok && g.cpusetPath != "" {
		if m, err := h.v1Mount("cpuset"); err == nil {
			mounts["cpuset"] = m
		}
	}
	for _, ctrl := range controllers {
		var each func(dir, parent string, made bool) error
		if ctrl == "cpuset" {
			leaf := filepath.Join(mounts[ctrl], rel)
			each = func(dir, parent string, made bool) error {
				// A new v1 cpuset group has no CPUs and no memory
				// nodes, and nothing can join it until both are set.
				if dir == leaf {
					return copyFile(parent, dir, "cpuset.mems")
				}
				if made {
					if err := copyFile(parent, dir, "cpuset.cpus"); err != nil {
						return err
					}
					return copyFile(parent, dir, "cpuset.mems")
				}
				return nil
			}
		}
		if err := h.mkdirs(c, mounts[ctrl], rel, each); err != nil {
			return nil, err
		}
		g.paths[ctrl] = filepath.Join(mounts[ctrl], rel)
	}
	if cpu := g.paths["cpu"]; !slices.Contains(c.made, cpu) {
		// The group was there already (a start tried again) and may have
		// a quota of other limits: lifted first, as Claim lifts the quota
		// of a group made ahead, since under a parent with a quota the
		// kernel refuses a period that with the quota in place would let
		// the group use more CPU time than the parent's.
		if err := writeFile(filepath.Join(cpu, "cpu.cfs_quota_us"), "-1"); err != nil {
			return nil, err
		}
	}
	if err := g.applyV1(l); err != nil {
		return nil, err
	}
	return g, nil
}

// v1CpusetPath makes Nomad's cpuset path absolute: it is absolute already
// in Nomad, but a relative one is taken as relative to the cpuset mount.
func (h *hierarchy) v1CpusetPath(p string) string {
	if p == "" || filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(h.root, "cpuset", p)
}

func copyFile(from, to, file string) error {
	v, err := readString(filepath.Join(from, file))
	if err != nil {
		return err
	}
	return writeFile(filepath.Join(to, file), v)
}

func (g *Group) applyV1(l Limits) error { return g.applyV1Since(l, nil) }

// applyV1Since gives a v1 group the limits l where they differ from prev,
// the limits it has already (nil: every limit is written).
func (g *Group) applyV1Since(l Limits, prev *Limits) error {
	changed := func(f func(l *Limits) any) bool {
		return prev == nil || !reflect.DeepEqual(f(&l), f(prev))
	}
	mem := g.paths["memory"]
	if changed(func(l *Limits) any { return l.MemoryBytes }) {
		limit := "-1"
		if l.MemoryBytes > 0 {
			limit = strconv.FormatInt(l.MemoryBytes, 10)
		}
		if err := setV1Memory(mem, limit); err != nil {
			return err
		}
	}
	if changed(func(l *Limits) any { return l.MemoryReservationBytes }) {
		soft := "-1"
		if l.MemoryReservationBytes > 0 {
			soft = strconv.FormatInt(l.MemoryReservationBytes, 10)
		}
		if err := writeFile(filepath.Join(mem, "memory.soft_limit_in_bytes"), soft); err != nil {
			return err
		}
	}

	cpu := g.paths["cpu"]
	if changed(func(l *Limits) any { return [3]int64{l.CPUShares, l.CPUPeriod, l.CPUQuota} }) {
		shares := int64(defaultShares)
		if l.CPUShares > 0 {
			shares = min(max(l.CPUShares, minShares), maxShares)
		}
		period := int64(defaultCPUPeriod)
		if l.CPUPeriod > 0 {
			period = l.CPUPeriod
		}
		quota := int64(-1)
		if l.CPUQuota > 0 {
			quota = l.CPUQuota
		}
		type write struct {
			file string
			v    int64
		}
		writes := []write{{"cpu.shares", shares}, {"cpu.cfs_period_us", period}, {"cpu.cfs_quota_us", quota}}
		if prev != nil && prev.CPUQuota > 0 {
			// Under a parent with a quota the kernel refuses a period
			// that, with the quota the group has, would let the group
			// use more CPU time than the parent's quota: the quota is
			// lifted first, so that the period is written as on a new
			// group (nothing is in the group yet).
			writes = append([]write{{"cpu.cfs_quota_us", -1}}, writes...)
		}
		for _, w := range writes {
			if err := writeFile(filepath.Join(cpu, w.file), strconv.FormatInt(w.v, 10)); err != nil {
				return err
			}
		}
	}
	if changed(func(l *Limits) any { return [2]string{l.CpusetCpus, l.CpusetCgroupPath} }) {
		if dir, ok := g.paths["cpuset"]; ok {
			if err := writeFile(filepath.Join(dir, "cpuset.cpus"), l.CpusetCpus); err != nil {
				return err
			}
		} else if g.cpusetPath != "" && l.CpusetCpus != "" {
			// Nomad makes a task's group of reserved cores with its memory
			// nodes only, and leaves the CPUs to the task driver: nothing can
			// join a cpuset group without CPUs.
			if err := writeFile(filepath.Join(g.cpusetPath, "cpuset.cpus"), l.CpusetCpus); err != nil {
				return err
			}
		}
	}
	if dir, ok := g.paths["devices"]; ok && changed(func(l *Limits) any { return l.Devices }) {
		if err := setV1Devices(dir, l.Devices); err != nil {
			return err
		}
	}
	if dir, ok := g.paths["pids"]; ok {
		if changed(func(l *Limits) any { return l.PidsMax }) {
			if err := writeFile(filepath.Join(dir, "pids.max"), pidsMax(l.PidsMax)); err != nil {
				return err
			}
		}
	} else if l.PidsMax > 0 {
		return fmt.Errorf("cgroup limit PidsMax (%d) needs the pids controller, which this host's cgroup v1 hierarchy lacks: mount it, or set the driver's pids_limit = 0", l.PidsMax)
	}
	return nil
}

func pidsMax(n int64) string {
	if n > 0 {
		return strconv.FormatInt(n, 10)
	}
	return "max"
}

// setV1Memory sets memory.limit_in_bytes and, when the kernel accounts swap,
// memory.memsw.limit_in_bytes to the same value, so swap cannot be used to
// go past the limit. The kernel keeps memsw >= limit at every step, so when
// the first write is refused, memsw is written first.
func setV1Memory(dir, limit string) error {
	lim := filepath.Join(dir, "memory.limit_in_bytes")
	sw := filepath.Join(dir, "memory.memsw.limit_in_bytes")
	if !exists(sw) {
		return writeFile(lim, limit)
	}
	if err := writeFile(lim, limit); err != nil {
		if err2 := writeFile(sw, limit); err2 != nil {
			return errors.Join(err, err2)
		}
		return writeFile(lim, limit)
	}
	return writeFile(sw, limit)
}

// v2Optional are the controllers enabled above a v2 group when the
// hierarchy offers them, besides the required v2Controllers: with these,
// Nomad's own set for its tasks ("+cpuset +cpu +io +memory +pids").
var v2Optional = []string{"cpuset", "io", "pids"}

func (h *hierarchy) createV2(c *creation, rel string, l Limits) (*Group, error) {
	want := append([]string(nil), v2Controllers...)
	have, err := readFields(filepath.Join(h.root, "cgroup.controllers"))
	if err != nil {
		return nil, err
	}
	required := append([]string(nil), want...)
	if l.CpusetCpus != "" {
		required = append(required, "cpuset")
	}
	for _, ctrl := range required {
		if !have[ctrl] {
			return nil, fmt.Errorf("the %s controller is not available in the cgroup v2 hierarchy at %s", ctrl, h.root)
		}
	}
	for _, ctrl := range v2Optional {
		if have[ctrl] && !slices.Contains(want, ctrl) {
			want = append(want, ctrl)
		}
	}
	// Enable the controllers in every directory above the group, from the
	// root down, making the missing ones on the way.
	if err := enableV2(h.root, want); err != nil {
		return nil, err
	}
	leaf := filepath.Join(h.root, rel)
	err = h.mkdirs(c, h.root, rel, func(dir, _ string, _ bool) error {
		if dir == leaf {
			return nil
		}
		return enableV2(dir, want)
	})
	if err != nil {
		return nil, err
	}
	g := &Group{version: 2, paths: map[string]string{unifiedKey: leaf}, devices: l.Devices}
	if err := g.applyV2(l); err != nil {
		return nil, err
	}
	if l.Devices != nil {
		if err := setV2Devices(leaf, l.Devices); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// nomadGroup tells whether p, Nomad's LinuxResources.CpusetCgroupPath for a
// task, is a group Nomad laid out for the task in this v2 hierarchy, and
// returns it relative to the root. Nomad (1.7 and later, cgroup v2) names
// there the group it expects the task in, under the partition that holds
// its cores (ROOT/nomad.slice/share.slice/ALLOC.TASK.scope, reserve.slice
// for reserved cores; nomad.slice is the client's cgroup_parent), and makes
// it before the task starts. When the partition does not exist, Nomad does
// not manage cgroups here (its cgroup support is off), and the driver's
// own parent is used.
func (h *hierarchy) nomadGroup(p string) (string, bool) {
	if p == "" || !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return "", false
	}
	rel, err := filepath.Rel(h.root, p)
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") || !strings.HasSuffix(rel, ".scope") {
		return "", false
	}
	if !strings.Contains(rel, "/") || !exists(filepath.Join(h.root, filepath.Dir(rel), "cgroup.procs")) {
		return "", false
	}
	return rel, true
}

// enableV2 enables the controllers in dir's cgroup.subtree_control that are
// not enabled yet.
func enableV2(dir string, controllers []string) error {
	path := filepath.Join(dir, "cgroup.subtree_control")
	on, err := readFields(path)
	if err != nil {
		return err
	}
	var add []string
	for _, c := range controllers {
		if !on[c] {
			add = append(add, "+"+c)
		}
	}
	if len(add) == 0 {
		return nil
	}
	sort.Strings(add)
	if err := writeFile(path, strings.Join(add, " ")); err != nil {
		// EBUSY here means dir has processes of its own (the "no internal
		// processes" rule): the parent must be a group without tasks.
		return fmt.Errorf("failed to enable cgroup controllers in %s (it must have no processes of its own): %w", dir, err)
	}
	return nil
}

// cpuWeight converts v1 cpu.shares [2, 262144] to v2 cpu.weight [1, 10000]
// as Nomad 1.11's executors do (Nomad 1.10's were linear, 1024 -> 39): the
// base-10 logarithm of the weight is the quadratic in the base-2 logarithm
// of the shares that takes 2 to 1, 1024 to 100 and 262144 to 10000, so
// that each range's ends meet and a task of cpu = 1024 weighs as a group
// the kernel made with its default weight does on either version.
func cpuWeight(shares int64) int64 {
	switch {
	case shares == 0:
		return defaultWeight
	case shares <= 2:
		return 1
	case shares >= 262144:
		return 10000
	}
	l := math.Log2(float64(shares))
	// a*l^2 + b*l + c through (1, 0), (10, 2) and (18, 4).
	e := (l*l+125*l)/612 - 7.0/34
	return min(max(int64(math.Ceil(math.Pow(10, e))), 1), 10000)
}

func (g *Group) applyV2(l Limits) error {
	dir := g.paths[unifiedKey]
	memMax, swapMax := "max", "max"
	if l.MemoryBytes > 0 {
		memMax, swapMax = strconv.FormatInt(l.MemoryBytes, 10), "0"
	}
	period := int64(defaultCPUPeriod)
	if l.CPUPeriod > 0 {
		period = l.CPUPeriod
	}
	quota := "max"
	if l.CPUQuota > 0 {
		quota = strconv.FormatInt(l.CPUQuota, 10)
	}
	writes := []struct{ file, v string }{
		{"memory.max", memMax},
		{"memory.low", strconv.FormatInt(l.MemoryReservationBytes, 10)},
		{"cpu.weight", strconv.FormatInt(cpuWeight(l.CPUShares), 10)},
		{"cpu.max", quota + " " + strconv.FormatInt(period, 10)},
	}
	// memory.swap.max is missing when the kernel does not account swap.
	if exists(filepath.Join(dir, "memory.swap.max")) {
		writes = append(writes, struct{ file, v string }{"memory.swap.max", swapMax})
	}
	if l.CpusetCpus != "" {
		writes = append(writes, struct{ file, v string }{"cpuset.cpus", l.CpusetCpus})
	}
	// pids.max is missing when the parent does not delegate the pids
	// controller: a limit then cannot be kept.
	if exists(filepath.Join(dir, "pids.max")) {
		writes = append(writes, struct{ file, v string }{"pids.max", pidsMax(l.PidsMax)})
	} else if l.PidsMax > 0 && !v2LimitsOptional {
		return fmt.Errorf("cgroup limit PidsMax (%d) needs the pids controller, which the cgroup v2 hierarchy does not enable here: enable it, or set the driver's pids_limit = 0", l.PidsMax)
	}
	for _, w := range writes {
		path := filepath.Join(dir, w.file)
		if v2LimitsOptional && !exists(path) {
			continue // see nocontrollers.go
		}
		if err := writeFile(path, w.v); err != nil {
			return err
		}
	}
	return nil
}

// Find returns the group parent/name as Create made it with l in the host's
// hierarchy (on v2 that may be Nomad's group for the task; see Create), for
// a caller that never got its State (a start that was cut short). Only the
// directories that exist are in it; the error wraps fs.ErrNotExist when
// none does.
func Find(parent, name string, l Limits) (*Group, error) {
	h, err := hostHierarchy()
	if err != nil {
		return nil, err
	}
	return h.find(parent, name, l)
}

func (h *hierarchy) find(parent, name string, l Limits) (*Group, error) {
	if err := validName("parent", parent, true, true); err != nil {
		return nil, err
	}
	if err := validName("name", name, false, false); err != nil {
		return nil, err
	}
	rel := filepath.Join(parent, name)
	g := &Group{version: h.version, paths: map[string]string{}}
	if h.version == 2 {
		if nomad, ok := h.nomadGroup(l.CpusetCgroupPath); ok {
			rel = nomad
		}
		if dir := filepath.Join(h.root, rel); exists(filepath.Join(dir, "cgroup.procs")) {
			g.paths[unifiedKey] = dir
		}
	} else {
		for _, ctrl := range append([]string{"cpuset", "devices"}, v1Controllers...) {
			m, err := h.v1Mount(ctrl)
			if err != nil {
				continue
			}
			if dir := filepath.Join(m, rel); exists(filepath.Join(dir, "cgroup.procs")) {
				g.paths[ctrl] = dir
			}
		}
	}
	if len(g.paths) == 0 {
		return nil, fmt.Errorf("failed to find cgroup %s: %w", rel, fs.ErrNotExist)
	}
	return g, nil
}
