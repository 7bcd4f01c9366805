//go:build e2e

package e2e

// The Upgrading section of docs/install.md, tested: the driver binary is replaced by
// a build stamped with another version (and carrying another supervisor
// shim, as a real upgrade does) while the client is stopped, and the
// client starts again on it.

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// upgradeVersion is the version the replacement driver is stamped with.
const upgradeVersion = "99.0.0-upgrade.e2e"

// TestDriverUpgrade: a volume task and its plugin keep their processes,
// the volume stays mounted (no CSI call repeated, no mount replaced), the
// node shows the new version, alloc exec reaches the task through the new
// driver, and stopping the task afterwards tears everything down.
func TestDriverUpgrade(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	csiBin(t, "csi-fixture")
	root, err := RepoRoot()
	must.NoError(t, err)

	// The plugin_dir of this test alone, holding the build under test.
	work := t.TempDir()
	pluginDir := filepath.Join(work, "plugins")
	must.NoError(t, os.Mkdir(pluginDir, 0o755))
	driverPath := filepath.Join(pluginDir, "nomad-driver-csi")
	must.NoError(t, copyFile(filepath.Join(PluginDir(root), "nomad-driver-csi"), driverPath, 0o755))
	newDriver := filepath.Join(work, "nomad-driver-csi.new")
	buildUpgradeDriver(t, root, work, newDriver)

	var a *Agent
	t.Cleanup(func() {
		if a != nil {
			if devs := VolLoopsUnder(a.Dir); len(devs) > 0 {
				t.Errorf("loop devices still attached to volumes of %s: %v", a.Dir, devs)
				_ = VolDetachLoops(a.Dir)
			}
		}
	})
	a = StartAgent(t, AgentOptions{AllowPrivileged: true, Persistent: true, PluginDir: pluginDir})
	t.Cleanup(func() { volFinalCheck(t, a) })
	oldVersion := driverVersion(t, a)
	must.NotEq(t, upgradeVersion, oldVersion)

	fx := a.StartVolFixture(t, "fixture", VolFixtureOptions{})
	name := volUniq("upgrade")
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{Type: "service",
		Script:  fmt.Sprintf("echo before > %s/f && %s", dest, volSleeper),
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Create: true, CreateType: "ext4"}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "started", volTimeout)
	taskPID := upgradeTaskPID(t, al.ID)
	supervisor, err := ReadProc(taskPID)
	must.NoError(t, err)
	shimBefore, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", supervisor.PPID))
	must.NoError(t, err)
	startedAt := a.WaitAllocID(t, al.ID, volTimeout, StatusRunning).Task("t").StartedAt
	pluginPID := fx.PID()
	must.Positive(t, pluginPID)
	callsBefore := fx.Calls()
	mountsBefore := volMountIDs(t, filepath.Join(a.DriverRoot, "mnt"))
	must.MapNotEmpty(t, mountsBefore)
	must.True(t, taskHasMount(t, taskPID, dest), must.Sprintf("%s is not mounted in the task before the upgrade", dest))
	t.Logf("before: driver %s, task pid %d, supervisor pid %d running %s", oldVersion, taskPID, supervisor.PPID, shimBefore)

	// The upgrade, as an operator makes it: stop the client, put the new
	// binary in place under the same name (a rename, so that no half
	// written file is ever there), start the client.
	must.NoError(t, a.Stop(30*time.Second))
	must.NoError(t, os.Rename(newDriver, driverPath))
	must.NoError(t, a.startProc(a.client))
	must.NoError(t, a.waitReady(90*time.Second))
	a.WaitVolPluginHealthy(t, fx.ID, volTimeout)

	// The node shows the new build.
	deadline := time.Now().Add(30 * time.Second)
	version := driverVersion(t, a)
	for version != upgradeVersion && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
		version = driverVersion(t, a)
	}
	must.Eq(t, upgradeVersion, version, must.Sprint("driver.csi.version after the upgrade"))

	// The task and its plugin are the same processes, never restarted.
	ts := a.WaitAllocID(t, al.ID, volTimeout, StatusRunning).Task("t")
	must.Eq(t, "running", ts.State)
	must.Eq(t, uint64(0), ts.Restarts)
	must.True(t, ts.StartedAt.Equal(startedAt), must.Sprintf("task restarted: started %v, then %v", startedAt, ts.StartedAt))
	must.Eq(t, taskPID, upgradeTaskPID(t, al.ID), must.Sprint("the task's process changed across the upgrade"))
	must.Eq(t, pluginPID, fx.PID(), must.Sprint("the plugin's process changed across the upgrade"))
	// Its supervisor runs on from the old shim, which the new driver
	// replaced with its own: the file is gone, the process keeps it.
	shimAfter, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", supervisor.PPID))
	must.NoError(t, err, must.Sprintf("the task's supervisor %d is gone", supervisor.PPID))
	must.Eq(t, shimBefore+" (deleted)", shimAfter)

	// The volume is still mounted, in the task and under the stage root,
	// by the same mounts: no CSI call was made again.
	must.True(t, taskHasMount(t, taskPID, dest), must.Sprintf("%s is not mounted in the task after the upgrade", dest))
	must.Eq(t, mountsBefore, volMountIDs(t, filepath.Join(a.DriverRoot, "mnt")), must.Sprint("mounts under the stage root changed"))
	for _, m := range []string{"CreateVolume", "NodeStageVolume", "NodePublishVolume", "NodeUnpublishVolume", "NodeUnstageVolume"} {
		before := 0
		for _, c := range callsBefore {
			if strings.HasPrefix(c, m+" ") {
				before++
			}
		}
		must.Eq(t, before, fx.Count(m, ""), must.Sprintf("%s calls before and after the upgrade", m))
	}
	// The new driver reaches the old task: alloc exec reads and writes
	// the volume.
	must.Eq(t, "before\nafter\n", volExec(t, a, al.ID, "echo after >> "+dest+"/f && cat "+dest+"/f"))

	// Stopping it tears everything down through the new driver, which
	// reads the exit status the old supervisor recorded (E2E_PLUGIN_DIR
	// naming an older build tests that format).
	paths := a.VolJournalPaths(fx.VolumeID(name))
	a.VolStopAndWait(t, job.ID, volTimeout)
	for _, e := range a.Allocation(t, al.ID).Events("t") {
		if e.Type == "Terminated" {
			t.Logf("the task ended: %s", e.Text())
			must.NotEq(t, "-1", e.Details["exit_code"], must.Sprintf("the new driver lost the old supervisor's exit status: %s", e.Text()))
		}
	}
	volWaitCount(t, fx, "NodeUnstageVolume", fx.VolumeID(name), 1, 30*time.Second)
	must.SliceEmpty(t, a.WaitVolMountsGone(10*time.Second), must.Sprint("mounted after the task stopped"))
	must.SliceEmpty(t, VolMountedAmong(paths))
	// Exited is enough: after the upgrade the old supervisor's parent is
	// whichever process reaps orphans on this host, and it reaps when it
	// likes, so an exited supervisor can still be a zombie here.
	for _, p := range []struct {
		what string
		pid  int
	}{{"task process", taskPID}, {"supervisor", supervisor.PPID}} {
		st := procState(p.pid)
		must.True(t, st == "?" || st == "Z", must.Sprintf("%s %d still running after the stop (state %s)", p.what, p.pid, st))
	}
	t.Logf("upgraded %s -> %s; calls after the upgrade: %v", oldVersion, version, fx.Calls()[len(callsBefore):])
}

// buildUpgradeDriver builds the driver as make dev does, stamped with
// upgradeVersion and embedding a shim that differs from make dev's (not
// stripped), as a new release's would.
func buildUpgradeDriver(t *testing.T, root, work, out string) {
	t.Helper()
	shim := filepath.Join(work, "shim")
	cmd := exec.Command("go", "build", "-trimpath", "-o", shim, "./driver/executor/shim")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	b, err := cmd.CombinedOutput()
	must.NoError(t, err, must.Sprintf("building the shim: %s", b))
	devShim, err := os.ReadFile(filepath.Join(root, "driver", "shimbin", "nomad-driver-csi-shim"))
	must.NoError(t, err, must.Sprint("make dev's shim"))
	newShim, err := os.ReadFile(shim)
	must.NoError(t, err)
	must.False(t, bytes.Equal(devShim, newShim), must.Sprint("the upgrade's shim is make dev's"))

	overlay := filepath.Join(work, "overlay.json")
	must.NoError(t, os.WriteFile(overlay, fmt.Appendf(nil, `{"Replace":{%q:%q}}`,
		filepath.Join(root, "driver", "shimbin", "nomad-driver-csi-shim"), shim), 0o644))
	cmd = exec.Command("go", "build", "-overlay", overlay,
		"-ldflags", "-X github.com/nomad-driver-csi/nomad-driver-csi/driver.Version="+upgradeVersion, "-o", out, ".")
	cmd.Dir = root
	b, err = cmd.CombinedOutput()
	must.NoError(t, err, must.Sprintf("building the upgrade: %s", b))
}

// driverVersion is the node's driver.csi.version.
func driverVersion(t *testing.T, a *Agent) string {
	t.Helper()
	n := a.Node(t)
	if d := n.Drivers[DriverName]; d != nil && d.Attributes["driver.csi.version"] != "" {
		return d.Attributes["driver.csi.version"]
	}
	return n.Attributes["driver.csi.version"]
}

// upgradeTaskPID is the host PID of the task's sleep (the script execs it).
func upgradeTaskPID(t *testing.T, allocID string) int {
	t.Helper()
	var found []int
	for _, pid := range TaskPIDs(allocID, "t") {
		if p, err := ReadProc(pid); err == nil && p.Comm == "sleep" {
			found = append(found, pid)
		}
	}
	must.SliceLen(t, 1, found, must.Sprintf("want one sleep process in allocation %s, got %v", allocID, found))
	return found[0]
}

// taskHasMount tells whether path is a mount point in pid's mount
// namespace.
func taskHasMount(t *testing.T, pid int, path string) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	must.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == path {
			return true
		}
	}
	return false
}

func copyFile(src, dst string, mode os.FileMode) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, mode)
}
