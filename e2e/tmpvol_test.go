//go:build e2e

package e2e

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test"
	"github.com/shoenig/test/must"
)

// tmpvolScript prints the task's mounts at /tmp and /tmp/data as its own
// /proc/self/mountinfo says them ("MI <mount id> <parent id> <mount
// point> <fs type>"), checks that the fixture's fresh volume is what it
// sees at /tmp/data (empty), writes a file into the volume and one into
// its /tmp, and stays up for the host to look. A step that fails says so
// in its output and the script goes on, so that the test's checks, not a
// dead task, tell what went wrong.
const tmpvolScript = `exec 2>&1
awk '$5 == "/tmp" || $5 == "/tmp/data" { for (i = 7; $i != "-"; i++) {}; print "MI", $1, $2, $5, $(i+1) }' /proc/self/mountinfo
l=$(ls -A /tmp/data); echo "LS $? [$l]"
echo "$1" > /tmp/data/token
echo "$2" > /tmp/own
echo written
exec sleep 3600
`

// With tmp_size set, an isolated task's /tmp is a tmpfs, and a CSI volume
// whose destination is inside it (/tmp/data) is mounted on that tmpfs, not
// under it: the task sees the volume there and what it writes there lands
// on the volume, while what it writes elsewhere in /tmp stays in its
// tmpfs (neither on the volume nor in Nomad's task tmp/ on the disk).
func TestVolumeInsideTmpfsTmp(t *testing.T) {
	t.Parallel()
	a := volAgentWith(t, AgentOptions{AllowPrivileged: true, DriverConfig: `    tmp_size = "8MiB"`})
	fx := a.StartVolFixture(t, "tmpvol", VolFixtureOptions{})
	name := volUniq("tmpvol")
	token, own := "on-the-volume-"+name, "in-the-tmpfs-"+name
	// The task is not privileged (the workload job never is); it runs as
	// root to write the fixture's root-owned volume.
	w := a.RunVolJob(t, VolJob{Type: "service",
		Script: fmt.Sprintf("set -- %s %s\n%s", token, own, tmpvolScript),
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: "/tmp/data",
			Access: "single-node-writer", Create: true, CreateType: "dir"}}})
	al := a.WaitAlloc(t, w.ID, volTimeout, StatusRunning)
	out := a.WaitLogs(t, al.ID, "t", "written", volTimeout)
	t.Logf("the task said:\n%s", out)

	checkTmpvolTask(t, out)
	volID := fx.VolumeID(name)
	must.NotEq(t, "", volID, must.Sprintf("the fixture has no volume %s", name))
	checkTmpvolHost(t, token, filepath.Join(fx.StateDir, "volumes", volID), filepath.Join(a.DataDir, "alloc", al.ID, "t"))

	a.VolStopAndWait(t, w.ID, volTimeout)
}

// The same with Nomad's own CSI: Nomad stages and publishes the volume
// (a group volume block, volume_mount at /tmp/data) through the fixture
// run as its csi_plugin, and the driver gets the mount with the task's
// config, before the task starts, not late over its socket. It is still
// mounted on the task's tmpfs /tmp, not under it.
func TestNativeVolumeInsideTmpfsTmp(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	root, err := RepoRoot()
	must.NoError(t, err)
	must.NoError(t, CheckFixture(root))
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, DriverConfig: `    tmp_size = "8MiB"`})

	// Cleanups run last first: the workload stops and its claim is
	// released, the volume is deleted while the plugin still runs, then
	// the plugin stops, all before the agent's Close.
	const pluginID = "tmpvol-native"
	vars := a.NativePluginVars(pluginID, true, "")
	plug := a.RunJob(t, "native_plugin", vars)
	t.Cleanup(func() { a.stopJobs([]string{plug.ID}, time.Minute) })
	pal := a.WaitAlloc(t, plug.ID, time.Minute, StatusRunning)
	if _, err := a.WaitNativePlugin(pluginID, 1, 1, time.Minute); err != nil {
		t.Fatalf("%v\n%s", err, a.Allocation(t, pal.ID).Describe())
	}
	name := volUniq("tmpvol-native")
	must.NoError(t, a.CreateNativeVolume(name, pluginID, "single-node-writer", "dir"))
	t.Cleanup(func() {
		if _, err := a.WaitNativeVolumeReleased(name, time.Minute); err != nil {
			t.Errorf("%v", err)
		}
		if err := a.DeleteNativeVolume(name, time.Minute); err != nil {
			t.Errorf("%v", err)
		}
	})

	token, own := "on-the-volume-"+name, "in-the-tmpfs-"+name
	// The task is not privileged: isolated, its /tmp the tmpfs.
	w := a.RunJob(t, "native_workload", map[string]string{"Type": "service", "Count": "1", "Driver": DriverName,
		"VolumeID": name, "AccessMode": "single-node-writer", "Dest": "/tmp/data",
		"Script": fmt.Sprintf("set -- %s %s\n%s", token, own, tmpvolScript)})
	t.Cleanup(func() { a.stopJobs([]string{w.ID}, time.Minute) })
	al := a.WaitAlloc(t, w.ID, volTimeout, StatusRunning)
	out := a.WaitLogs(t, al.ID, "t", "written", volTimeout)
	t.Logf("the task said:\n%s", out)

	checkTmpvolTask(t, out)
	v, err := a.NativeVolume(name)
	must.NoError(t, err)
	must.NotEq(t, "", v.ExternalID, must.Sprintf("volume %s has no external id", name))
	checkTmpvolHost(t, token, filepath.Join(vars["StateDir"], "volumes", v.ExternalID), filepath.Join(a.DataDir, "alloc", al.ID, "t"))
}

// checkTmpvolTask checks what a task running tmpvolScript said: its /tmp
// is a tmpfs and its /tmp/data a mount on it (its parent is /tmp's
// mount), not one the tmpfs covers, and empty as the fixture made it.
func checkTmpvolTask(t *testing.T, out string) {
	t.Helper()
	mi := map[string][]string{}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 5 && f[0] == "MI" {
			mi[f[3]] = f[1:]
		}
	}
	tmp, data := mi["/tmp"], mi["/tmp/data"]
	must.NotNil(t, tmp, must.Sprintf("no mount at /tmp in the task:\n%s", out))
	must.NotNil(t, data, must.Sprintf("no mount at /tmp/data in the task:\n%s", out))
	test.Eq(t, "tmpfs", tmp[3], test.Sprint("the task's /tmp with tmp_size set"))
	test.NotEq(t, "tmpfs", data[3], test.Sprint("the task's /tmp/data is a tmpfs, not the volume"))
	test.Eq(t, tmp[0], data[1], test.Sprintf("/tmp/data is not mounted on the task's /tmp (mount %s), so the tmpfs hides it", tmp[0]))
	test.StrContains(t, out, "LS 0 []", test.Sprint("the task's /tmp/data is not the fresh volume"))
}

// checkTmpvolHost checks what a task running tmpvolScript left on the
// host: the token it wrote to /tmp/data is alone in the volume's backing
// directory, and the file it wrote to /tmp is not in Nomad's task tmp/
// under taskDir.
func checkTmpvolHost(t *testing.T, token, backing, taskDir string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(backing, "token"))
	must.NoError(t, err, must.Sprint("what the task wrote to /tmp/data is not on the volume"))
	must.Eq(t, token+"\n", string(b))
	entries, err := os.ReadDir(backing)
	must.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	must.Eq(t, []string{"token"}, names, must.Sprint("the volume holds more than the task wrote to /tmp/data"))
	_, err = os.Stat(taskDir)
	must.NoError(t, err, must.Sprint("Nomad's task directory"))
	hostTmp := filepath.Join(taskDir, "tmp", "own")
	_, err = os.Stat(hostTmp)
	must.True(t, errors.Is(err, os.ErrNotExist), must.Sprintf("the task's /tmp/own is on the disk at %s, not in its tmpfs: %v", hostTmp, err))
}
