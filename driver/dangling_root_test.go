package driver

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// A real supervisor and task left by a driver process that went without
// DestroyTask, on a root_dir a new driver process starts on: Nomad never
// recovers the task, and after the grace its processes, cgroups and state
// directory are gone.
func TestDangling_realTaskEnded_Root(t *testing.T) {
	requireRoot(t)
	parent := fmt.Sprintf("ncsi-dangling-%d", os.Getpid())
	root := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })
	h, d := harnessDriver(t, Config{RootDir: root, CgroupParent: parent, DanglingTasks: &DanglingTasks{Enabled: false}})
	cfg := realTask(t, "left", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "sleep 1000 & sleep 1000"}})
	cleanup := mkAllocDir(t, h, cfg, false)
	t.Cleanup(cleanup)
	startTask(t, h, cfg)
	must.NoError(t, h.WaitUntilStarted(cfg.ID, 10*time.Second))
	sup, task := supervisorOf(t, d, cfg.ID)
	conf := d.currentConfig()
	// The task's group in every hierarchy.
	groups, err := filepath.Glob(filepath.Join("/sys/fs/cgroup/*", parent, taskCgroupName(cfg)))
	must.NoError(t, err)
	must.SliceNotEmpty(t, groups)
	// The driver process goes; its task stays, as with a killed plugin.
	d.Shutdown()

	_, _ = harnessDriver(t, Config{RootDir: root, CgroupParent: parent, DanglingTasks: &DanglingTasks{Enabled: true, Grace: "1s", Period: "1s"}}, restartedAgent)
	eventually(t, 30*time.Second, func() error {
		switch {
		case alive(sup), alive(task):
			return fmt.Errorf("supervisor %d or task %d still alive", sup, task)
		case stateDirGone(conf, cfg.ID) != nil:
			return stateDirGone(conf, cfg.ID)
		}
		for _, g := range groups {
			if _, err := os.Stat(g); err == nil {
				return fmt.Errorf("cgroup %s still there", g)
			}
		}
		return nil
	})
}

// The same with a volume of the fixture plugin, a task of the driver that
// Nomad does recover: the dangling workload's volume is unpublished and
// unstaged by the real plugin, and nothing of it stays mounted.
func TestDangling_volumeTornDown_Root(t *testing.T) {
	requireRoot(t)
	parent := fmt.Sprintf("ncsi-danglingv-%d", os.Getpid())
	root := shortTempDir(t)
	work := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })
	base := Config{RootDir: root, CgroupParent: parent, AllowPrivileged: true, PrivilegedGrants: grantAll}
	cfg1 := base
	cfg1.DanglingTasks = &DanglingTasks{Enabled: false}
	h, d := harnessDriver(t, cfg1)

	fixture := buildFixture(t)
	state := shortTempDir(t)
	log := filepath.Join(state, "calls.log")
	plugin := realTask(t, "plugin", TaskConfig{
		Command:    fixture,
		Args:       []string{"--state-dir", state, "--node-id", "test-node", "--log-calls", log},
		Privileged: true,
		CSIPlugin:  &PluginTaskConfig{ID: "fixture", Type: "monolith", MountDir: "/csi"},
	})
	t.Cleanup(mkAllocDir(t, h, plugin, false))
	pluginHandle := startTask(t, h, plugin)
	healthy := func(d *Driver) func() error {
		return func() error {
			if st, ok := d.currentProber().Get("fixture"); !ok || !st.Healthy {
				return fmt.Errorf("plugin not healthy yet: %+v", st.HealthDescription)
			}
			return nil
		}
	}
	eventually(t, 15*time.Second, healthy(d))
	calls := func(method string) int {
		b, err := os.ReadFile(log)
		must.NoError(t, err)
		n := 0
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) > 0 && f[0] == method {
				n++
			}
		}
		return n
	}

	cfg := realTask(t, "left", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "sleep 1000 & sleep 1000"},
		Volumes: map[string]VolumeConfig{"data": {PluginID: "fixture", VolumeID: "vol-dangling", Destination: filepath.Join(work, "data"),
			AccessMode: "single-node-writer", Create: &VolumeCreateBlock{CapacityMin: "16MiB", Parameters: map[string]string{"type": "dir"}}}}})
	t.Cleanup(mkAllocDir(t, h, cfg, false))
	startTask(t, h, cfg)
	must.NoError(t, h.WaitUntilStarted(cfg.ID, 10*time.Second))
	sup, task := supervisorOf(t, d, cfg.ID)
	must.Eq(t, 1, calls("NodeStageVolume"))
	must.Eq(t, 1, calls("NodePublishVolume"))
	conf := d.currentConfig()
	d.Shutdown()

	cfg2 := base
	cfg2.DanglingTasks = &DanglingTasks{Enabled: true, Grace: "1s", Period: "1s"}
	h2, d2 := harnessDriver(t, cfg2, restartedAgent)
	// Nomad takes the plugin task back, never the workload.
	must.NoError(t, h2.RecoverTask(pluginHandle))
	t.Cleanup(func() {
		_ = h2.StopTask(plugin.ID, 5*time.Second, "SIGTERM")
		_ = h2.DestroyTask(plugin.ID, true)
	})
	eventually(t, 15*time.Second, healthy(d2))
	eventually(t, 30*time.Second, func() error {
		switch {
		case alive(sup), alive(task):
			return fmt.Errorf("supervisor %d or task %d still alive", sup, task)
		case stateDirGone(conf, cfg.ID) != nil:
			return stateDirGone(conf, cfg.ID)
		case calls("NodeUnpublishVolume") != 1, calls("NodeUnstageVolume") != 1:
			return fmt.Errorf("unpublish %d, unstage %d", calls("NodeUnpublishVolume"), calls("NodeUnstageVolume"))
		}
		// A call is logged as it begins: its unmount may still run.
		for _, dir := range []string{"publish", "staging"} {
			if left := mountsUnder(t, filepath.Join(root, "mnt", dir)); len(left) != 0 {
				return fmt.Errorf("still mounted: %v", left)
			}
		}
		m, err := d2.volumes()
		if err != nil {
			return err
		}
		if n := m.Users("fixture", "vol-dangling"); n != 0 {
			return fmt.Errorf("volume still has %d users", n)
		}
		return nil
	})
	// The plugin task Nomad recovered runs on.
	_, known := d2.tasks.Get(plugin.ID)
	must.True(t, known)
}

// restartedAgent has a driver run under another agent process than the
// test's first driver: the agent restarted with it.
func restartedAgent(d *Driver) { d.agent = "agent-after-restart" }
