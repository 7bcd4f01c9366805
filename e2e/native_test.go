//go:build e2e

package e2e

// Nomad's own CSI support with a plugin run by the csi driver: the plugin
// job has a task-level csi_plugin block, volumes are made with
// "nomad volume create" and claimed by group volume blocks, and Nomad's
// client stages and publishes them by calling the plugin, which the csi
// driver runs privileged, seeing the host's file system.
//
// One agent (allow_privileged, csi and exec drivers) serves every case, in
// order: the plugin comes up healthy; the example files validate; a csi
// workload writes to a volume and a second job reads it back, and stopping
// it releases the claim and the mounts; an exec workload uses the same
// volume; a driver-managed plugin and volume run beside the native ones; a
// plugin task that is not privileged is refused, naming privileged; and
// tearing it all down leaves no mount and no loop device.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// nativeRun holds what TestNativeCSI made, for the cases and the cleanup.
type nativeRun struct {
	a         *Agent
	workloads []string // workload jobs, stopped before the volumes are deleted
	plugins   []string // plugin jobs, stopped last
	volumes   []string // native volumes, deleted before the plugins stop
}

func TestNativeCSI(t *testing.T) {
	requireCSI(t)
	root, err := RepoRoot()
	must.NoError(t, err)
	must.NoError(t, CheckFixture(root))

	// Registered before the agent, so it runs after the agent's Close:
	// ext4 volumes are loop devices, which no unmount detaches.
	var dir string
	t.Cleanup(func() {
		if dir == "" {
			return
		}
		if err := DetachNativeLoops(dir); err != nil {
			t.Errorf("%v", err)
		}
	})
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName, "exec"}})
	dir = a.Dir
	r := &nativeRun{a: a}
	// Runs before the agent's Close: workloads stop and release their
	// claims, volumes are deleted while their plugin still runs.
	t.Cleanup(func() { r.teardown(t) })

	step := func(name string, f func(t *testing.T)) {
		start := time.Now()
		ok := t.Run(name, f)
		t.Logf("%s: %v (%.1fs)", name, map[bool]string{true: "ok", false: "FAILED"}[ok], time.Since(start).Seconds())
		if !ok {
			t.FailNow()
		}
	}

	step("monolith_plugin_healthy", r.pluginHealthy)
	step("examples_validate", r.examplesValidate)
	step("volume_write_read_release", r.writeReadRelease)
	step("exec_workload", r.execWorkload)
	step("both_worlds", r.bothWorlds)
	step("unprivileged_plugin_refused", r.unprivilegedRefused)
	step("teardown_leaves_nothing", r.teardownLeavesNothing)
}

// pluginHealthy runs the fixture as a native monolith plugin and waits for
// the servers to count its controller and node healthy.
func (r *nativeRun) pluginHealthy(t *testing.T) {
	a := r.a
	start := time.Now()
	job := a.RunJob(t, "native_plugin", a.NativePluginVars("fixture", true, ""))
	r.plugins = append(r.plugins, job.ID)
	al := a.WaitAlloc(t, job.ID, time.Minute, StatusRunning)
	p, err := a.WaitNativePlugin("fixture", 1, 1, 60*time.Second)
	if err != nil {
		t.Fatalf("%v\n%s", err, a.Allocation(t, al.ID).Describe())
	}
	t.Logf("plugin fixture healthy %.1fs after submit (provider %s)", time.Since(start).Seconds(), p.Provider)
	a.WaitEvent(t, al.ID, "plugin", "Plugin became healthy", 10*time.Second)

	out, err := a.Nomad("plugin", "status", "fixture")
	must.NoError(t, err, must.Sprint(out))
	for _, want := range []string{"Controllers Healthy", "Controllers Expected", "Nodes Healthy", "Nodes Expected"} {
		re := regexp.MustCompile(`(?m)^` + want + `\s*=\s*1$`)
		must.True(t, re.MatchString(out), must.Sprintf("nomad plugin status fixture: want %q = 1:\n%s", want, out))
	}
	must.StrContains(t, out, "fixture.csi.nomad-driver-csi")

	// The driver builds the task's root (FSIsolation image): Nomad hands
	// the plugin the socket's path in the task, under mount_dir, which the
	// driver binds to Nomad's plugin directory, where the socket is.
	sock := filepath.Join(a.NativeCSIDir(), "plugins", al.ID, "csi.sock")
	fi, err := os.Stat(sock)
	must.NoError(t, err)
	must.True(t, fi.Mode()&os.ModeSocket != 0)
	pids := TaskPIDs(al.ID, "plugin")
	must.SliceNotEmpty(t, pids)
	env, err := nativeEnviron(pids[0])
	must.NoError(t, err)
	must.SliceContains(t, env, "CSI_ENDPOINT=unix://"+filepath.Join(a.NativePluginVars("fixture", true, "")["MountDir"], "csi.sock"))
}

// examplesValidate checks the files of examples/native with
// "nomad job validate" and the volume spec by reading it back after the
// next case creates it.
func (r *nativeRun) examplesValidate(t *testing.T) {
	a := r.a
	dir := filepath.Join(a.Root, "examples", "native")
	jobs, err := filepath.Glob(filepath.Join(dir, "*.nomad.hcl"))
	must.NoError(t, err)
	must.SliceContains(t, jobs, filepath.Join(dir, "plugin.nomad.hcl"))
	for _, file := range jobs {
		f := filepath.Base(file)
		args := []string{"job", "validate"}
		vars := map[string]string{}
		if f == "plugin.nomad.hcl" {
			args = append(args, "-var", "plugin_command="+FixtureBinary(a.Root))
			vars["plugin_command"] = FixtureBinary(a.Root)
		}
		out, err := a.Nomad(append(args, file)...)
		must.NoError(t, err, must.Sprintf("nomad job validate %s:\n%s", f, out))
		must.StrContains(t, out, "Job validation successful")
		checkCSITaskConfigs(t, a, file, vars)
	}
}

// writeReadRelease creates the example volume, writes to it from one csi
// job, reads it back from another, and checks that stopping the reader
// releases the claim and every mount.
func (r *nativeRun) writeReadRelease(t *testing.T) {
	a := r.a
	start := time.Now()
	out, err := a.CreateNativeVolumeFile(filepath.Join(a.Root, "examples", "native", "volume.hcl"))
	must.NoError(t, err)
	r.volumes = append(r.volumes, "data")
	t.Logf("nomad volume create: %.1fs: %s", time.Since(start).Seconds(), strings.TrimSpace(out))
	v, err := a.NativeVolume("data")
	must.NoError(t, err)
	must.True(t, v.Schedulable, must.Sprintf("volume data is not schedulable: %+v", v))

	dest := filepath.Join(a.Dir, "mnt", "data")
	token := fmt.Sprintf("native-%d", time.Now().UnixNano())
	start = time.Now()
	writer := r.workload(t, "data", DriverName, "batch", "single-node-writer", dest, strings.Join([]string{
		"set -e",
		"echo " + token + " > " + dest + "/token",
		"echo wrote: $(cat " + dest + "/token)",
		"grep ' " + dest + " ' /proc/self/mountinfo",
	}, "\n"))
	al := a.WaitAlloc(t, writer, 90*time.Second, StatusComplete)
	logs := a.AllocLogs(t, al.ID, "t", false)
	must.StrContains(t, logs, "wrote: "+token)
	must.StrContains(t, logs, " - ext4 /dev/loop", must.Sprint("the task's mount of the volume is the plugin's ext4 loop device"))
	t.Logf("writer: submit -> complete %.1fs", time.Since(start).Seconds())
	r.waitReleased(t, "data")

	start = time.Now()
	reader := r.workload(t, "data", DriverName, "service", "single-node-writer", dest,
		"cat "+dest+"/token\nexec sleep 3600")
	al = a.WaitAlloc(t, reader, 90*time.Second, StatusRunning)
	a.WaitLogs(t, al.ID, "t", token, 30*time.Second)
	t.Logf("reader: submit -> read back %.1fs", time.Since(start).Seconds())
	v, err = a.NativeVolume("data")
	must.NoError(t, err)
	must.MapLen(t, 1, v.WriteAllocs, must.Sprintf("claims of volume data while the reader runs"))
	r.mustHaveVolumeMounts(t, "fixture", true)

	start = time.Now()
	a.StopJob(t, reader)
	a.WaitAlloc(t, reader, time.Minute, StatusComplete, StatusFailed)
	r.waitReleased(t, "data")
	t.Logf("reader: stop -> claim released %.1fs", time.Since(start).Seconds())
	out, err = a.Nomad("volume", "status", "data")
	must.NoError(t, err, must.Sprint(out))
	must.StrContains(t, out, "No allocations placed")
	r.mustHaveVolumeMounts(t, "fixture", false)
	// The task saw the host's file system: what it wrote went to the
	// volume, not to the directory the mount covered.
	_, err = os.Stat(filepath.Join(dest, "token"))
	must.True(t, errors.Is(err, os.ErrNotExist), must.Sprintf("the token is on the host's %s, not only on the volume: %v", dest, err))
}

// execWorkload uses the same volume from Nomad's exec driver.
func (r *nativeRun) execWorkload(t *testing.T) {
	a := r.a
	start := time.Now()
	dest := "/srv/data"
	job := r.workload(t, "data", "exec", "service", "single-node-writer", dest,
		"echo exec read: $(cat "+dest+"/token)\ndate >> "+dest+"/exec-was-here\nexec sleep 3600")
	al := a.WaitAlloc(t, job, 90*time.Second, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "exec read: native-", 30*time.Second)
	t.Logf("exec workload: submit -> read back %.1fs", time.Since(start).Seconds())
	r.mustHaveVolumeMounts(t, "fixture", true)
	a.StopJob(t, job)
	a.WaitAlloc(t, job, time.Minute, StatusComplete, StatusFailed)
	r.waitReleased(t, "data")
	r.mustHaveVolumeMounts(t, "fixture", false)
}

// bothWorlds runs a driver-managed plugin and volume beside the native
// ones on the same node, both in use at once.
func (r *nativeRun) bothWorlds(t *testing.T) {
	a := r.a
	start := time.Now()
	mp := a.RunJob(t, "native_managed_plugin", a.ManagedPluginVars("managed"))
	r.plugins = append(r.plugins, mp.ID)
	a.WaitAlloc(t, mp.ID, time.Minute, StatusRunning)
	nativeWaitNodeAttr(t, a, "driver.csi.plugin.managed.healthy", "true", 30*time.Second)
	t.Logf("driver-managed plugin healthy %.1fs after submit", time.Since(start).Seconds())
	// Nomad's view of its own plugin is untouched by the driver's.
	_, err := a.WaitNativePlugin("fixture", 1, 1, 5*time.Second)
	must.NoError(t, err)
	_, err = a.NativePlugin("managed")
	must.Error(t, err, must.Sprint("a driver-managed plugin must stay unknown to Nomad's servers"))

	// What is mounted under root_dir before the driver-managed volume:
	// the stage root's own self-bind, while a node plugin of the driver
	// runs.
	driverMountsBefore, err := MountsUnder(a.DriverRoot)
	must.NoError(t, err)
	nativeDest := filepath.Join(a.Dir, "mnt", "native")
	managedDest := filepath.Join(a.Dir, "mnt", "managed")
	nat := r.workload(t, "data", DriverName, "service", "single-node-writer", nativeDest,
		"echo native sees $(cat "+nativeDest+"/token)\nexec sleep 3600")
	job, err := a.RenderJob("native_managed_workload", map[string]string{
		"Type": "service", "Count": "1", "PluginID": "managed", "VolumeID": "managed-data",
		"Dest": managedDest, "AccessMode": "single-node-writer", "VolumeType": "ext4",
		"Script": "echo managed > " + managedDest + "/who && echo managed wrote $(cat " + managedDest + "/who)\nexec sleep 3600",
	})
	must.NoError(t, err)
	if _, err := a.SubmitRendered(job); err != nil {
		t.Fatal(err)
	}
	r.workloads = append(r.workloads, job.ID)
	nal := a.WaitAlloc(t, nat, 90*time.Second, StatusRunning)
	mal := a.WaitAlloc(t, job.ID, 90*time.Second, StatusRunning)
	a.WaitLogs(t, nal.ID, "t", "native sees native-", 30*time.Second)
	a.WaitLogs(t, mal.ID, "t", "managed wrote managed", 30*time.Second)
	t.Logf("both worlds running %.1fs after the first submit", time.Since(start).Seconds())
	r.mustHaveVolumeMounts(t, "fixture", true)
	// The driver-managed volume is staged and published under the
	// driver's root_dir: the journal's staging path and publish target of
	// this volume are mount points that were not there before it.
	volPaths := r.managedVolumePaths(t, "managed")
	driverMounts, err := MountsUnder(a.DriverRoot)
	must.NoError(t, err)
	for _, p := range volPaths {
		must.SliceContains(t, driverMounts, p, must.Sprintf("the driver-managed volume's %s is not mounted; mounts under root_dir: %v", p, driverMounts))
		must.SliceNotContains(t, driverMountsBefore, p, must.Sprintf("%s was mounted before the volume", p))
	}
	t.Logf("driver-managed volume mounted at %v (before it: %v)", volPaths, driverMountsBefore)

	a.StopJob(t, nat)
	a.StopJob(t, job.ID)
	a.WaitAlloc(t, nat, time.Minute, StatusComplete, StatusFailed)
	a.WaitAlloc(t, job.ID, time.Minute, StatusComplete, StatusFailed)
	r.waitReleased(t, "data")
	r.mustHaveVolumeMounts(t, "fixture", false)
	r.mustHaveNoVolumeMountsInDriverRoot(t)
	driverMounts, err = MountsUnder(a.DriverRoot)
	must.NoError(t, err)
	must.SliceEmpty(t, VolMountedAmong(volPaths), must.Sprint("the driver-managed volume is still mounted after its task stopped"))
	must.Eq(t, driverMountsBefore, driverMounts, must.Sprint("mounts under root_dir after the driver-managed volume is gone, and before it"))
}

// managedVolumePaths returns the staging path and the publish target the
// driver's journal holds for the one volume of a driver-managed plugin,
// checking that both are below root_dir/mnt.
func (r *nativeRun) managedVolumePaths(t *testing.T, pluginID string) []string {
	t.Helper()
	st, err := r.a.VolJournal()
	must.NoError(t, err)
	var vols []string
	for _, v := range st.Volumes {
		if v.PluginID == pluginID {
			vols = append(vols, v.VolumeID)
		}
	}
	must.SliceLen(t, 1, vols, must.Sprintf("volume records of plugin %s in the journal: %+v", pluginID, st.Volumes))
	paths := r.a.VolJournalPaths(vols[0])
	must.SliceLen(t, 2, paths, must.Sprintf("journal paths of volume %s (a staging path and a target)", vols[0]))
	stageRoot := filepath.Join(r.a.DriverRoot, "mnt")
	for _, p := range paths {
		must.True(t, strings.HasPrefix(p, stageRoot+"/"), must.Sprintf("%s is not below the stage root %s", p, stageRoot))
	}
	return paths
}

// unprivilegedRefused runs a native plugin task without privileged: Nomad
// asks for bidirectional mounts for it, which the driver refuses, saying
// what to set.
func (r *nativeRun) unprivilegedRefused(t *testing.T) {
	a := r.a
	job := a.RunJob(t, "native_plugin", a.NativePluginVars("unpriv", false, ""))
	r.plugins = append(r.plugins, job.ID)
	al := a.WaitAlloc(t, job.ID, time.Minute, StatusFailed)
	text := eventsText(al, "plugin")
	t.Logf("events of the unprivileged plugin task:\n%s", text)
	var refusal string
	for _, e := range al.Events("plugin") {
		if s := e.Text(); strings.Contains(s, "bidirectional") {
			refusal = s
		}
	}
	must.NotEq(t, "", refusal, must.Sprintf("no event names the bidirectional mount:\n%s", text))
	must.StrContains(t, refusal, "privileged = true")
	if p, err := a.NativePlugin("unpriv"); err == nil {
		must.Eq(t, 0, p.NodesHealthy+p.ControllersHealthy, must.Sprint("a refused plugin must not be healthy"))
	}
}

// teardownLeavesNothing stops every workload, deletes the native volume
// while its plugin runs, stops the plugins, and checks that no mount and
// no loop device is left.
func (r *nativeRun) teardownLeavesNothing(t *testing.T) {
	a := r.a
	start := time.Now()
	must.NoError(t, r.stopAll())
	t.Logf("teardown: %.1fs", time.Since(start).Seconds())
	for _, dir := range []string{a.NativeCSIDir(), a.DriverRoot} {
		mounts, err := MountsUnder(dir)
		must.NoError(t, err)
		must.SliceEmpty(t, mounts, must.Sprintf("mounts left under %s", dir))
	}
	must.SliceEmpty(t, NativeLoopsUnder(a.Dir), must.Sprint("loop devices left"))
}

// workload submits e2e/jobs/native_workload.hcl for a native volume.
func (r *nativeRun) workload(t *testing.T, volumeID, driver, typ, accessMode, dest, script string) string {
	t.Helper()
	job, err := r.a.RenderJob("native_workload", map[string]string{
		"Driver": driver, "Type": typ, "Count": "1", "VolumeID": volumeID, "AccessMode": accessMode,
		"Dest": dest, "Script": script,
	})
	must.NoError(t, err)
	if _, err := r.a.SubmitRendered(job); err != nil {
		t.Fatal(err)
	}
	r.workloads = append(r.workloads, job.ID)
	return job.ID
}

func (r *nativeRun) waitReleased(t *testing.T, volumeID string) {
	t.Helper()
	if _, err := r.a.WaitNativeVolumeReleased(volumeID, 60*time.Second); err != nil {
		t.Fatal(err)
	}
}

// mustHaveVolumeMounts checks whether Nomad's staging and per-allocation
// directories of a native plugin hold mounts.
func (r *nativeRun) mustHaveVolumeMounts(t *testing.T, pluginID string, want bool) {
	t.Helper()
	base := r.a.NativeStageDir("monolith", pluginID)
	var all []string
	for _, sub := range []string{"staging", "per-alloc"} {
		mounts, err := MountsUnder(filepath.Join(base, sub))
		must.NoError(t, err)
		all = append(all, mounts...)
	}
	if want {
		must.SliceNotEmpty(t, all, must.Sprintf("no volume mounts under %s", base))
	} else {
		must.SliceEmpty(t, all, must.Sprintf("volume mounts left under %s", base))
	}
}

// mustHaveNoVolumeMountsInDriverRoot checks that the driver-managed
// volumes are unstaged: what is left under root_dir is at most the stage
// root's own shared self-bind while its plugin runs.
func (r *nativeRun) mustHaveNoVolumeMountsInDriverRoot(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		mounts, err := MountsUnder(r.a.DriverRoot)
		must.NoError(t, err)
		var volumes []string
		for _, m := range mounts {
			if strings.Count(strings.TrimPrefix(m, r.a.DriverRoot), "/") > 1 {
				volumes = append(volumes, m)
			}
		}
		if len(volumes) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("volume mounts left under %s: %v", r.a.DriverRoot, volumes)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// stopAll stops the workloads, waits for the native volumes' claims to be
// released, deletes the volumes, then stops the plugins.
func (r *nativeRun) stopAll() error {
	a := r.a
	var errs []string
	for _, id := range r.workloads {
		if err := a.StopWaitPurge(id, true, time.Minute); err != nil {
			errs = append(errs, err.Error())
		}
	}
	r.workloads = nil
	for _, id := range r.volumes {
		if _, err := a.WaitNativeVolumeReleased(id, time.Minute); err != nil {
			errs = append(errs, err.Error())
		}
		if err := a.DeleteNativeVolume(id, 30*time.Second); err != nil {
			errs = append(errs, err.Error())
		}
	}
	r.volumes = nil
	for _, id := range r.plugins {
		if err := a.StopWaitPurge(id, true, time.Minute); err != nil {
			errs = append(errs, err.Error())
		}
	}
	r.plugins = nil
	if len(errs) > 0 {
		return fmt.Errorf("teardown: %s", strings.Join(errs, "; "))
	}
	return nil
}

// teardown is stopAll on the way out of a failed test.
func (r *nativeRun) teardown(t *testing.T) {
	if err := r.stopAll(); err != nil {
		t.Errorf("%v", err)
	}
}

func nativeWaitNodeAttr(t *testing.T, a *Agent, key, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var got string
	for time.Now().Before(deadline) {
		n := a.Node(t)
		got = n.Attributes[key]
		if got == want {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("node attribute %s is %q after %v, want %q", key, got, timeout, want)
}
