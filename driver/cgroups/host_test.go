package cgroups

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
	"golang.org/x/sys/unix"
)

// joinSelfEnv makes the test binary a helper that loads the group in the
// variable's JSON State, joins it with Join(0), and prints its
// /proc/self/cgroup.
const joinSelfEnv = "CGROUPS_TEST_JOIN_SELF"

func TestMain(m *testing.M) {
	if st := os.Getenv(joinSelfEnv); st != "" {
		os.Exit(joinSelf(st))
	}
	if tries := os.Getenv(devProbeEnv); tries != "" {
		os.Exit(devProbe(tries))
	}
	if dir := os.Getenv(attachDevicesEnv); dir != "" {
		if err := setV2Devices(dir, DefaultDevices); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func joinSelf(state string) int {
	var st State
	if err := json.Unmarshal([]byte(state), &st); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	g, err := Load(st)
	if err == nil {
		err = g.Join(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	os.Stdout.Write(b)
	return 0
}

// needHost skips a test that needs root and usable cgroups.
func needHost(t testing.TB) *hierarchy {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create cgroups")
	}
	if err := Available(); err != nil {
		t.Skipf("cgroups are not available here: %v", err)
	}
	h, err := hostHierarchy()
	must.NoError(t, err)
	return h
}

// needLimits skips a test of limits, memory usage or OOM in the test build
// for a unified hierarchy without controllers (see nocontrollers.go).
func needLimits(t *testing.T) {
	t.Helper()
	if v2LimitsOptional {
		t.Skip("needs the cpu and memory controllers, which this cgroupv2_nocontrollers build runs without")
	}
}

func waitFor(f func() bool) *wait.Constraint {
	return wait.InitialSuccess(wait.BoolFunc(f), wait.Timeout(scaled(5*time.Second)), wait.Gap(10*time.Millisecond))
}

// scaled stretches a wait by E2E_TIME_SCALE, which make e2e-vm sets in its
// guest, where everything runs several times slower under software
// emulation. What a test checks stays the same.
func scaled(d time.Duration) time.Duration {
	var f float64
	if _, err := fmt.Sscan(os.Getenv("E2E_TIME_SCALE"), &f); err != nil || f < 1 {
		return d
	}
	return time.Duration(float64(d) * f)
}

func uniqueParent() string {
	return fmt.Sprintf("nomad-driver-csi-test-%d-%d", os.Getpid(), time.Now().UnixNano())
}

// gone checks that none of the paths exists.
func gone(t *testing.T, paths ...string) {
	t.Helper()
	for _, p := range paths {
		_, err := os.Stat(p)
		must.True(t, os.IsNotExist(err), must.Sprintf("%s still exists", p))
	}
}

// hostGroup creates a group on the real machine under a parent unique to
// the test, or skips the test when that is not possible here. Cleanup kills
// and destroys the group and removes the parent.
func hostGroup(t testing.TB, l Limits) *Group {
	t.Helper()
	h := needHost(t)
	parent := uniqueParent()
	g, err := Create(parent, "task", l)
	must.NoError(t, err)
	t.Cleanup(func() {
		must.NoError(t, g.Kill())
		must.NoError(t, g.Destroy())
		removeParent(t, h, parent)
	})
	return g
}

// removeParent removes the parent directory a test made in every hierarchy.
func removeParent(t testing.TB, h *hierarchy, parent string) {
	t.Helper()
	dirs := []string{filepath.Join(h.root, parent)}
	if h.version == 1 {
		dirs = nil
		for _, c := range append(v1Controllers, "cpuset", "devices") {
			dirs = append(dirs, filepath.Join(h.root, c, parent))
		}
	}
	for _, dir := range dirs {
		if err := os.Remove(dir); err != nil && !os.IsNotExist(err) {
			t.Errorf("failed to remove test parent: %v", err)
		}
	}
}

// startIn starts a command and moves it into g; the command waits for a
// line on stdin before it runs script, so that all it does happens inside
// the group. Cleanup kills it.
func startIn(t testing.TB, g *Group, script string) (*exec.Cmd, func()) {
	t.Helper()
	cmd := exec.Command("sh", "-c", "read x; "+script)
	w, err := cmd.StdinPipe()
	must.NoError(t, err)
	must.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	must.NoError(t, g.Join(cmd.Process.Pid))
	return cmd, func() {
		_, err := w.Write([]byte("go\n"))
		must.NoError(t, err)
	}
}

func TestHost_Lifecycle(t *testing.T) {
	g := hostGroup(t, Limits{MemoryBytes: 256 << 20, CPUShares: 512, CPUQuota: 50000, CPUPeriod: 100000, PidsMax: 77})

	for k, dir := range g.State().Paths {
		_, err := os.Stat(filepath.Join(dir, "cgroup.procs"))
		must.NoError(t, err, must.Sprintf("path of %s", k))
	}

	cmd := exec.Command("sleep", "60")
	must.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	must.NoError(t, g.Join(cmd.Process.Pid))

	pids, err := g.Pids()
	must.NoError(t, err)
	must.Eq(t, []int{cmd.Process.Pid}, pids)

	st, err := g.Stats()
	must.NoError(t, err)
	must.SliceContains(t, st.CPUMeasured, "User Mode")
	if !v2LimitsOptional {
		must.SliceContains(t, st.MemoryMeasured, "Usage")
	}
	// v1 does not move a process's memory charge with it, so usage may
	// still be zero here.

	// The limits are what the kernel enforces.
	switch {
	case v2LimitsOptional:
		// No controllers, no limit files (see nocontrollers.go).
	case g.version == 1:
		for file, want := range map[string]string{
			"memory/memory.limit_in_bytes": "268435456",
			"cpu/cpu.shares":               "512",
			"cpu/cpu.cfs_quota_us":         "50000",
			"cpu/cpu.cfs_period_us":        "100000",
			"pids/pids.max":                "77",
		} {
			ctrl, name := filepath.Split(file)
			got, err := readString(filepath.Join(g.paths[filepath.Clean(ctrl)], name))
			must.NoError(t, err)
			must.Eq(t, want, got, must.Sprintf("%s", file))
		}
	default:
		got, err := readString(filepath.Join(g.paths[unifiedKey], "memory.max"))
		must.NoError(t, err)
		must.Eq(t, "268435456", got)
		got, err = readString(filepath.Join(g.paths[unifiedKey], "cpu.max"))
		must.NoError(t, err)
		must.Eq(t, "50000 100000", got)
		got, err = readString(filepath.Join(g.paths[unifiedKey], "pids.max"))
		must.NoError(t, err)
		must.Eq(t, "77", got)
	}

	oom, err := g.OOMKilled()
	must.NoError(t, err)
	must.False(t, oom)

	// Load finds the same group again.
	g2, err := Load(g.State())
	must.NoError(t, err)
	must.Eq(t, g.State(), g2.State())

	must.NoError(t, g2.Kill())
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("sleep did not exit after Kill")
	}
	pids, err = g.Pids()
	must.NoError(t, err)
	must.SliceEmpty(t, pids)

	must.NoError(t, g.Destroy())
	gone(t, g.dirs()...)
	_, err = Load(g.State())
	must.ErrorIs(t, err, os.ErrNotExist)
	// Destroying or killing again is fine.
	must.NoError(t, g.Destroy())
	must.NoError(t, g.Kill())
	_, err = g.Pids()
	must.ErrorIs(t, err, os.ErrNotExist)
}

func TestHost_OOM(t *testing.T) {
	needLimits(t)
	g := hostGroup(t, Limits{MemoryBytes: 32 << 20})
	// tail keeps its whole input in memory when it has no newline.
	cmd, run := startIn(t, g, "head -c 200M /dev/zero | tail")
	run()
	err := cmd.Wait()
	must.Error(t, err)
	oom, err := g.OOMKilled()
	must.NoError(t, err)
	must.True(t, oom)
	st, err := g.Stats()
	must.NoError(t, err)
	if slices.Contains(st.MemoryMeasured, "Max Usage") {
		must.LessEq(t, uint64(32<<20), st.MemoryMaxUsage)
	}
}

func TestHost_KillForkBomb(t *testing.T) {
	g := hostGroup(t, Limits{MemoryBytes: 256 << 20})
	// Each process forks two that sleep and fork again, a bounded bomb.
	_, run := startIn(t, g, `f() { sleep 0.01; f & f & wait; }; f`)
	run()
	time.Sleep(300 * time.Millisecond)
	pids, err := g.Pids()
	must.NoError(t, err)
	must.Greater(t, 1, len(pids))
	must.NoError(t, g.Kill())
	pids, err = g.Pids()
	must.NoError(t, err)
	must.SliceEmpty(t, pids)
}

// Available on the host's hierarchy, and on every other cgroup2 mount
// (on a hybrid host, /sys/fs/cgroup/unified, so the v2 path runs in plain
// make unit too), agrees with what the kernel shows, read here on its own:
// v1 needs every controller in v1Controllers mounted at root/<name>; v2
// needs every one in v2Controllers listed in root/cgroup.controllers, and
// names the first one missing and the root.
func TestHost_Available(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: Available reports unwritable hierarchies otherwise")
	}
	h, err := hostHierarchy()
	must.NoError(t, err)
	want := wantAvailable(t, h.root)
	t.Logf("cgroup v%d at %s: want %q", h.version, h.root, want)
	checkAvailable(t, Available(), want)

	// Every other cgroup2 mount, as the v2 hierarchy it would be.
	mi, err := os.ReadFile("/proc/self/mountinfo")
	must.NoError(t, err)
	for _, line := range strings.Split(string(mi), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		if !ok || !strings.HasPrefix(post, "cgroup2 ") {
			continue
		}
		root := strings.Fields(pre)[4]
		if root == h.root {
			continue
		}
		t.Run(root, func(t *testing.T) {
			v2, err := detect(root, statfsMagic)
			must.NoError(t, err)
			must.Eq(t, 2, v2.version)
			want := wantAvailable(t, root)
			t.Logf("cgroup v2 at %s: want %q", root, want)
			checkAvailable(t, v2.available(), want)
		})
	}
}

// wantAvailable reads what the kernel shows at root and returns the start
// of the error Available must give ("" for none).
func wantAvailable(t *testing.T, root string) string {
	t.Helper()
	var st unix.Statfs_t
	must.NoError(t, unix.Statfs(root, &st))
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		for _, c := range v1Controllers {
			var cst unix.Statfs_t
			if err := unix.Statfs(filepath.Join(root, c), &cst); err != nil || cst.Type != unix.CGROUP_SUPER_MAGIC {
				return fmt.Sprintf("the %s cgroup controller is not mounted at %s", c, filepath.Join(root, c))
			}
		}
		return ""
	}
	b, err := os.ReadFile(filepath.Join(root, "cgroup.controllers"))
	must.NoError(t, err)
	have := strings.Fields(string(b))
	for _, c := range v2Controllers {
		if !slices.Contains(have, c) {
			return fmt.Sprintf("the %s controller is not available in the cgroup v2 hierarchy at %s", c, root)
		}
	}
	return ""
}

func checkAvailable(t *testing.T, err error, want string) {
	t.Helper()
	if want == "" {
		must.NoError(t, err)
		return
	}
	must.Error(t, err)
	must.StrHasPrefix(t, want, err.Error())
}

// A killed child that its parent has not reaped yet is a zombie: it is not
// in the group any more, so Kill must not wait for it.
func TestHost_KillUnreaped(t *testing.T) {
	g := hostGroup(t, Limits{})
	var cmds []*exec.Cmd
	for range 3 {
		cmd := exec.Command("sleep", "60")
		must.NoError(t, cmd.Start())
		cmds = append(cmds, cmd)
		must.NoError(t, g.Join(cmd.Process.Pid))
	}
	t.Cleanup(func() {
		for _, cmd := range cmds {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	start := time.Now()
	must.NoError(t, g.Kill())
	must.Less(t, 2*time.Second, time.Since(start))
	for _, cmd := range cmds {
		err := cmd.Wait()
		must.ErrorContains(t, err, "killed")
	}
}

// A pinned group without Nomad's cpuset group has a cpuset group of its
// own, which the task joins.
func TestHost_Cpuset(t *testing.T) {
	needLimits(t)
	g := hostGroup(t, Limits{CpusetCpus: "0"})
	cmd, run := startIn(t, g, "exec sleep 60")
	run()
	must.Wait(t, waitFor(func() bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", cmd.Process.Pid))
		return err == nil && strings.Contains(string(b), "Cpus_allowed_list:\t0\n")
	}))
	if g.version == 1 {
		pids, err := readPids(g.paths["cpuset"])
		must.NoError(t, err)
		must.Eq(t, []int{cmd.Process.Pid}, pids)
	}
}

// nomadCpuset makes a stand-in for the v1 cpuset group Nomad makes for a
// task: with the parent's CPUs and memory nodes like Nomad's share
// partition, or, for a task with reserved cores, with the memory nodes only
// (Nomad leaves the CPUs to the task driver). Cleanup removes it.
func nomadCpuset(t *testing.T, h *hierarchy, share bool) string {
	t.Helper()
	mount, err := h.v1Mount("cpuset")
	if err != nil {
		t.Skipf("no cpuset hierarchy: %v", err)
	}
	nomad := filepath.Join(mount, uniqueParent()+"-nomad")
	must.NoError(t, os.Mkdir(nomad, 0o755))
	t.Cleanup(func() { must.NoError(t, rmdir(nomad)) })
	if share {
		must.NoError(t, copyFile(mount, nomad, "cpuset.cpus"))
	}
	must.NoError(t, copyFile(mount, nomad, "cpuset.mems"))
	return nomad
}

// cpusAllowed reads a process's Cpus_allowed_list.
func cpusAllowed(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	must.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no Cpus_allowed_list in /proc/%d/status", pid)
	return ""
}

// Nomad's own cpuset group (v1): the task joins it and no cpuset group of
// ours is made; the reserved cores are written to it; Destroy leaves it.
func TestHost_NomadCpusetV1(t *testing.T) {
	h := needHost(t)
	if h.version != 1 {
		t.Skip("Nomad's cpuset group is joined on cgroup v1 only")
	}
	root, err := h.v1Mount("cpuset")
	if err != nil {
		t.Skipf("no cpuset hierarchy: %v", err)
	}
	all, err := readString(filepath.Join(root, "cpuset.cpus"))
	must.NoError(t, err)
	cases := []struct {
		name  string
		share bool
		cpus  string // Limits.CpusetCpus
		want  string // the task's Cpus_allowed_list
	}{
		{name: "share partition", share: true, want: all},
		{name: "reserved cores", cpus: "0", want: "0"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			nomad := nomadCpuset(t, h, tc.share)
			g := hostGroup(t, Limits{CpusetCpus: tc.cpus, CpusetCgroupPath: nomad})
			must.MapNotContainsKey(t, g.paths, "cpuset")
			cmd := exec.Command("sleep", "60")
			must.NoError(t, cmd.Start())
			t.Cleanup(func() {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
			})
			must.NoError(t, g.Join(cmd.Process.Pid))
			pids, err := readPids(nomad)
			must.NoError(t, err)
			must.Eq(t, []int{cmd.Process.Pid}, pids)
			must.Eq(t, tc.want, cpusAllowed(t, cmd.Process.Pid))
			must.NoError(t, g.Kill())
			must.NoError(t, g.Destroy())
			must.DirExists(t, nomad)
		})
	}
}

// Join(0) moves the calling process: a helper process loads the group from
// its JSON state and joins itself.
func TestHost_JoinSelf(t *testing.T) {
	g := hostGroup(t, Limits{})
	st, err := json.Marshal(g.State())
	must.NoError(t, err)
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), joinSelfEnv+"="+string(st))
	out, err := cmd.CombinedOutput()
	must.NoError(t, err, must.Sprintf("%s", out))
	h, err := hostHierarchy()
	must.NoError(t, err)
	for _, dir := range g.dirs() {
		rel := strings.TrimPrefix(dir, h.root)
		if h.version == 1 {
			// "/memory/p/task" is listed as "memory:/p/task".
			ctrl, path, _ := strings.Cut(strings.TrimPrefix(rel, "/"), "/")
			rel = ctrl + ":/" + path
		}
		must.StrContains(t, string(out), rel)
	}
}

// Create on an existing group sets the new limits in any order, which on v1
// takes memsw and the memory limit in the right order.
func TestHost_Recreate(t *testing.T) {
	h := needHost(t)
	needLimits(t)
	parent := uniqueParent()
	t.Cleanup(func() { removeParent(t, h, parent) })
	var g *Group
	for _, mem := range []int64{64 << 20, 32 << 20, 128 << 20, 0} {
		var err error
		g, err = Create(parent, "task", Limits{MemoryBytes: mem, MemoryReservationBytes: mem / 2})
		must.NoError(t, err, must.Sprintf("memory %d", mem))
		file := filepath.Join(g.paths["memory"], "memory.limit_in_bytes")
		want := fmt.Sprint(mem)
		if h.version == 2 {
			file = filepath.Join(g.paths[unifiedKey], "memory.max")
		}
		got, err := readString(file)
		must.NoError(t, err)
		if mem == 0 {
			must.True(t, got == "max" || len(got) > 15, must.Sprintf("unlimited reads %s", got))
			continue
		}
		must.Eq(t, want, got)
	}
	must.NoError(t, g.Destroy())
}

// A limit the kernel refuses leaves nothing behind, not even the parent
// Create made.
func TestHost_CreateUndo(t *testing.T) {
	h := needHost(t)
	needLimits(t)
	parent := uniqueParent()
	t.Cleanup(func() { removeParent(t, h, parent) })
	_, err := Create(parent, "task", Limits{CPUQuota: 500}) // the kernel wants >= 1000
	must.ErrorContains(t, err, "500")
	dirs := []string{filepath.Join(h.root, parent)}
	if h.version == 1 {
		dirs = nil
		for _, c := range v1Controllers {
			dirs = append(dirs, filepath.Join(h.root, c, parent))
		}
	}
	gone(t, dirs...)
}

// The v2 kill and freeze paths need only the cgroup v2 core, so they run on
// a hybrid host too, in the controller-less unified mount.
func TestHost_V2Kill(t *testing.T) {
	h := needHost(t)
	var g *Group
	if h.version == 2 {
		g = hostGroup(t, Limits{})
	} else {
		unified := filepath.Join(h.root, "unified")
		if m, err := statfsMagic(unified); err != nil || m != unix.CGROUP2_SUPER_MAGIC {
			t.Skipf("no cgroup v2 mount at %s", unified)
		}
		dir := filepath.Join(unified, uniqueParent())
		must.NoError(t, os.Mkdir(dir, 0o755))
		t.Cleanup(func() { must.NoError(t, rmdir(dir)) })
		var err error
		g, err = Load(State{Version: 2, Paths: map[string]string{unifiedKey: dir}})
		must.NoError(t, err)
		t.Cleanup(func() { _ = g.Kill() })
	}
	for _, withKillFile := range []bool{true, false} {
		t.Run(fmt.Sprintf("cgroup.kill=%v", withKillFile), func(t *testing.T) {
			useCgroupKill = withKillFile
			t.Cleanup(func() { useCgroupKill = true })
			_, run := startIn(t, g, `f() { sleep 0.01; f & f & wait; }; f`)
			run()
			must.Wait(t, waitFor(func() bool {
				pids, err := g.Pids()
				return err == nil && len(pids) > 10
			}))
			must.NoError(t, g.Kill())
			pids, err := g.Pids()
			must.NoError(t, err)
			must.SliceEmpty(t, pids)
			// Thawed again.
			ev, err := readKeyed(filepath.Join(g.paths[unifiedKey], "cgroup.events"))
			must.NoError(t, err)
			must.Eq(t, 0, ev["frozen"])
		})
	}
}

// A CPU-bound task under a 10% quota shows CPU time, throttling and memory
// in Stats. It spins until Stats shows it throttled, however fast the
// host is.
func TestHost_StatsBusy(t *testing.T) {
	needLimits(t)
	g := hostGroup(t, Limits{CPUQuota: 10000, CPUPeriod: 100000, MemoryBytes: 256 << 20})
	_, run := startIn(t, g, `x=$(printf "%0100000d" 0); while :; do :; done`)
	run()
	var st *Stats
	must.Wait(t, wait.InitialSuccess(wait.ErrorFunc(func() error {
		var err error
		if st, err = g.Stats(); err != nil {
			return err
		}
		if st.ThrottledPeriods < 2 {
			return fmt.Errorf("throttled %d times so far", st.ThrottledPeriods)
		}
		return nil
	}), wait.Timeout(scaled(10*time.Second)), wait.Gap(50*time.Millisecond)))
	must.NoError(t, g.Kill())
	t.Logf("stats: %+v", *st)
	must.Positive(t, st.CPUTotalNanos)
	must.Positive(t, st.CPUUserNanos+st.CPUSystemNanos)
	must.Positive(t, st.ThrottledPeriods)
	must.Positive(t, st.ThrottledNanos)
	must.Eq(t, []string{"User Mode", "System Mode", "Throttled Periods", "Throttled Time"}, st.CPUMeasured)
	must.SliceContainsSubset(t, st.MemoryMeasured, []string{"RSS", "Cache", "Usage", "Max Usage"})
	must.Positive(t, st.MemoryMaxUsage)
}

// A thread that joins a v1 group alone forks children into it, in every
// hierarchy of the group (devices and Nomad's cpuset group too), leaves the
// rest of its process where it was, and goes back on leave; the group is
// then empty and can be removed.
func TestHost_JoinThread(t *testing.T) {
	h := needHost(t)
	if h.version != 1 {
		t.Skip("a thread joins alone only on cgroup v1")
	}
	cases := []struct {
		name string
		l    func(t *testing.T) Limits
		// blocked: the child cannot open a block device node.
		blocked bool
	}{
		{name: "plain", l: func(*testing.T) Limits { return Limits{} }},
		{name: "devices", l: func(*testing.T) Limits { return Limits{Devices: DefaultDevices} }, blocked: true},
		{name: "own cpuset", l: func(*testing.T) Limits { return Limits{CpusetCpus: "0"} }},
		{name: "nomad cpuset", l: func(t *testing.T) Limits {
			return Limits{CpusetCpus: "0", CpusetCgroupPath: nomadCpuset(t, h, false)}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l := tc.l(t)
			if l.Devices != nil {
				if _, err := h.v1Mount("devices"); err != nil {
					t.Skipf("no devices hierarchy: %v", err)
				}
			}
			if l.CpusetCpus != "" {
				if _, err := h.v1Mount("cpuset"); err != nil {
					t.Skipf("no cpuset hierarchy: %v", err)
				}
			}
			g := hostGroup(t, l)
			node := blockNode(t)
			before, err := os.ReadFile("/proc/self/cgroup")
			must.NoError(t, err)

			type result struct {
				child, probe, thread, after string
				err                         error
			}
			done := make(chan result, 1)
			go func() {
				// The thread is thrown away with the goroutine, whatever happens.
				runtime.LockOSThread()
				var r result
				defer func() { done <- r }()
				leave, err := g.JoinThread()
				if err != nil {
					r.err = err
					return
				}
				out, cerr := exec.Command("sh", "-c", "cat /proc/self/cgroup; grep Cpus_allowed_list /proc/self/status").Output()
				probe := exec.Command(os.Args[0])
				probe.Env = append(os.Environ(), devProbeEnv+"=open "+node)
				probe.Stdin = strings.NewReader("go\n")
				pout, perr := probe.Output()
				thread, terr := os.ReadFile("/proc/thread-self/cgroup")
				r.err = errors.Join(cerr, perr, terr, leave())
				after, aerr := os.ReadFile("/proc/thread-self/cgroup")
				r.child, r.probe, r.thread, r.after, r.err = string(out), string(pout), string(thread), string(after), errors.Join(r.err, aerr)
			}()
			r := <-done
			must.NoError(t, r.err)
			targets := maps.Clone(g.paths)
			if g.cpusetPath != "" {
				targets["cpuset"] = g.cpusetPath
			}
			for ctrl, dir := range targets {
				rel := ctrl + ":/" + strings.TrimPrefix(strings.TrimPrefix(dir, h.root), "/"+ctrl+"/")
				must.StrContains(t, r.child, rel)
				must.StrContains(t, r.thread, rel)
				must.StrNotContains(t, r.after, rel)
			}
			want := "ok"
			if tc.blocked {
				want = "EPERM"
			}
			must.Eq(t, "open "+node+": "+want+"\n", r.probe)
			if l.CpusetCpus != "" {
				must.StrContains(t, r.child, "Cpus_allowed_list:\t"+l.CpusetCpus+"\n")
			}
			now, err := os.ReadFile("/proc/self/cgroup")
			must.NoError(t, err)
			must.Eq(t, string(before), string(now), must.Sprint("the process's main thread moved"))
			must.Eq(t, before, []byte(r.after), must.Sprint("leave did not bring the thread back"))
			pids, err := g.Pids()
			must.NoError(t, err)
			must.SliceEmpty(t, pids)
			if g.cpusetPath != "" {
				pids, err := readPids(g.cpusetPath)
				must.NoError(t, err)
				must.SliceEmpty(t, pids)
			}
		})
	}
}

// On v2, a group under the driver's own parent gets every controller
// Nomad's tasks get that the host offers, cpuset and io too, so a task can
// be pinned to cores and given io limits under any parent.
func TestHost_V2Controllers(t *testing.T) {
	h := needHost(t)
	if h.version != 2 {
		t.Skip("the unified hierarchy is not /sys/fs/cgroup here")
	}
	needLimits(t)
	g := hostGroup(t, Limits{})
	offered, err := readFields(filepath.Join(h.root, "cgroup.controllers"))
	must.NoError(t, err)
	have, err := readFields(filepath.Join(g.UnifiedDir(), "cgroup.controllers"))
	must.NoError(t, err)
	for _, c := range append([]string{"cpu", "memory"}, v2Optional...) {
		if offered[c] {
			must.True(t, have[c], must.Sprintf("the group has no %s controller (it has %v; the host offers %v)", c, have, offered))
		}
	}
}

// On a real v1 hierarchy a group made ahead and claimed has the limits of
// a group Create makes, the spare's name is gone, a thread joins it, and
// RemoveAhead removes one a spare left. On v2 nothing is made ahead.
func TestHost_Ahead(t *testing.T) {
	h := needHost(t)
	parent := uniqueParent()
	if h.version != 1 {
		_, err := CreateAhead(parent, "spare-x", Limits{})
		must.ErrorContains(t, err, "cgroup v1 only")
		return
	}
	t.Cleanup(func() { removeParent(t, h, parent) })
	var devices []DeviceRule
	if _, err := h.v1Mount("devices"); err == nil {
		devices = DefaultDevices
	}
	a, err := CreateAhead(parent, "spare-x", Limits{Devices: devices, PidsMax: 50})
	must.NoError(t, err)
	t.Cleanup(func() { must.NoError(t, a.Destroy()) })
	spareDirs := a.Dirs()
	l := Limits{Devices: devices, PidsMax: 50, MemoryBytes: 64 << 20, MemoryReservationBytes: 32 << 20, CPUShares: 200, CPUQuota: 50000}
	g, err := a.Claim(parent, "task", l)
	must.NoError(t, err)
	t.Cleanup(func() { must.NoError(t, g.Destroy()) })
	want, err := Create(parent, "task2", l)
	must.NoError(t, err)
	t.Cleanup(func() { must.NoError(t, want.Destroy()) })
	for _, dir := range spareDirs {
		_, err := os.Stat(dir)
		must.True(t, os.IsNotExist(err), must.Sprintf("%s is left", dir))
	}
	files := []string{"memory/memory.limit_in_bytes", "memory/memory.soft_limit_in_bytes", "cpu/cpu.shares",
		"cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us", "pids/pids.max"}
	if devices != nil {
		files = append(files, "devices/devices.list")
	}
	for _, f := range files {
		ctrl, name, _ := strings.Cut(f, "/")
		must.Eq(t, filepath.Join(filepath.Dir(want.paths[ctrl]), "task"), g.paths[ctrl])
		got, err := os.ReadFile(filepath.Join(g.paths[ctrl], name))
		must.NoError(t, err)
		exp, err := os.ReadFile(filepath.Join(want.paths[ctrl], name))
		must.NoError(t, err)
		must.Eq(t, string(exp), string(got), must.Sprintf("%s", f))
	}

	joined := make(chan string, 1)
	go func() {
		runtime.LockOSThread()
		leave, err := g.JoinThread()
		if err != nil {
			joined <- err.Error()
			return
		}
		b, err := os.ReadFile("/proc/thread-self/cgroup")
		joined <- string(b) + fmt.Sprint(errors.Join(err, leave()))
	}()
	in := <-joined
	must.StrContains(t, in, ":pids:/"+parent+"/task\n")
	must.StrHasSuffix(t, "<nil>", in)

	b, err := CreateAhead(parent, "spare-y", Limits{Devices: devices})
	must.NoError(t, err)
	left := b.Dirs()
	must.NoError(t, RemoveAhead(parent, "spare-y"))
	for _, dir := range left {
		_, err := os.Stat(dir)
		must.True(t, os.IsNotExist(err), must.Sprintf("%s is left", dir))
	}
}

// On a real v1 hierarchy a group made ahead with one task's limits and
// claimed by another has the limits, swap cap and device list a group
// Create makes for the second has (see aheadPairs), and the claim goes
// through where Create does: the kernel checks each write against what the
// group has at that moment (memory.memsw.limit_in_bytes never below
// memory.limit_in_bytes; under a parent with a CPU quota, a child's quota
// over its period never above the parent's).
func TestHost_AheadFromAnyLimits(t *testing.T) {
	fromAnyLimitsOnHost(t, "groups are made ahead on cgroup v1 only", func(t *testing.T, parent string, i int, first, then Limits) (*Group, error) {
		a, err := CreateAhead(parent, fmt.Sprintf("spare-%d", i), first)
		must.NoError(t, err)
		t.Cleanup(func() { must.NoError(t, a.Destroy()) })
		return a.Claim(parent, fmt.Sprintf("task-%d", i), then)
	})
}

// Create on a group that is there already with other limits (a start tried
// again) leaves it with the limits a new group gets, and goes through where
// the new group's Create does: under a parent with a CPU quota the quota in
// place is lifted before the period is written, as Claim does.
func TestHost_CreateAgainFromAnyLimits(t *testing.T) {
	fromAnyLimitsOnHost(t, "cgroup v1: the CPU period and quota are one file (cpu.max) on v2", func(t *testing.T, parent string, i int, first, then Limits) (*Group, error) {
		name := fmt.Sprintf("again-%d", i)
		g, err := Create(parent, name, first)
		must.NoError(t, err)
		t.Cleanup(func() { must.NoError(t, g.Destroy()) })
		return Create(parent, name, then)
	})
}

// fromAnyLimitsOnHost runs fromAnyLimits on this host's v1 hierarchy (it
// skips elsewhere, saying why: notV1), under a parent without a CPU quota
// and under one with a quota of four CPUs, which each pair's limits keep
// to.
func fromAnyLimitsOnHost(t *testing.T, notV1 string, group func(t *testing.T, parent string, i int, first, then Limits) (*Group, error)) {
	h := needHost(t)
	needLimits(t)
	if h.version != 1 {
		t.Skip(notV1)
	}
	if _, err := h.v1Mount("devices"); err != nil {
		t.Skip("the pairs have device filters, and the devices hierarchy is not mounted here")
	}
	files := []string{"memory/memory.limit_in_bytes", "memory/memory.memsw.limit_in_bytes", "memory/memory.soft_limit_in_bytes",
		"cpu/cpu.shares", "cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us", "pids/pids.max", "devices/devices.list"}
	for _, parentQuota := range []int64{0, 400000} {
		t.Run(fmt.Sprintf("parent quota %d", parentQuota), func(t *testing.T) {
			parent := uniqueParent()
			t.Cleanup(func() { removeParent(t, h, parent) })
			if parentQuota > 0 {
				must.NoError(t, os.MkdirAll(filepath.Join(h.root, "cpu", parent), 0o755))
				must.NoError(t, writeFile(filepath.Join(h.root, "cpu", parent, "cpu.cfs_quota_us"), strconv.FormatInt(parentQuota, 10)))
			}
			fromAnyLimits(t, parent, files, func(i int, first, then Limits) (*Group, error) { return group(t, parent, i, first, then) })
		})
	}
}

// fromAnyLimits checks, for each of aheadPairs, that the group made by group
// (from the pair's first limits to its task's) has the files a new group
// Create makes with the task's limits has.
func fromAnyLimits(t *testing.T, parent string, files []string, group func(i int, first, then Limits) (*Group, error)) {
	for i, tc := range aheadPairs {
		t.Run(tc.name, func(t *testing.T) {
			g, err := group(i, tc.ahead, tc.task)
			must.NoError(t, err)
			t.Cleanup(func() { must.NoError(t, g.Destroy()) })
			want, err := Create(parent, fmt.Sprintf("made-%d", i), tc.task)
			must.NoError(t, err)
			t.Cleanup(func() { must.NoError(t, want.Destroy()) })
			for _, f := range files {
				ctrl, name, _ := strings.Cut(f, "/")
				exp, err := os.ReadFile(filepath.Join(want.paths[ctrl], name))
				if os.IsNotExist(err) && name == "memory.memsw.limit_in_bytes" {
					continue // no swap accounting on this kernel
				}
				must.NoError(t, err)
				got, err := os.ReadFile(filepath.Join(g.paths[ctrl], name))
				must.NoError(t, err)
				must.Eq(t, string(exp), string(got), must.Sprintf("%s", f))
			}
		})
	}
}
