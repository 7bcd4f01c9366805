package cgroups

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Timeouts, variables so that tests can shorten them.
var (
	// killTimeout bounds Kill.
	killTimeout = 10 * time.Second
	// destroyTimeout bounds the EBUSY retries of Destroy.
	destroyTimeout = 5 * time.Second
	// freezeTimeout bounds one wait for a v1 or v2 freeze to complete.
	freezeTimeout = time.Second
	// useCgroupKill lets tests take the freezer path on a v2 kernel that
	// has cgroup.kill.
	useCgroupKill = true
)

// rmdir removes a cgroup directory; the kernel allows it while the
// directory still shows its files. Tests replace it to emulate that on a
// fake tree.
var rmdir = unix.Rmdir

// userHZ is the unit of cpuacct.stat. The kernel reports USER_HZ to user
// space, which is 100 on every architecture Linux supports.
const userHZ = 100

// Group is a task's control group, in one or more hierarchies.
type Group struct {
	version int
	// paths maps a v1 controller, or "unified", to the group's directory.
	paths map[string]string
	// cpusetPath is Nomad's v1 cpuset group for the task, joined but never
	// made or removed.
	cpusetPath string
	// mounts maps a v1 controller to its hierarchy's mount point; set only
	// by Create and Claim (see JoinThread).
	mounts map[string]string
	// devices are the rules of the group's device filter; nil when it has
	// none. Set only by Create and Claim (see DeviceAllower).
	devices []DeviceRule

	// stats holds the stats files open between samples (statfiles.go);
	// made by the first sample, closed by Destroy.
	statsMu sync.Mutex
	stats   *statFiles
}

// State returns what Load needs to find the group again.
func (g *Group) State() State {
	paths := make(map[string]string, len(g.paths))
	for k, v := range g.paths {
		paths[k] = v
	}
	return State{Version: g.version, Paths: paths, CpusetCgroupPath: g.cpusetPath}
}

// dirs returns the group's directories, each once (v1 controllers may be
// mounted together), in a stable order.
func (g *Group) dirs() []string {
	var out []string
	for _, p := range g.paths {
		out = append(out, p)
	}
	sort.Strings(out)
	return slices.Compact(out)
}

// name is the group's first directory, for messages.
func (g *Group) name() string {
	if dirs := g.dirs(); len(dirs) > 0 {
		return dirs[0]
	}
	return "(none)"
}

// Join moves pid (0 for the calling process) into the group in every
// hierarchy, and on v1 into Nomad's cpuset group when Limits.CpusetCgroupPath
// was set. On v2 a process is in exactly one group, which is Nomad's own
// group for the task when Nomad laid one out (see Create).
// When a write fails the process may be in some hierarchies only.
func (g *Group) Join(pid int) error {
	if pid < 0 {
		return fmt.Errorf("failed to join cgroup: invalid pid %d", pid)
	}
	if pid == 0 {
		pid = os.Getpid()
	}
	dirs := g.dirs()
	if g.version == 1 && g.cpusetPath != "" {
		dirs = append(dirs, g.cpusetPath)
	}
	for _, dir := range dirs {
		if err := writeFile(filepath.Join(dir, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
			return fmt.Errorf("failed to move pid %d into cgroup %s: %w", pid, dir, err)
		}
	}
	return nil
}

// JoinThread moves the calling thread, not its whole process, into the
// group in every v1 hierarchy (and Nomad's cpuset group, as Join does), so
// that a child forked from that thread starts in the group; leave moves
// the thread back where it was. The kernel moves the calling thread alone
// (a write of "0" to "tasks") without the global lock that every
// cgroup.procs write takes, whose price is a wait for an RCU grace period:
// milliseconds when cgroups have been quiet for a while. The caller must
// hold its OS thread, and call leave before anything looks for the group's
// processes: until then its own process counts as one of them. Only a
// group made by Create, or claimed (Claim), can be joined this way. On v2, where a thread of a
// non-threaded group cannot move alone, fork with clone3's
// CLONE_INTO_CGROUP and UnifiedDir instead.
func (g *Group) JoinThread() (leave func() error, err error) {
	if g.version != 1 || g.mounts == nil {
		return nil, fmt.Errorf("failed to join cgroup %s: only a cgroup v1 group made by this process can be joined by a thread", g.name())
	}
	prev, err := threadCgroups()
	if err != nil {
		return nil, err
	}
	type move struct{ to, back string }
	var moves []move
	seen := map[string]bool{}
	ctrls := make([]string, 0, len(g.paths)+1)
	for ctrl := range g.paths {
		ctrls = append(ctrls, ctrl)
	}
	sort.Strings(ctrls)
	targets := make(map[string]string, len(ctrls)+1)
	for _, ctrl := range ctrls {
		targets[ctrl] = g.paths[ctrl]
	}
	if g.cpusetPath != "" {
		if _, ok := targets["cpuset"]; !ok {
			ctrls = append(ctrls, "cpuset")
		}
		targets["cpuset"] = g.cpusetPath
	}
	for _, ctrl := range ctrls {
		to := targets[ctrl]
		if seen[to] {
			continue
		}
		seen[to] = true
		mount, ok := g.mounts[ctrl]
		if !ok {
			return nil, fmt.Errorf("failed to join cgroup %s: the %s hierarchy's mount is unknown", to, ctrl)
		}
		from, ok := prev[ctrl]
		if !ok {
			return nil, fmt.Errorf("failed to join cgroup %s: the thread's %s group is not in /proc/thread-self/cgroup", to, ctrl)
		}
		moves = append(moves, move{to: to, back: filepath.Join(mount, from)})
	}
	var done []move
	leave = func() error {
		var errs []error
		for i := len(done) - 1; i >= 0; i-- {
			if err := writeFile(filepath.Join(done[i].back, "tasks"), "0"); err != nil {
				errs = append(errs, fmt.Errorf("failed to move the thread back to cgroup %s: %w", done[i].back, err))
			}
		}
		done = nil
		return errors.Join(errs...)
	}
	for _, m := range moves {
		if err := writeFile(filepath.Join(m.to, "tasks"), "0"); err != nil {
			err = fmt.Errorf("failed to move the starting thread into cgroup %s: %w", m.to, err)
			return nil, errors.Join(err, leave())
		}
		done = append(done, m)
	}
	return leave, nil
}

// threadCgroups maps each v1 controller (and named hierarchy) of the
// calling thread to its group's path in that hierarchy.
func threadCgroups() (map[string]string, error) {
	b, err := os.ReadFile("/proc/thread-self/cgroup")
	if err != nil {
		return nil, fmt.Errorf("failed to read the thread's cgroups: %w", err)
	}
	out := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 || parts[1] == "" {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			out[c] = parts[2]
		}
	}
	return out, nil
}

// UnifiedDir is the group's directory on cgroup v2, "" on v1: a process
// forked with clone3's CLONE_INTO_CGROUP and a descriptor of it starts in
// the group.
func (g *Group) UnifiedDir() string {
	if g.version != 2 {
		return ""
	}
	return g.paths[unifiedKey]
}

// Pids returns the processes in the group, in any of its hierarchies,
// sorted. A hierarchy whose directory is gone is skipped; when all are
// gone the error wraps fs.ErrNotExist.
func (g *Group) Pids() ([]int, error) {
	var out []int
	var gone error
	dirs := g.dirs()
	for _, dir := range dirs {
		pids, err := readPids(dir)
		if isNotExist(err) {
			gone = err
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, pids...)
	}
	if gone != nil && len(out) == 0 && !slices.ContainsFunc(dirs, func(d string) bool { return exists(d) }) {
		return nil, gone
	}
	sort.Ints(out)
	return slices.Compact(out), nil
}

// Kill sends SIGKILL to every process in the group until it is empty, for
// at most killTimeout. On v2 it uses cgroup.kill when the kernel has it
// (5.14+); otherwise, and on v1, it freezes the group, kills every process,
// thaws it, and repeats, so that no process can fork its way out. It
// refuses to kill a group that holds the calling process.
func (g *Group) Kill() error {
	deadline := time.Now().Add(killTimeout)
	self := os.Getpid()
	useKillFile := false
	var freeze func(bool) error
	if g.version == 2 {
		dir := g.paths[unifiedKey]
		useKillFile = useCgroupKill && exists(filepath.Join(dir, "cgroup.kill"))
		freeze = func(on bool) error { return freezeV2(dir, on) }
	} else if dir, ok := g.paths["freezer"]; ok {
		freeze = func(on bool) error { return freezeV1(dir, on) }
	}
	wait := time.Millisecond
	for {
		pids, err := g.Pids()
		if isNotExist(err) {
			return nil // the group is gone, and its processes with it
		}
		if err != nil {
			return fmt.Errorf("failed to kill cgroup: %w", err)
		}
		if len(pids) == 0 {
			return nil
		}
		if slices.Contains(pids, self) {
			return fmt.Errorf("failed to kill cgroup %s: it holds the calling process %d", g.name(), self)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("failed to kill cgroup %s: %d processes left after %s (pids %v)", g.name(), len(pids), killTimeout, pids)
		}
		switch {
		case useKillFile:
			if err := writeFile(filepath.Join(g.paths[unifiedKey], "cgroup.kill"), "1"); err != nil {
				return fmt.Errorf("failed to kill cgroup: %w", err)
			}
		case freeze != nil:
			// A freeze that does not complete in time (e.g. a task in
			// uninterruptible sleep) still stops most of the group;
			// kill anyway and try again next round.
			ferr := freeze(true)
			if ferr != nil && isNotExist(ferr) {
				return fmt.Errorf("failed to kill cgroup: %w", ferr)
			}
			err := g.signalAll()
			if terr := freeze(false); terr != nil && !isNotExist(terr) {
				return fmt.Errorf("failed to kill cgroup: %w", terr)
			}
			if err != nil {
				return fmt.Errorf("failed to kill cgroup: %w", err)
			}
		default:
			if err := g.signalAll(); err != nil {
				return fmt.Errorf("failed to kill cgroup: %w", err)
			}
		}
		time.Sleep(wait)
		wait = min(2*wait, 100*time.Millisecond)
	}
}

// signalAll sends SIGKILL to every process listed in the group now.
func (g *Group) signalAll() error {
	pids, err := g.Pids()
	if err != nil {
		return err
	}
	self := os.Getpid()
	for _, pid := range pids {
		if pid == self {
			continue
		}
		if err := unix.Kill(pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("failed to send SIGKILL to pid %d: %w", pid, err)
		}
	}
	return nil
}

// freezeV1 freezes (on) or thaws the v1 freezer group dir and, when
// freezing, waits up to freezeTimeout for freezer.state to read FROZEN.
func freezeV1(dir string, on bool) error {
	path := filepath.Join(dir, "freezer.state")
	want := "THAWED"
	if on {
		want = "FROZEN"
	}
	deadline := time.Now().Add(freezeTimeout)
	for {
		if err := writeFile(path, want); err != nil {
			return err
		}
		if !on {
			return nil
		}
		s, err := readString(path)
		if err != nil {
			return err
		}
		if s == want {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroup %s did not freeze within %s: state is %s", dir, freezeTimeout, s)
		}
		time.Sleep(time.Millisecond)
	}
}

// freezeV2 freezes (on) or thaws the v2 group dir through cgroup.freeze
// and, when freezing, waits up to freezeTimeout for cgroup.events to say
// "frozen 1".
func freezeV2(dir string, on bool) error {
	v := "0"
	if on {
		v = "1"
	}
	if err := writeFile(filepath.Join(dir, "cgroup.freeze"), v); err != nil {
		return err
	}
	if !on {
		return nil
	}
	deadline := time.Now().Add(freezeTimeout)
	for {
		ev, err := readKeyed(filepath.Join(dir, "cgroup.events"))
		if err != nil {
			return err
		}
		if ev["frozen"] == 1 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroup %s did not freeze within %s", dir, freezeTimeout)
		}
		time.Sleep(time.Millisecond)
	}
}

// Stats reads the group's CPU and memory usage.
//
// v1: cpuacct.usage, cpuacct.stat (USER_HZ converted to nanoseconds), the
// throttling counters of cpu.stat, memory.stat (total_rss, total_cache,
// total_swap), memory.usage_in_bytes and memory.max_usage_in_bytes.
// v2: cpu.stat (usage_usec, user_usec, system_usec, nr_throttled,
// throttled_usec), memory.current, memory.peak (kernel 5.19+), memory.stat
// (anon, file) and memory.swap.current.
//
// CPUTotalNanos and MemoryUsage must be readable; a missing optional file
// or key only leaves its name out of the Measured lists.
func (g *Group) Stats() (*Stats, error) {
	r := g.statReader()
	r.mu.Lock()
	defer r.mu.Unlock()
	defer r.lend()()
	if g.version == 2 {
		return g.statsV2(r)
	}
	return g.statsV1(r)
}

// optional treats a missing file as "not measured".
func optional[T any](v T, err error) (T, bool, error) {
	if err != nil {
		var zero T
		if isNotExist(err) {
			return zero, false, nil
		}
		return zero, false, err
	}
	return v, true, nil
}

// statField maps a key of a keyed stats file to a Stats field, in the
// field's unit (the value times scale), under Nomad's name for it.
type statField struct {
	key, name string
	dst       *uint64
	scale     uint64
}

// takeStats copies the fields a stats file has and lists them as measured.
func takeStats(values map[string]uint64, measured *[]string, fields []statField) {
	for _, f := range fields {
		if v, ok := values[f.key]; ok {
			*f.dst = v * f.scale
			*measured = append(*measured, f.name)
		}
	}
}

func (g *Group) statsV1(r *statFiles) (*Stats, error) {
	s := &Stats{}
	acct, mem, cpu := g.paths["cpuacct"], g.paths["memory"], g.paths["cpu"]
	var err error
	if s.CPUTotalNanos, err = r.uint(filepath.Join(acct, "cpuacct.usage")); err != nil {
		return nil, err
	}
	times, ok, err := optional(r.keyed(filepath.Join(acct, "cpuacct.stat"), "user", "system"))
	if err != nil {
		return nil, err
	}
	if ok {
		const nsPerTick = uint64(time.Second) / userHZ
		takeStats(times, &s.CPUMeasured, []statField{
			{"user", "User Mode", &s.CPUUserNanos, nsPerTick},
			{"system", "System Mode", &s.CPUSystemNanos, nsPerTick},
		})
	}
	cs, ok, err := optional(r.keyed(filepath.Join(cpu, "cpu.stat"), "nr_throttled", "throttled_time"))
	if err != nil {
		return nil, err
	}
	if ok {
		takeStats(cs, &s.CPUMeasured, []statField{
			{"nr_throttled", "Throttled Periods", &s.ThrottledPeriods, 1},
			{"throttled_time", "Throttled Time", &s.ThrottledNanos, 1},
		})
	}

	ms, ok, err := optional(r.keyed(filepath.Join(mem, "memory.stat"), "total_rss", "total_cache", "total_swap"))
	if err != nil {
		return nil, err
	}
	if ok {
		takeStats(ms, &s.MemoryMeasured, []statField{
			{"total_rss", "RSS", &s.MemoryRSS, 1},
			{"total_cache", "Cache", &s.MemoryCache, 1},
			{"total_swap", "Swap", &s.MemorySwap, 1},
		})
	}
	if s.MemoryUsage, err = r.uint(filepath.Join(mem, "memory.usage_in_bytes")); err != nil {
		return nil, err
	}
	s.MemoryMeasured = append(s.MemoryMeasured, "Usage")
	v, ok, err := optional(r.uint(filepath.Join(mem, "memory.max_usage_in_bytes")))
	if err != nil {
		return nil, err
	}
	if ok {
		s.MemoryMaxUsage = v
		s.MemoryMeasured = append(s.MemoryMeasured, "Max Usage")
	}
	return s, nil
}

func (g *Group) statsV2(r *statFiles) (*Stats, error) {
	s := &Stats{}
	dir := g.paths[unifiedKey]
	cs, err := r.keyed(filepath.Join(dir, "cpu.stat"), "usage_usec", "user_usec", "system_usec", "nr_throttled", "throttled_usec")
	if err != nil {
		return nil, err
	}
	usage, ok := cs["usage_usec"]
	if !ok {
		return nil, fmt.Errorf("failed to read %s: no usage_usec", filepath.Join(dir, "cpu.stat"))
	}
	s.CPUTotalNanos = usage * 1000
	takeStats(cs, &s.CPUMeasured, []statField{
		{"user_usec", "User Mode", &s.CPUUserNanos, 1000},
		{"system_usec", "System Mode", &s.CPUSystemNanos, 1000},
		{"nr_throttled", "Throttled Periods", &s.ThrottledPeriods, 1},
		{"throttled_usec", "Throttled Time", &s.ThrottledNanos, 1000},
	})

	ms, ok, err := optional(r.keyed(filepath.Join(dir, "memory.stat"), "anon", "file"))
	if err != nil {
		return nil, err
	}
	if ok {
		takeStats(ms, &s.MemoryMeasured, []statField{
			{"anon", "RSS", &s.MemoryRSS, 1},
			{"file", "Cache", &s.MemoryCache, 1},
		})
	}
	v, ok, err := optional(r.uint(filepath.Join(dir, "memory.swap.current")))
	if err != nil {
		return nil, err
	}
	if ok {
		s.MemorySwap = v
		s.MemoryMeasured = append(s.MemoryMeasured, "Swap")
	}
	if v2LimitsOptional && !exists(filepath.Join(dir, "memory.current")) {
		return s, nil // no memory controller; see nocontrollers.go
	}
	if s.MemoryUsage, err = r.uint(filepath.Join(dir, "memory.current")); err != nil {
		return nil, err
	}
	s.MemoryMeasured = append(s.MemoryMeasured, "Usage")
	v, ok, err = optional(r.uint(filepath.Join(dir, "memory.peak")))
	if err != nil {
		return nil, err
	}
	if ok {
		s.MemoryMaxUsage = v
		s.MemoryMeasured = append(s.MemoryMeasured, "Max Usage")
	}
	return s, nil
}

// OOMKilled reports whether the kernel's OOM killer killed a process of the
// group: "oom_kill" above zero in memory.oom_control (v1, kernel 4.13+) or
// memory.events (v2). A kernel without the counter reports false.
func (g *Group) OOMKilled() (bool, error) {
	path := filepath.Join(g.paths["memory"], "memory.oom_control")
	if g.version == 2 {
		path = filepath.Join(g.paths[unifiedKey], "memory.events")
		if v2LimitsOptional && exists(g.paths[unifiedKey]) && !exists(path) {
			return false, nil // no memory controller; see nocontrollers.go
		}
	}
	kv, err := readKeyed(path)
	if err != nil {
		return false, err
	}
	return kv["oom_kill"] > 0, nil
}

// PidsLimited returns how many times the group's pids.max refused a fork
// or a new thread ("max" in pids.events, v1 and v2); 0 when the group has
// no pids controller.
func (g *Group) PidsLimited() (uint64, error) {
	dir, ok := g.paths["pids"]
	if g.version == 2 {
		dir, ok = g.paths[unifiedKey]
	}
	path := filepath.Join(dir, "pids.events")
	if !ok || !exists(path) {
		return 0, nil
	}
	kv, err := readKeyed(path)
	if err != nil {
		return 0, err
	}
	return kv["max"], nil
}

// Destroy removes the group's directories (never the parent, nor Nomad's
// cpuset group), retrying for up to destroyTimeout while the kernel says
// they are busy. A directory already gone counts as removed.
func (g *Group) Destroy() error {
	// The stats files are closed once the directories are removed: a
	// sample taken while they are would hold the removed group's files.
	defer g.closeStats()
	var errs []error
	deadline := time.Now().Add(destroyTimeout)
	for _, dir := range g.dirs() {
		for {
			err := rmdir(dir)
			if err == nil || errors.Is(err, unix.ENOENT) {
				break
			}
			if errors.Is(err, unix.EBUSY) && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			errs = append(errs, fmt.Errorf("failed to remove cgroup %s: %w", dir, err))
			break
		}
	}
	return errors.Join(errs...)
}

// Via returns the group with every directory reached through root, a path
// that stands for the host's root directory, such as /proc/self/fd/N of a
// handle on it: for a thread that has entered a root of its own, where the
// host's cgroup file systems are not mounted. The group is the same; only
// how this thread finds it changes.
func (g *Group) Via(root string) *Group {
	via := func(p string) string {
		if p == "" {
			return ""
		}
		return filepath.Join(root, p)
	}
	c := Group{version: g.version, devices: g.devices}
	c.paths = make(map[string]string, len(g.paths))
	for k, v := range g.paths {
		c.paths[k] = via(v)
	}
	if g.mounts != nil {
		c.mounts = make(map[string]string, len(g.mounts))
		for k, v := range g.mounts {
			c.mounts[k] = via(v)
		}
	}
	c.cpusetPath = via(g.cpusetPath)
	return &c
}
