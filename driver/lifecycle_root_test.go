package driver

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// nodeSnapshot is what a task's life leaves on the node and in the
// driver's process, for before/after comparisons.
type nodeSnapshot struct {
	files       []string // under root_dir, spares/ and journal/ aside
	journal     int64    // bytes under root_dir/journal
	groups      []string // cgroups under the parent, but the spares' groups
	hierarchies int
	// spareGroups are the groups spares make ahead, one per hierarchy
	// for each spare at most: the pool's, not a task's.
	spareGroups int
	spareNames  []string
	spareDirs   int // spares still preparing their root
	procs       int // supervisors and spares: processes of this test binary
	mounts      []string
	goroutines  int
	fds         int
}

func (s nodeSnapshot) String() string {
	return fmt.Sprintf("files=%d journal=%d groups=%v spare_groups=%d spares=%d procs=%d mounts=%v goroutines=%d fds=%d",
		len(s.files), s.journal, s.groups, s.spareGroups, s.spareDirs, s.procs, s.mounts, s.goroutines, s.fds)
}

func takeSnapshot(t *testing.T, root, parent string, alsoMounts ...string) nodeSnapshot {
	t.Helper()
	var s nodeSnapshot
	must.NoError(t, filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		switch {
		case rel == "spares":
			ents, err := os.ReadDir(p)
			if err != nil {
				return err
			}
			s.spareDirs = len(ents)
			return filepath.SkipDir
		case rel == "journal":
			return filepath.WalkDir(p, func(_ string, de fs.DirEntry, err error) error {
				if err != nil {
					return err
				}
				if !de.IsDir() {
					fi, err := de.Info()
					if err != nil {
						return err
					}
					s.journal += fi.Size()
				}
				return nil
			})
		}
		if rel != "." && !strings.HasPrefix(rel, "journal") {
			s.files = append(s.files, rel)
		}
		if de.IsDir() && rel == "journal" {
			return filepath.SkipDir
		}
		return nil
	}))
	dirs, err := filepath.Glob("/sys/fs/cgroup/*/" + parent)
	must.NoError(t, err)
	s.hierarchies = len(dirs)
	for _, dir := range dirs {
		must.NoError(t, filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if !de.IsDir() || p == dir {
				return nil
			}
			rel, _ := filepath.Rel(filepath.Dir(dir), p)
			if strings.HasPrefix(de.Name(), wire.SpareGroupPrefix) {
				s.spareGroups++
				procs, _ := os.ReadFile(filepath.Join(p, "cgroup.procs"))
				s.spareNames = append(s.spareNames, p+" procs="+strings.Join(strings.Fields(string(procs)), ","))
				return filepath.SkipDir
			}
			s.groups = append(s.groups, rel)
			return nil
		}))
	}
	slices.Sort(s.groups)
	self, err := os.Readlink("/proc/self/exe")
	must.NoError(t, err)
	ents, err := os.ReadDir("/proc")
	must.NoError(t, err)
	for _, e := range ents {
		if e.Name() == fmt.Sprint(os.Getpid()) {
			continue
		}
		if exe, err := os.Readlink("/proc/" + e.Name() + "/exe"); err == nil && exe == self {
			s.procs++
		}
	}
	for _, dir := range append([]string{root}, alsoMounts...) {
		s.mounts = append(s.mounts, mountsUnder(t, dir)...)
	}
	s.goroutines = runtime.NumGoroutine()
	fds, err := os.ReadDir("/proc/self/fd")
	must.NoError(t, err)
	s.fds = len(fds)
	return s
}

// sameNode compares what must come back to exactly what it was.
func sameNode(before, after nodeSnapshot) error {
	switch {
	case !slices.Equal(before.files, after.files):
		return fmt.Errorf("root_dir files: gone %v, new %v", minus(before.files, after.files), minus(after.files, before.files))
	case !slices.Equal(before.groups, after.groups):
		return fmt.Errorf("cgroups: gone %v, new %v", minus(before.groups, after.groups), minus(after.groups, before.groups))
	// The waiting spare's group (one per hierarchy) is the pool's; more
	// would be groups left behind.
	case after.spareGroups > max(before.spareGroups, after.hierarchies*max(1, before.spareDirs, after.spareDirs)):
		return fmt.Errorf("spare groups: before %d, after %d for %d spares: %v", before.spareGroups, after.spareGroups, after.spareDirs, after.spareNames)
	case after.spareDirs > max(1, before.spareDirs):
		return fmt.Errorf("spare dirs: before %d, after %d", before.spareDirs, after.spareDirs)
	case before.procs != after.procs:
		return fmt.Errorf("supervisor processes: before %d, after %d", before.procs, after.procs)
	case !slices.Equal(before.mounts, after.mounts):
		return fmt.Errorf("mounts: before %v, after %v", before.mounts, after.mounts)
	case after.goroutines > before.goroutines+2:
		return fmt.Errorf("goroutines: before %d, after %d", before.goroutines, after.goroutines)
	case after.fds > before.fds+2:
		return fmt.Errorf("fds: before %d, after %d", before.fds, after.fds)
	}
	return nil
}

// minus is what a holds that b does not, as many times as it holds more.
func minus(a, b []string) []string {
	left := map[string]int{}
	for _, x := range b {
		left[x]++
	}
	var out []string
	for _, x := range a {
		if left[x] > 0 {
			left[x]--
			continue
		}
		out = append(out, x)
	}
	return out
}

// crashLoop runs the task cfg n times as Nomad's restart with delay 0 does:
// start, the task fails, its handle is destroyed (force, as the task
// runner's clearDriverHandle), and again; fresh gives each run a new ID
// (Nomad's invocation ID), otherwise every run reuses cfg.ID.
func crashLoop(t *testing.T, h *driverHarness, cfg *drivers.TaskConfig, n int, fresh bool) {
	t.Helper()
	base := cfg.ID
	for i := 0; i < n; i++ {
		if fresh {
			cfg.ID = fmt.Sprintf("%s-%d", base, i)
		}
		_, _, err := h.StartTask(cfg)
		must.NoError(t, err, must.Sprintf("start %d", i))
		res := waitExit(t, h, cfg.ID, 20*time.Second)
		must.Eq(t, 7, res.ExitCode, must.Sprintf("run %d", i))
		must.NoError(t, h.DestroyTask(cfg.ID, true), must.Sprintf("destroy %d", i))
	}
}

func TestDriver_crashLoopLeavesNothing_Root(t *testing.T) {
	requireRoot(t)
	const n = 20
	parent := fmt.Sprintf("ncsi-life-lc-%d", os.Getpid())
	root := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })
	h, d := harnessDriver(t, Config{RootDir: root, CgroupParent: parent})

	for _, fresh := range []bool{false, true} {
		t.Run(fmt.Sprintf("freshID=%v", fresh), func(t *testing.T) {
			cfg := realTask(t, "crash", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "exit 7"}})
			cleanup := mkAllocDir(t, h, cfg, true)
			defer cleanup()
			// One run first: spares, the journal and the driver's
			// long-lived goroutines are there before the count.
			crashLoop(t, h, cfg, 1, fresh)
			before := snapshotWithSpare(t, d, root, parent, cfg.AllocDir)
			crashLoop(t, h, cfg, n, fresh)
			after := snapshotLike(t, before, root, parent, cfg.AllocDir)
			t.Logf("before: %v", before)
			t.Logf("after %d runs: %v", n, after)
		})
	}
}

// snapshotWithSpare is the node's snapshot once a spare supervisor waits
// for a task in d's pool (the driver fills one after a task starts), so
// that a spare coming later is not counted as a leak. The pool is asked,
// not root_dir/spares: a spare's directory is there only while it
// prepares its root (it removes it once it has pivoted), and a spare that
// was ready before the snapshot has none.
func snapshotWithSpare(t *testing.T, d *Driver, root, parent string, alsoMounts ...string) nodeSnapshot {
	t.Helper()
	d.mu.Lock()
	shim := d.shim
	d.mu.Unlock()
	eventually(t, 20*time.Second, func() error {
		if !d.spares.Waiting(shim) {
			return errors.New("no spare supervisor waiting yet")
		}
		return nil
	})
	return takeSnapshot(t, root, parent, alsoMounts...)
}

// snapshotLike is the node's snapshot once it is the same as before (what
// a stop leaves takes a moment to go), or the test fails saying how it
// differs.
func snapshotLike(t *testing.T, before nodeSnapshot, root, parent string, alsoMounts ...string) nodeSnapshot {
	t.Helper()
	var s nodeSnapshot
	eventually(t, 30*time.Second, func() error {
		s = takeSnapshot(t, root, parent, alsoMounts...)
		return sameNode(before, s)
	})
	return s
}

// fixtureNode is the fixture plugin served as a task of h's driver, with
// its call log.
func fixtureNode(t *testing.T, h *driverHarness, d *Driver, extra ...string) (calls func(method string) int, state string) {
	t.Helper()
	fixture := buildFixture(t)
	state = shortTempDir(t)
	log := filepath.Join(state, "calls.log")
	plugin := realTask(t, "plugin", TaskConfig{
		Command:    fixture,
		Args:       append([]string{"--state-dir", state, "--node-id", "test-node", "--log-calls", log}, extra...),
		Privileged: true,
		CSIPlugin:  &PluginTaskConfig{ID: "fixture", Type: "monolith", MountDir: "/csi"},
	})
	cleanup := mkAllocDir(t, h, plugin, true)
	startTask(t, h, plugin)
	t.Cleanup(func() {
		_ = h.StopTask(plugin.ID, 5*time.Second, "SIGTERM")
		_ = h.DestroyTask(plugin.ID, true)
		cleanup()
	})
	eventually(t, 15*time.Second, func() error {
		st, ok := d.currentProber().Get("fixture")
		if !ok || !st.Healthy {
			return fmt.Errorf("plugin not healthy yet: %+v", st.HealthDescription)
		}
		return nil
	})
	return func(method string) int {
		b, err := os.ReadFile(log)
		if err != nil && !os.IsNotExist(err) {
			t.Fatalf("read call log: %v", err)
		}
		n := 0
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) > 0 && f[0] == method {
				n++
			}
		}
		return n
	}, state
}

func TestDriver_crashLoopWithVolumeLeavesNothing_Root(t *testing.T) {
	requireRoot(t)
	const n = 20
	parent := fmt.Sprintf("ncsi-life-lcv-%d", os.Getpid())
	root := shortTempDir(t)
	work := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })
	h, d := harnessDriver(t, Config{RootDir: root, CgroupParent: parent, AllowPrivileged: true, PrivilegedGrants: grantAll})
	calls, _ := fixtureNode(t, h, d)

	vol := func(id string, create bool) map[string]VolumeConfig {
		v := VolumeConfig{PluginID: "fixture", VolumeID: id, Destination: filepath.Join(work, "data"), AccessMode: "single-node-writer"}
		if create {
			v.Create = &VolumeCreateBlock{CapacityMin: "16MiB", Parameters: map[string]string{"type": "dir"}}
		}
		return map[string]VolumeConfig{"data": v}
	}
	for _, fresh := range []bool{false, true} {
		t.Run(fmt.Sprintf("freshID=%v", fresh), func(t *testing.T) {
			cfg := realTask(t, "crash", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "exit 7"}, Volumes: vol("vol-crash", true)})
			cleanup := mkAllocDir(t, h, cfg, true)
			defer cleanup()
			crashLoop(t, h, cfg, 1, fresh)
			before := snapshotWithSpare(t, d, root, parent, cfg.AllocDir)
			stages, unstages := calls("NodeStageVolume"), calls("NodeUnstageVolume")
			crashLoop(t, h, cfg, n, fresh)
			after := snapshotLike(t, before, root, parent, cfg.AllocDir)
			m, err := d.volumes()
			must.NoError(t, err)
			must.SliceEmpty(t, m.TasksWithPrefix(cfg.AllocID))
			must.Eq(t, 0, m.Users("fixture", "vol-crash"))
			// Each run stages and unstages: no stage is left over.
			must.Eq(t, calls("NodeStageVolume")-stages, calls("NodeUnstageVolume")-unstages)
			t.Logf("before: %v", before)
			t.Logf("after %d runs: %v", n, after)
		})
	}

	// A start that fails mid-way, in the plugin: NodeStage of a volume the
	// plugin does not have.
	t.Run("failingStart", func(t *testing.T) {
		cfg := realTask(t, "crash", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "exit 7"}, Volumes: vol("no-such-volume", false)})
		cleanup := mkAllocDir(t, h, cfg, true)
		defer cleanup()
		_, _, err := h.StartTask(cfg)
		must.Error(t, err)
		before := snapshotWithSpare(t, d, root, parent, cfg.AllocDir)
		for i := 0; i < n; i++ {
			_, _, err := h.StartTask(cfg)
			must.Error(t, err, must.Sprintf("start %d", i))
			// Nomad's task runner destroys what it has no handle of.
			_ = h.DestroyTask(cfg.ID, true)
		}
		after := snapshotLike(t, before, root, parent, cfg.AllocDir)
		m, err := d.volumes()
		must.NoError(t, err)
		must.SliceEmpty(t, m.TasksWithPrefix(cfg.AllocID))
		t.Logf("before: %v", before)
		t.Logf("after %d failed starts: %v", n, after)
	})
}

// supervisorOf reads the task's supervisor and task PIDs from its handle.
func supervisorOf(t *testing.T, d *Driver, id string) (sup, task int) {
	t.Helper()
	h, ok := d.tasks.Get(id)
	must.True(t, ok)
	st := h.process.State()
	return st.SupervisorPID, st.TaskPID
}

func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// A zombie is dead.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	return len(f) > 0 && f[0] != "Z"
}

// A supervisor killed under its running task (the OOM killer, an
// operator's kill -9): WaitTask ends, the task's process tree goes with
// DestroyTask, and the volume is torn down.
func TestDriver_supervisorKilledLeavesNothing_Root(t *testing.T) {
	requireRoot(t)
	parent := fmt.Sprintf("ncsi-life-lck-%d", os.Getpid())
	root := shortTempDir(t)
	work := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })
	h, d := harnessDriver(t, Config{RootDir: root, CgroupParent: parent, AllowPrivileged: true, PrivilegedGrants: grantAll})
	calls, _ := fixtureNode(t, h, d)

	for _, withVolume := range []bool{false, true} {
		t.Run(fmt.Sprintf("volume=%v", withVolume), func(t *testing.T) {
			tc := TaskConfig{Command: "/bin/sh", Args: []string{"-c", "sleep 1000 & sleep 1000"}}
			if withVolume {
				tc.Volumes = map[string]VolumeConfig{"data": {PluginID: "fixture", VolumeID: "vol-kill", Destination: filepath.Join(work, "data"),
					AccessMode: "single-node-writer", Create: &VolumeCreateBlock{CapacityMin: "16MiB", Parameters: map[string]string{"type": "dir"}}}}
			}
			// A run first, for the spares, the journal and the plugin's
			// connection.
			warm := realTask(t, "warm", TaskConfig{Command: "/bin/true", Volumes: tc.Volumes})
			cleanupWarm := mkAllocDir(t, h, warm, false)
			defer cleanupWarm()
			startTask(t, h, warm)
			waitExit(t, h, warm.ID, 20*time.Second)
			must.NoError(t, h.DestroyTask(warm.ID, true))
			before := snapshotWithSpare(t, d, root, parent)
			stages, unstages := calls("NodeStageVolume"), calls("NodeUnstageVolume")

			// Three times: what a kill leaves behind grows.
			for i := 0; i < 3; i++ {
				cfg := realTask(t, "victim", tc)
				cleanup := mkAllocDir(t, h, cfg, true)
				t.Cleanup(cleanup)
				startTask(t, h, cfg)
				must.NoError(t, h.WaitUntilStarted(cfg.ID, 10*time.Second))
				sup, task := supervisorOf(t, d, cfg.ID)
				must.True(t, alive(sup))
				must.True(t, alive(task))
				must.NoError(t, syscallKill(sup))
				res := waitExit(t, h, cfg.ID, 20*time.Second)
				t.Logf("exit after the supervisor's kill: %+v", res)
				must.True(t, res.ExitCode != 0 || res.Signal != 0 || res.Err != nil, must.Sprint("a task whose supervisor died is no success"))
				must.NoError(t, h.DestroyTask(cfg.ID, true))
				must.False(t, alive(task), must.Sprint("task process outlived DestroyTask"))
				// The harness's log readers are the test's, not the driver's.
				cleanup()
			}
			after := snapshotLike(t, before, root, parent)
			must.Eq(t, calls("NodeStageVolume")-stages, calls("NodeUnstageVolume")-unstages)
			t.Logf("before: %v", before)
			t.Logf("after: %v", after)
		})
	}
}

func syscallKill(pid int) error { return unix.Kill(pid, unix.SIGKILL) }

// Twenty tasks naming one volume, started at once and destroyed in random
// order: one NodeStage, one NodeUnstage after the last, a publish and an
// unpublish per task.
func TestDriver_manyTasksOneVolume_Root(t *testing.T) {
	requireRoot(t)
	const n = 20
	parent := fmt.Sprintf("ncsi-life-lcm-%d", os.Getpid())
	root := shortTempDir(t)
	work := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })
	h, d := harnessDriver(t, Config{RootDir: root, CgroupParent: parent, AllowPrivileged: true, PrivilegedGrants: grantAll})
	calls, _ := fixtureNode(t, h, d)
	// Made once, so that every task after names an existing volume.
	mk := realTask(t, "mk", TaskConfig{Command: "/bin/true", Volumes: map[string]VolumeConfig{"data": {PluginID: "fixture", VolumeID: "vol-many",
		Destination: filepath.Join(work, "data"), AccessMode: "multi-node-multi-writer", Create: &VolumeCreateBlock{CapacityMin: "16MiB", Parameters: map[string]string{"type": "dir"}}}}})
	cleanupMk := mkAllocDir(t, h, mk, false)
	defer cleanupMk()
	startTask(t, h, mk)
	waitExit(t, h, mk.ID, 20*time.Second)
	must.NoError(t, h.DestroyTask(mk.ID, true))
	before := snapshotWithSpare(t, d, root, parent)
	count := func() map[string]int {
		m := map[string]int{}
		for _, k := range []string{"NodeStageVolume", "NodeUnstageVolume", "NodePublishVolume", "NodeUnpublishVolume"} {
			m[k] = calls(k)
		}
		return m
	}
	c0 := count()

	cfgs := make([]*drivers.TaskConfig, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range cfgs {
		cfgs[i] = realTask(t, "many", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "sleep 1000"}, Volumes: map[string]VolumeConfig{"data": {
			PluginID: "fixture", VolumeID: "vol-many", Destination: filepath.Join(work, "data"), AccessMode: "multi-node-multi-writer"}}})
		defer mkAllocDir(t, h, cfgs[i], false)()
		t.Cleanup(func() { _ = d.DestroyTask(cfgs[i].ID, true) })
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, errs[i] = h.StartTask(cfgs[i])
		}()
	}
	wg.Wait()
	for i, err := range errs {
		must.NoError(t, err, must.Sprintf("task %d", i))
	}
	mid := count()
	must.Eq(t, 1, mid["NodeStageVolume"]-c0["NodeStageVolume"])
	must.Eq(t, n, mid["NodePublishVolume"]-c0["NodePublishVolume"])
	m, err := d.volumes()
	must.NoError(t, err)
	must.Eq(t, n, len(m.TasksWithPrefix("")))

	order := rand.Perm(n)
	for k, i := range order {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = h.StopTask(cfgs[i].ID, 5*time.Second, "SIGKILL")
			if errs[i] == nil {
				if k%2 == 0 {
					errs[i] = h.DestroyTask(cfgs[i].ID, true)
				} else {
					waitExit(t, h, cfgs[i].ID, 20*time.Second)
					errs[i] = h.DestroyTask(cfgs[i].ID, false)
				}
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		must.NoError(t, err, must.Sprintf("task %d", i))
	}
	snapshotLike(t, before, root, parent)
	end := count()
	must.Eq(t, 1, end["NodeUnstageVolume"]-c0["NodeUnstageVolume"])
	must.Eq(t, n, end["NodeUnpublishVolume"]-c0["NodeUnpublishVolume"])
	must.Eq(t, 1, end["NodeStageVolume"]-c0["NodeStageVolume"])
	must.SliceEmpty(t, m.TasksWithPrefix(""))
	t.Logf("calls: %v", func() map[string]int {
		for k := range end {
			end[k] -= c0[k]
		}
		return end
	}())
}
