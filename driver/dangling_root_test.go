package driver

import (
	"fmt"
	"os"
	"path/filepath"
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

	_, _ = harnessDriver(t, Config{RootDir: root, CgroupParent: parent, DanglingTasks: &DanglingTasks{Enabled: true, Grace: "1s", Period: "1s"}})
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
