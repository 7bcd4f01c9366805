//go:build e2e

package e2e

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// Proc is one process from /proc.
type Proc struct {
	PID  int
	PPID int
	Comm string
}

func listProcs() []Proc {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var procs []Proc
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		p, err := ReadProc(pid)
		if err == nil {
			procs = append(procs, p)
		}
	}
	return procs
}

// ReadProc reads a process's name and parent from /proc/PID/status.
func ReadProc(pid int) (Proc, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Proc{}, err
	}
	defer f.Close()
	p := Proc{PID: pid}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Name":
			p.Comm = v
		case "PPid":
			p.PPID, _ = strconv.Atoi(v)
		}
	}
	return p, sc.Err()
}

// StatusField reads one field of /proc/PID/status ("VmRSS" -> "1234 kB").
func StatusField(pid int, field string) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && k == field {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

// Children lists the agent's current child processes.
func (a *Agent) Children() []Proc {
	pid := a.PID()
	if pid == 0 {
		return nil
	}
	var out []Proc
	for _, p := range listProcs() {
		if p.PPID == pid {
			out = append(out, p)
		}
	}
	return out
}

// DriverPluginPID is the PID of the agent's nomad-driver-csi plugin
// process (0 when there is none).
func (a *Agent) DriverPluginPID() int {
	for _, p := range a.Children() {
		// comm is cut at 15 bytes: "nomad-driver-cs".
		if strings.HasPrefix("nomad-driver-csi", p.Comm) && len(p.Comm) >= 12 {
			return p.PID
		}
	}
	return 0
}

// TaskPIDs finds the host PIDs of the processes of one allocation's task:
// those whose environment holds NOMAD_ALLOC_ID=<alloc> and
// NOMAD_TASK_NAME=<task>, excluding "nomad alloc exec" sessions' parents.
func TaskPIDs(allocID, task string) []int {
	var pids []int
	self := os.Getpid()
	for _, p := range listProcs() {
		if p.PID == self {
			continue
		}
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", p.PID))
		if err != nil {
			continue
		}
		vars := strings.Split(string(env), "\x00")
		if contains(vars, "NOMAD_ALLOC_ID="+allocID) && contains(vars, "NOMAD_TASK_NAME="+task) {
			pids = append(pids, p.PID)
		}
	}
	sort.Ints(pids)
	return pids
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// allocIDs lists the allocations this agent ever placed (the directories
// of its alloc dir).
func (a *Agent) allocIDs() []string {
	var ids []string
	for _, dir := range []string{filepath.Join(a.DataDir, "alloc")} {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if e.IsDir() && len(e.Name()) == 36 {
				ids = append(ids, e.Name())
			}
		}
	}
	return ids
}

// killLeftovers SIGKILLs, by PID, every process that belongs to this
// agent's test: a remembered child of the agent, or a process whose
// command line, working directory, environment or cgroup names the
// temporary directory or one of the agent's allocations.
func (a *Agent) killLeftovers() {
	self := os.Getpid()
	ancestors := map[int]bool{}
	for pid := self; pid > 1; {
		ancestors[pid] = true
		p, err := ReadProc(pid)
		if err != nil {
			break
		}
		pid = p.PPID
	}
	ids := a.allocIDs()
	a.mu.Lock()
	children := map[int]string{}
	for k, v := range a.children {
		children[k] = v
	}
	a.mu.Unlock()

	killRounds(a.opts.Logf, func(procs []Proc) []int {
		var victims []int
		for _, p := range procs {
			if ancestors[p.PID] || p.PID == 1 || procState(p.PID) == "Z" {
				continue
			}
			if comm, ok := children[p.PID]; ok && comm == p.Comm {
				victims = append(victims, p.PID)
				continue
			}
			if a.belongs(p.PID, ids) {
				victims = append(victims, p.PID)
			}
		}
		return victims
	})
}

// killRounds kills, in up to three rounds half a second apart, the
// processes pick chooses from the process table read afresh each round
// (a killed parent's children may show up reparented), logging each
// one's command line; it stops at the first round that chooses none.
func killRounds(logf func(format string, args ...any), pick func([]Proc) []int) {
	for round := 0; round < 3; round++ {
		victims := pick(listProcs())
		if len(victims) == 0 {
			return
		}
		for _, pid := range victims {
			cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			logf("killing leftover process pid=%d state=%s cmdline=%q", pid, procState(pid), strings.ReplaceAll(string(cmdline), "\x00", " "))
			_ = unix.Kill(pid, unix.SIGKILL)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// Owns tells whether a process belongs to this agent's test: its command
// line, working directory, environment or cgroup names the agent's
// temporary directory or one of its allocations.
func (a *Agent) Owns(pid int) bool { return a.belongs(pid, a.allocIDs()) }

func (a *Agent) belongs(pid int, allocIDs []string) bool {
	marks := append([]string{a.Dir + "/"}, allocIDs...)
	var texts []string
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil {
		texts = append(texts, string(b))
	}
	if cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid)); err == nil {
		texts = append(texts, cwd+"/")
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid)); err == nil {
		texts = append(texts, string(b))
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err == nil {
		texts = append(texts, string(b))
	}
	for _, s := range texts {
		for _, m := range marks {
			if strings.Contains(s, m) {
				return true
			}
		}
	}
	return false
}

// removeCgroups removes (rmdir, deepest first) the agent's own cgroup
// parent and any empty cgroup named after one of its allocations. rmdir
// only removes empty groups, so a live group is never touched.
func (a *Agent) removeCgroups() {
	ids := a.allocIDs()
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	var dirs []string
	for _, root := range roots {
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return nil
			}
			rel, _ := filepath.Rel(root, p)
			if strings.Count(rel, "/") > 4 {
				return filepath.SkipDir
			}
			base := filepath.Base(p)
			if a.ownsCgroup(rel) {
				dirs = append(dirs, p)
				return nil
			}
			for _, id := range ids {
				if strings.Contains(base, id) {
					dirs = append(dirs, p)
					break
				}
			}
			return nil
		})
	}
	sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
	for _, d := range dirs {
		if err := unix.Rmdir(d); err != nil && !errors.Is(err, unix.ENOENT) {
			a.opts.Logf("cgroup %s of this agent is left: %v", d, err)
		}
	}
}

// ownsCgroup tells whether a cgroup path (relative to its hierarchy's
// root) is or is under one of this agent's cgroup parents: Nomad's client
// cgroup_parent or the csi driver's. Whole path elements are compared, so
// that the parent of another run whose name starts the same is not taken.
func (a *Agent) ownsCgroup(rel string) bool {
	if a.cgroupParent == "" {
		return false
	}
	for _, el := range strings.Split(rel, "/") {
		if el == a.cgroupParent || el == a.DriverCgroupParent() {
			return true
		}
	}
	return false
}

// MountsUnder lists the mount points at or below dir, from
// /proc/self/mountinfo, deepest first.
func MountsUnder(dir string) ([]string, error) {
	table, err := mounter.New().List()
	if err != nil {
		return nil, err
	}
	dir = filepath.Clean(dir)
	var out []string
	for _, mp := range table {
		if mounter.PathWithin(mp.Path, dir) {
			out = append(out, mp.Path)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, nil
}

// UnmountUnder unmounts everything at or below dir, deepest first,
// lazily when a mount is busy, and reports what is still mounted.
func UnmountUnder(dir string) error {
	for round := 0; round < 5; round++ {
		mounts, err := MountsUnder(dir)
		if err != nil {
			return err
		}
		if len(mounts) == 0 {
			return nil
		}
		for _, mp := range mounts {
			if err := unix.Unmount(mp, 0); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				_ = unix.Unmount(mp, unix.MNT_DETACH)
			}
		}
	}
	mounts, err := MountsUnder(dir)
	if err != nil {
		return err
	}
	if len(mounts) > 0 {
		return fmt.Errorf("still mounted: %s", strings.Join(mounts, ", "))
	}
	return nil
}

// procState is the one-letter state of a process ("R", "S", "Z"...).
func procState(pid int) string {
	s, err := StatusField(pid, "State")
	if err != nil {
		return "?"
	}
	return strings.SplitN(s, " ", 2)[0]
}

// ownerFile is the file of an OwnedTempDir its maker holds an flock on.
const ownerFile = ".owner"

// ownedPrefixes are the OwnedTempDir prefixes SweepStale looks at.
var ownedPrefixes = []string{"ncsp-", "ncsb-", "ncsr-"}

// OwnedTempDir makes a directory /tmp/<prefix>* and removes it when tb
// ends, passed or failed: its cleanup, registered here, runs after every
// cleanup the caller registers later (an agent's Close among them), and
// does what a sweep does to a dead run's directory (sweepOwned): whatever
// of this run still names the directory is killed (a driver that outlived
// its agent, still writing its debug stats there; never a process of
// another test or run that merely names it, killOwnedLeftovers), what is
// mounted under it unmounted, and the directory removed; a failure fails
// tb. Until then the process holds an flock on <dir>/.owner, which the
// kernel drops when the process dies, however it dies: SweepStale removes
// the directory of a run that died before its cleanups, and never one
// whose maker lives. A caller that needs the directory gone earlier, or a
// failure of its own when something is left in it, removes it in a
// cleanup of its own (registered later, it runs first).
func OwnedTempDir(tb testing.TB, prefix string) string {
	tb.Helper()
	if !slices.Contains(ownedPrefixes, prefix) {
		tb.Fatalf("OwnedTempDir: prefix %q is not one SweepStale knows (%v)", prefix, ownedPrefixes)
	}
	dir, err := os.MkdirTemp("/tmp", prefix)
	if err != nil {
		tb.Fatalf("failed to make a temporary directory: %v", err)
	}
	// Locked under another name, then renamed: a sweep never finds the
	// owner file unlocked while its maker lives.
	f, err := os.Create(filepath.Join(dir, ownerFile+".new"))
	if err != nil {
		_ = os.RemoveAll(dir)
		tb.Fatalf("failed to make the owner file of %s: %v", dir, err)
	}
	// The lock is let go only once the directory is gone.
	tb.Cleanup(func() {
		defer f.Close()
		if err := sweepOwned(dir, tb.Logf); err != nil {
			tb.Errorf("%v", err)
		}
	})
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		tb.Fatalf("failed to lock the owner file of %s: %v", dir, err)
	}
	// The run the processes to kill in it belong to (runMark).
	if _, err := f.WriteString(runMark()); err != nil {
		tb.Fatalf("failed to write the owner file of %s: %v", dir, err)
	}
	if err := os.Rename(f.Name(), filepath.Join(dir, ownerFile)); err != nil {
		tb.Fatalf("failed to name the owner file of %s: %v", dir, err)
	}
	return dir
}

// runEnv names, in the environment of the processes a test run starts,
// the run (runMark): a process that names an OwnedTempDir is killed with
// it only when it is the run's own, never one of a test beside it (another
// package's, which go test runs at the same time, or another CI job's)
// that merely has the path on its command line or as its directory.
const runEnv = "NCSI_E2E_RUN"

var (
	runMarkOnce sync.Once
	runMarkKV   string
)

// runMark is "NCSI_E2E_RUN=<pid>.<start time>" of this process, set in its
// environment on first use, so that every process started after, and
// every one they start in turn with their environment (an agent, its
// driver), carries it, also once the process between them died (a driver
// that outlived its agent).
func runMark() string {
	runMarkOnce.Do(func() {
		start, _ := wire.ProcStartTime(os.Getpid())
		v := fmt.Sprintf("%d.%d", os.Getpid(), start)
		os.Setenv(runEnv, v)
		runMarkKV = runEnv + "=" + v
	})
	return runMarkKV
}

// killOwnedLeftovers SIGKILLs, by PID, every process that names dir (its
// command line, working directory or environment) and is of the run that
// made it: a descendant of this process, or one whose environment holds
// mark, the run's runMark (empty: none). Another run's process, or any
// other, that names dir is left alone.
func killOwnedLeftovers(dir, mark string, logf func(format string, args ...any)) {
	self := os.Getpid()
	named := &Agent{Dir: dir, DataDir: filepath.Join(dir, "no-data")}
	killRounds(logf, func(procs []Proc) []int {
		parent := make(map[int]int, len(procs))
		for _, p := range procs {
			parent[p.PID] = p.PPID
		}
		var victims []int
		for _, p := range procs {
			if p.PID == self || p.PID == 1 || procState(p.PID) == "Z" || !named.belongs(p.PID, nil) {
				continue
			}
			if descendsFrom(p.PID, self, parent) || (mark != "" && hasEnv(p.PID, mark)) {
				victims = append(victims, p.PID)
			}
		}
		return victims
	})
}

// descendsFrom reports whether pid is a descendant of ancestor in the
// process tree parent (pid to parent pid).
func descendsFrom(pid, ancestor int, parent map[int]int) bool {
	for n := 0; pid > 1 && n < len(parent); n++ {
		pid = parent[pid]
		if pid == ancestor {
			return true
		}
	}
	return false
}

// hasEnv reports whether kv is one of the variables of pid's environment.
func hasEnv(pid int, kv string) bool {
	env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	return err == nil && contains(strings.Split(string(env), "\x00"), kv)
}

// ownerGone reports whether dir is an OwnedTempDir whose maker is gone:
// its owner file exists and nobody holds its lock. A directory without
// one (made by an older harness, or being made) is never taken.
func ownerGone(dir string) bool {
	f, err := os.Open(filepath.Join(dir, ownerFile))
	if err != nil {
		return false
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return false
	}
	unix.Flock(int(f.Fd()), unix.LOCK_UN)
	return true
}

// SweepStale cleans up after earlier runs that died without cleaning up
// (a -test.timeout panic, a SIGKILL): every /tmp/ncsi-* directory whose
// agent is gone — no nomad process names it on its command line and its
// logs have not changed for two minutes — gets the same treatment as
// Close: its processes killed by PID, its cgroups removed, its mounts
// unmounted, and then the directory removed. Then every OwnedTempDir
// whose maker is gone: the processes of that run that name it killed
// (those whose environment holds the mark its owner file keeps; a
// directory of an older harness has none, and its processes are left),
// its mounts unmounted, the directory removed.
func SweepStale(logf func(format string, args ...any)) {
	sweepAgents(logf)
	for _, prefix := range ownedPrefixes {
		dirs, _ := filepath.Glob("/tmp/" + prefix + "*")
		for _, dir := range dirs {
			if ownerGone(dir) {
				logf("e2e: cleaning up after a dead run in %s", dir)
				sweepOwned(dir, logf)
			}
		}
	}
}

// sweepOwned kills what is left of the processes of the run that made dir
// (killOwnedLeftovers), unmounts everything under it and removes it.
func sweepOwned(dir string, logf func(format string, args ...any)) error {
	mark, _ := os.ReadFile(filepath.Join(dir, ownerFile))
	killOwnedLeftovers(dir, string(mark), logf)
	if err := UnmountUnder(dir); err != nil {
		return fmt.Errorf("mounts left under %s, not removing it: %w", dir, err)
	}
	if os.Getenv("E2E_KEEP") != "" {
		logf("E2E_KEEP set: keeping %s", dir)
		return nil
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("failed to remove %s: %w", dir, err)
	}
	return nil
}

func sweepAgents(logf func(format string, args ...any)) {
	dirs, _ := filepath.Glob("/tmp/ncsi-*")
	for _, dir := range dirs {
		if !isStale(dir) {
			continue
		}
		logf("e2e: cleaning up after a dead run in %s", dir)
		a := &Agent{
			Dir:          dir,
			DataDir:      filepath.Join(dir, "data"),
			cgroupParent: cgroupParentOf(dir),
			opts:         AgentOptions{Logf: logf},
			children:     map[int]string{},
		}
		a.killLeftovers()
		a.removeCgroups()
		if err := UnmountUnder(dir); err != nil {
			logf("e2e: mounts left under %s, not removing it: %v", dir, err)
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			logf("e2e: failed to remove %s: %v", dir, err)
		}
	}
}

func isStale(dir string) bool {
	fi, err := os.Stat(dir)
	if err != nil || !fi.IsDir() || time.Since(fi.ModTime()) < 2*time.Minute {
		return false
	}
	for _, log := range []string{"agent.log", "server.log"} {
		if fi, err := os.Stat(filepath.Join(dir, log)); err == nil && time.Since(fi.ModTime()) < 2*time.Minute {
			return false
		}
	}
	for _, p := range listProcs() {
		if p.Comm != "nomad" {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p.PID))
		if err == nil && strings.Contains(string(b), dir+"/") {
			return false
		}
	}
	return true
}
