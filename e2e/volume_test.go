//go:build e2e

package e2e

// The CSI volume cases: workload tasks of the csi driver get volumes from
// the e2e fixture plugin (e2e/csiplugin), itself run as a plugin task of
// the driver, on a real agent. TestVolumes shares one privileged -dev agent
// between its subtests, each with its own volume ids and, where a case
// kills or reconfigures its plugin, its own plugin id;
// TestVolumeAgentRestart has a Persistent agent of its own. Every agent
// ends with a check that nothing is left mounted under the driver's root
// and the journal holds no volume or task record, once every job has
// stopped.

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

const volTimeout = 90 * time.Second

// volAgent starts a privileged agent for volume cases and registers,
// to run before the harness closes it, the final check: workload jobs
// stopped first, their volumes torn down, then the plugins stopped, and
// then nothing mounted under the driver's root and no volume or task
// record in the journal.
func volAgent(t *testing.T, persistent bool) *Agent {
	t.Helper()
	return volAgentWith(t, AgentOptions{AllowPrivileged: true, Persistent: persistent})
}

// volAgentWith is volAgent with the agent's options.
func volAgentWith(t *testing.T, opts AgentOptions) *Agent {
	t.Helper()
	requireCSI(t)
	csiBin(t, "csi-fixture") // builds build/csi once
	var a *Agent
	t.Cleanup(func() {
		// After the harness's Close: loop devices of ext4 volumes it may
		// have had to unmount by force.
		if a == nil {
			return
		}
		if devs := VolLoopsUnder(a.Dir); len(devs) > 0 {
			t.Errorf("loop devices still attached to volumes of %s: %v", a.Dir, devs)
			_ = VolDetachLoops(a.Dir)
		}
	})
	a = StartAgent(t, opts)
	t.Cleanup(func() { volFinalCheck(t, a) })
	return a
}

// volFinalCheck stops the workloads, then the plugins, and asserts the
// driver left nothing behind under its root. own are mounts the test made
// there itself (a small file system at root_dir): they must still be there,
// and are not counted as left.
func volFinalCheck(t *testing.T, a *Agent, own ...string) {
	if a.PID() == 0 {
		t.Errorf("agent %s is not running for the final volume check", a.Dir)
		return
	}
	a.mu.Lock()
	jobs := append([]string(nil), a.jobs...)
	a.mu.Unlock()
	var workloads, plugins []string
	for _, j := range jobs {
		if strings.HasPrefix(j, "volume_plugin-") {
			plugins = append(plugins, j)
		} else {
			workloads = append(workloads, j)
		}
	}
	a.stopJobs(workloads, volTimeout)
	if left := a.WaitVolJournalClear(volTimeout); len(left) > 0 {
		t.Errorf("journal records left after every workload stopped: %v", left)
	}
	a.stopJobs(plugins, volTimeout)
	var left []string
	for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		var err error
		if left, err = MountsUnder(a.DriverRoot); err != nil {
			left = []string{volReadError(err)}
		}
		left = slices.DeleteFunc(left, func(p string) bool { return slices.Contains(own, p) })
		if len(left) == 0 {
			break
		}
	}
	if len(own) > 0 {
		now, err := MountsUnder(a.DriverRoot)
		for _, p := range own {
			if err != nil || !slices.Contains(now, p) {
				t.Errorf("the test's own mount %s under the driver's root is gone (%v): the check above proves nothing", p, err)
			}
		}
	}
	if len(left) > 0 {
		t.Errorf("mounts left under the driver's root %s after every job stopped: %v", a.DriverRoot, left)
	} else {
		t.Logf("final check: nothing mounted under %s (%d jobs stopped)", a.DriverRoot, len(jobs))
	}
}

// volDir is a destination parent for one case, under the agent's
// directory so that nothing is made elsewhere on the host.
func volDir(a *Agent, name string) string { return filepath.Join(a.Dir, "dst", name) }

// volUniq makes a volume id unique to this run.
func volUniq(prefix string) string { return fmt.Sprintf("%s-%d", prefix, time.Now().UnixNano()%1e9) }

func TestVolumes(t *testing.T) {
	t.Parallel()
	a := volAgent(t, false)
	fx := a.StartVolFixture(t, "fixture", VolFixtureOptions{})

	// The cases run in parallel; each uses volume ids of its own, and the
	// cases that kill or reconfigure a plugin start a plugin of their own.
	t.Run("persist", func(t *testing.T) { t.Parallel(); testVolumePersist(t, a, fx) })
	t.Run("shared_staging", func(t *testing.T) { t.Parallel(); testVolumeSharedStaging(t, a, fx) })
	t.Run("plugin_killed_during_teardown", func(t *testing.T) { t.Parallel(); testVolumePluginKilled(t, a) })
	t.Run("read_only", func(t *testing.T) { t.Parallel(); testVolumeReadOnly(t, a, fx) })
	t.Run("one_allocation_writer_and_reader", func(t *testing.T) { t.Parallel(); testVolumeOneAllocationWriterAndReader(t, a, fx) })
	t.Run("block_device", func(t *testing.T) { t.Parallel(); testVolumeBlock(t, a, fx) })
	t.Run("bad_input", func(t *testing.T) { t.Parallel(); testVolumeBadInput(t, a, fx) })
	t.Run("secrets_not_leaked", func(t *testing.T) { t.Parallel(); testVolumeSecrets(t, a, fx) })
	t.Run("controller_publish", func(t *testing.T) { t.Parallel(); testVolumeControllerPublish(t, a) })
	t.Run("csi_test_mock_driver", func(t *testing.T) { t.Parallel(); testVolumeK8sMock(t, a) })
	t.Run("gocsi_mock", func(t *testing.T) { t.Parallel(); testVolumeGocsiMock(t, a) })
}

// 1. A job writes into an ext4 volume it creates; a second job naming the
// same volume (no create block) reads the file back.
func testVolumePersist(t *testing.T, a *Agent, fx *VolFixture) {
	start := time.Now()
	name := volUniq("persist")
	dest := filepath.Join(volDir(a, name), "data")
	canary := "written-by-" + name
	w := a.RunVolJob(t, VolJob{
		Script: fmt.Sprintf("echo %s > %s/file && sync && echo wrote", canary, dest),
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer",
			Create: true, CreateType: "ext4"}},
	})
	al := a.WaitAlloc(t, w.ID, volTimeout, StatusComplete)
	must.StrContains(t, a.AllocLogs(t, al.ID, "t", false), "wrote")
	must.StrContains(t, eventsText(al, "t"), `Creating volume "data"`)
	must.StrContains(t, eventsText(al, "t"), `Published volume "data" at `+dest)

	r := a.RunVolJob(t, VolJob{
		Script:  fmt.Sprintf("cat %s/file", dest),
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-reader-only", ReadOnly: true}},
	})
	al = a.WaitAlloc(t, r.ID, volTimeout, StatusComplete)
	must.StrContains(t, a.AllocLogs(t, al.ID, "t", false), canary)
	id := fx.VolumeID(name)
	must.NotEq(t, "", id)
	must.Eq(t, 2, fx.Count("NodeStageVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	t.Logf("persist: %v; calls for %s: %v", time.Since(start).Round(time.Millisecond), id, fx.VolumeCalls(id))
}

// volWaitCount waits until the fixture logged n calls of method for volID.
func volWaitCount(t *testing.T, fx *VolFixture, method, volID string, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for fx.Count(method, volID) < n && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	must.Eq(t, n, fx.Count(method, volID), must.Sprintf("%s calls for %s; all calls: %v", method, volID, fx.VolumeCalls(volID)))
}

// volWaitEvent waits until one of the task's events says substr and
// returns the allocation.
func volWaitEvent(t *testing.T, a *Agent, allocID, substr string, timeout time.Duration) *Allocation {
	t.Helper()
	var last *Allocation
	var lastErr error
	ok, st := a.watchAllocs(allocID, timeout, func(streamStats) bool {
		al, err := a.allocation(allocID)
		if err != nil {
			lastErr = err
			return false
		}
		last = al
		return strings.Contains(eventsText(al, "t"), substr)
	})
	if ok {
		return last
	}
	if last == nil {
		t.Fatalf("allocation %s could not be read within %v (%s): %v", allocID, timeout, st, lastErr)
	}
	t.Fatalf("no event of task t saying %q within %v (%s); last seen:\n%s", substr, timeout, st, last.Describe())
	return nil
}

// exec runs a shell command in a running task and fails the test on error.
func volExec(t *testing.T, a *Agent, allocID, script string) string {
	t.Helper()
	out, err := a.AllocExec(allocID, "t", "/bin/sh", "-c", script)
	must.NoError(t, err, must.Sprintf("nomad alloc exec %s sh -c %q: %s", allocID, script, out))
	return out
}

// volSleeper is the script of service tasks: note it started, then sleep.
const volSleeper = "echo started; exec sleep 3600"

// 2. Two tasks share one staged volume: one NodeStage, two NodePublish;
// the second task keeps working when the first stops; the volume is
// unstaged when both are gone.
func testVolumeSharedStaging(t *testing.T, a *Agent, fx *VolFixture) {
	start := time.Now()
	name := volUniq("shared")
	vol := func(dest string) VolSpec {
		return VolSpec{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "multi-node-multi-writer", Create: true, CreateType: "ext4"}
	}
	destA, destB := filepath.Join(volDir(a, name), "a"), filepath.Join(volDir(a, name), "b")
	jobA := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{vol(destA)}})
	alA := a.WaitAlloc(t, jobA.ID, volTimeout, StatusRunning)
	// A plugin task that starts while the volume is staged (in CI a
	// restarting plugin of another case did) leaves the host's staging and
	// publish mounts alone: its namespace's copies of them are peers of the
	// host's.
	pathsA := a.VolJournalPaths(fx.VolumeID(name))
	must.Len(t, 2, VolMountedAmong(pathsA), must.Sprintf("mounted of %v before another plugin starts", pathsA))
	a.StartVolFixture(t, "fxlate", VolFixtureOptions{Type: "node"})
	must.Len(t, 2, VolMountedAmong(pathsA), must.Sprintf("mounted of %v after another plugin started", pathsA))
	jobB := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{vol(destB)}})
	alB := a.WaitAlloc(t, jobB.ID, volTimeout, StatusRunning)

	id := fx.VolumeID(name)
	must.NotEq(t, "", id)
	must.Eq(t, 1, fx.Count("NodeStageVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	must.Eq(t, 2, fx.Count("NodePublishVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	paths := a.VolJournalPaths(id)
	must.Eq(t, 3, len(paths), must.Sprintf("journal paths: %v", paths)) // one staging path, two targets
	// What the "no records left" checks read sees this volume's records.
	must.Len(t, 3, a.VolJournalMentions(id), must.Sprintf("journal: %v", a.VolJournalLeft())) // the volume, two tasks

	volExec(t, a, alA.ID, "echo from-a > "+destA+"/a")
	must.StrContains(t, volExec(t, a, alB.ID, "cat "+destB+"/a"), "from-a")

	a.VolStopAndWait(t, jobA.ID, volTimeout)
	volWaitCount(t, fx, "NodeUnpublishVolume", id, 1, 30*time.Second)
	must.Eq(t, 0, fx.Count("NodeUnstageVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	must.StrContains(t, volExec(t, a, alB.ID, "echo from-b > "+destB+"/b && cat "+destB+"/a "+destB+"/b"), "from-a\nfrom-b")

	a.VolStopAndWait(t, jobB.ID, volTimeout)
	volWaitCount(t, fx, "NodeUnstageVolume", id, 1, 30*time.Second)
	must.Eq(t, 2, fx.Count("NodeUnpublishVolume", id))
	must.SliceEmpty(t, VolMountedAmong(paths), must.Sprint("still mounted after both tasks stopped"))
	must.SliceEmpty(t, a.WaitVolJournalClear(10*time.Second, id), must.Sprint("journal records left"))
	t.Logf("shared_staging: %v; calls for %s: %v", time.Since(start).Round(time.Millisecond), id, fx.VolumeCalls(id))
}

// 4. The plugin is killed while a volume task stops: teardown is retried
// (the task's events say so) and completes once Nomad restarted the plugin.
func testVolumePluginKilled(t *testing.T, a *Agent) {
	start := time.Now()
	// A plugin of its own, restarted by Nomad 12s after it dies: longer
	// than the in-line retries, so the background retries show.
	fx := a.StartVolFixture(t, "fxkill", VolFixtureOptions{RestartDelay: 12 * time.Second})
	name := volUniq("killed")
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{{
		Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer", Create: true, CreateType: "dir"}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	id := fx.VolumeID(name)
	paths := a.VolJournalPaths(id)
	must.Eq(t, 2, len(paths), must.Sprintf("journal paths: %v", paths))

	pid := fx.PID()
	must.Positive(t, pid)
	must.NoError(t, volKill(pid))
	t.Logf("killed the plugin (pid %d); stopping the volume task", pid)
	a.StopJob(t, job.ID)
	killed := time.Now()

	al = volWaitEvent(t, a, al.ID, "retrying", volTimeout)
	t.Logf("retry event after %v", time.Since(killed).Round(time.Millisecond))
	a.WaitVolPluginHealthy(t, fx.ID, volTimeout)
	volWaitCount(t, fx, "NodeUnstageVolume", id, 1, volTimeout)
	done := time.Now()
	if left := a.WaitVolMountsGone(10*time.Second, paths...); len(left) > 0 {
		t.Fatalf("still mounted after the teardown completed: %v", left)
	}
	must.SliceEmpty(t, a.WaitVolJournalClear(10*time.Second, id), must.Sprint("journal records left"))
	al = a.Allocation(t, al.ID)
	for _, e := range al.Events("t") {
		if strings.Contains(e.Text(), "olume") {
			t.Logf("event %s: %s", time.Unix(0, e.Time).Format("15:04:05.000"), e.Text())
		}
	}
	t.Logf("plugin_killed: %v in all; teardown done %v after the kill; calls for %s: %v",
		time.Since(start).Round(time.Millisecond), done.Sub(killed).Round(time.Millisecond), id, fx.VolumeCalls(id))
}

// 5a. read_only is enforced: a write fails with EROFS.
func testVolumeReadOnly(t *testing.T, a *Agent, fx *VolFixture) {
	name := volUniq("ro")
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{
		Script: fmt.Sprintf("if touch %s/x; then echo WRITABLE; exit 1; fi; echo refused", dest),
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-reader-only", ReadOnly: true,
			Create: true, CreateType: "dir"}},
	})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusComplete)
	must.StrContains(t, a.AllocLogs(t, al.ID, "t", false), "refused")
	stderr := a.AllocLogs(t, al.ID, "t", true)
	must.StrContains(t, stderr, "Read-only file system")
	t.Logf("read_only: stderr %q", strings.TrimSpace(stderr))
}

// 5b. A block volume is a block device the task can write to.
func testVolumeBlock(t *testing.T, a *Agent, fx *VolFixture) {
	name := volUniq("block")
	dest := filepath.Join(volDir(a, name), "dev")
	job := a.RunVolJob(t, VolJob{
		Script: fmt.Sprintf("test -b %[1]s && dd if=/dev/zero of=%[1]s bs=4k count=1 conv=notrunc && echo block-ok", dest),
		Volumes: []VolSpec{{Name: "dev", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer", Attach: "block-device",
			Create: true, CreateType: "ext4"}},
	})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusComplete, StatusFailed)
	out := a.AllocLogs(t, al.ID, "t", false) + a.AllocLogs(t, al.ID, "t", true)
	must.StrContains(t, out, "block-ok", must.Sprintf("task output: %s\n%s", out, al.Describe()))
	must.Eq(t, StatusComplete, al.ClientStatus)
	id := fx.VolumeID(name)
	volWaitCount(t, fx, "NodeUnstageVolume", id, 1, 30*time.Second)
	t.Logf("block_device: %s; calls for %s: %v", strings.TrimSpace(out), id, fx.VolumeCalls(id))
}

func volKill(pid int) error { return unix.Kill(pid, unix.SIGKILL) }

// 6. Every bad request fails with its message and leaves nothing behind:
// no mount, no volume or task record in the journal, nothing staged or
// published by the plugin.
func testVolumeBadInput(t *testing.T, a *Agent, fx *VolFixture) {
	// A plugin without a controller service: it cannot create volumes.
	node := a.StartVolFixture(t, "fxnode", VolFixtureOptions{Type: "node"})

	// The single-node-writer volume the "second writer" case competes for.
	held := volUniq("held")
	heldJob := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{{
		Name: "data", Plugin: fx.ID, ID: held, Dest: filepath.Join(volDir(a, held), "data"), Access: "single-node-writer",
		Create: true, CreateType: "dir"}}})
	heldAlloc := a.WaitAlloc(t, heldJob.ID, volTimeout, StatusRunning)
	heldID := fx.VolumeID(held)
	heldDest := filepath.Join(volDir(a, held), "data")
	// The held volume's mounts on the host (its staging path and the held
	// task's target) and in the held task's namespace (its destination).
	heldHost := volMountsNaming(t, heldID)
	must.SliceLen(t, 2, heldHost, must.Sprintf("host mounts of volume %s", heldID))
	heldNS, err := TaskMounts(heldAlloc.ID, "t")
	must.NoError(t, err)
	must.SliceContains(t, heldNS, heldDest, must.Sprint("the held task's own namespace lacks its volume"))

	type tc struct {
		name string
		vols func(id, dir string) []VolSpec
		want string
	}
	good := func(id, dir string) VolSpec {
		return VolSpec{Name: "data", Plugin: fx.ID, ID: id, Dest: filepath.Join(dir, "data"), Access: "single-node-writer",
			Create: true, CreateType: "dir"}
	}
	with := func(f func(*VolSpec)) func(id, dir string) []VolSpec {
		return func(id, dir string) []VolSpec { v := good(id, dir); f(&v); return []VolSpec{v} }
	}
	cases := []tc{
		{"unknown_plugin", with(func(v *VolSpec) { v.Plugin = "no-such-plugin" }),
			`CSI plugin "no-such-plugin" is not running on node`},
		{"no_create_capability", with(func(v *VolSpec) { v.Plugin = node.ID }),
			`CSI plugin "fxnode" cannot create volumes (no CREATE_DELETE_VOLUME capability)`},
		{"relative_destination", with(func(v *VolSpec) { v.Dest = "data/x" }),
			`destination "data/x" must be an absolute path`},
		{"dotdot_destination", with(func(v *VolSpec) { v.Dest = v.Dest + "/../../../../etc/x" }),
			`must not contain '..'`},
		{"same_destination", func(id, dir string) []VolSpec {
			v, w := good(id, dir), good(id+"-2", dir)
			w.Name = "other"
			return []VolSpec{v, w}
		}, `is also the destination of volume "data"`},
		{"unknown_access_mode", with(func(v *VolSpec) { v.Access = "many-node-many-writer" }),
			`access_mode "many-node-many-writer" is not supported`},
		{"unknown_attachment_mode", with(func(v *VolSpec) { v.Attach = "nfs" }),
			`attachment_mode "nfs" is not supported`},
		{"block_on_dir_volume", with(func(v *VolSpec) { v.Attach = "block-device" }),
			`block access needs a volume of type "ext4"`},
		// An id as the job's author cannot see it: refused before any
		// call, naming the field, the value quoted so the character
		// shows.
		{"volume_id_trailing_space", with(func(v *VolSpec) { v.ID = "acc-hold-1 " }),
			`volume "data": volume_id "acc-hold-1 " has leading or trailing white space: remove it`},
		{"volume_id_control_character", with(func(v *VolSpec) { v.ID = "acc\x1b[2Jhold" }),
			`volume "data": volume_id "acc\x1b[2Jhold" holds the control character U+001B: remove it`},
		{"second_single_node_writer", func(_, dir string) []VolSpec {
			v := good(held, dir)
			v.Create = false
			return []VolSpec{v}
		}, `is single-node-writer and task`},
	}
	// Submit them all, then check them all.
	type sub struct {
		tc
		id, dir string
		job     Job
	}
	var subs []sub
	for _, c := range cases {
		id := volUniq("bad-" + strings.ReplaceAll(c.name, "_", "-"))
		dir := volDir(a, id)
		job := a.RunVolJob(t, VolJob{Script: "echo SHOULD-NOT-RUN", Volumes: c.vols(id, dir)})
		subs = append(subs, sub{c, id, dir, job})
	}
	for _, s := range subs {
		t.Run(s.name, func(t *testing.T) {
			al := a.WaitAlloc(t, s.job.ID, volTimeout, StatusFailed)
			text := eventsText(al, "t")
			must.StrContains(t, text, s.want, must.Sprint(al.Describe()))
			for _, e := range al.Events("t") {
				must.NotEq(t, "Started", e.Type, must.Sprint("the task started"))
			}
			ids := []string{s.id, s.id + "-2", fx.VolumeID(s.id), fx.VolumeID(s.id + "-2")}
			must.SliceEmpty(t, a.WaitVolJournalClear(10*time.Second, ids...), must.Sprint("journal records left"))
			for _, id := range ids[2:] {
				if id != "" {
					must.SliceEmpty(t, fx.VolumeCalls(id)[1:], must.Sprintf("node calls for %s after CreateVolume", id))
				}
			}
			// A refused task never ran: no process, so no mount namespace
			// a destination of it could be mounted in. Its volumes'
			// staging paths and targets on the host hold their ids.
			must.SliceEmpty(t, TaskPIDs(al.ID, "t"), must.Sprint("the refused task has processes"))
			must.SliceEmpty(t, volMountsNaming(t, ids...), must.Sprint("host mounts of the refused task's volumes"))
			// Nor did its destination land in the namespace of the task
			// that runs beside it.
			ns, err := TaskMounts(heldAlloc.ID, "t")
			must.NoError(t, err)
			for _, mp := range ns {
				must.False(t, mounter.PathWithin(mp, s.dir), must.Sprintf("%s is mounted in the held task's namespace", mp))
			}
			var msg string
			for _, e := range al.Events("t") {
				if e.DriverError != "" {
					msg = e.DriverError
				}
			}
			t.Logf("%s: %s", s.name, msg)
		})
	}
	// The held volume is untouched by the refused second writer: the same
	// mounts on the host, its destination still in the held task.
	must.Eq(t, heldHost, volMountsNaming(t, heldID), must.Sprintf("host mounts of volume %s", heldID))
	heldNS, err = TaskMounts(heldAlloc.ID, "t")
	must.NoError(t, err)
	must.SliceContains(t, heldNS, heldDest)
	must.Eq(t, 1, fx.Count("NodePublishVolume", heldID), must.Sprintf("calls: %v", fx.VolumeCalls(heldID)))
	must.Eq(t, 0, fx.Count("NodeUnpublishVolume", heldID), must.Sprintf("calls: %v", fx.VolumeCalls(heldID)))
	must.Eq(t, 2, len(a.VolJournalPaths(heldID)), must.Sprintf("journal paths: %v", a.VolJournalPaths(heldID)))
	must.StrContains(t, volExec(t, a, heldAlloc.ID, "echo still > "+filepath.Join(volDir(a, held), "data", "f")+" && echo ok"), "ok")
	a.VolStopAndWait(t, heldJob.ID, volTimeout)
	volWaitCount(t, fx, "NodeUnstageVolume", heldID, 1, 30*time.Second)
}

// 7. A canary secret never shows in the agent's log (which carries the
// driver's and the plugins' logs), the plugin tasks' logs, or any task
// event, whether the volume works or its setup fails.
func testVolumeSecrets(t *testing.T, a *Agent, fx *VolFixture) {
	canary := "canary-" + volUniq("s3cr3t")
	name := volUniq("secret")
	dir := volDir(a, name)
	ok := a.RunVolJob(t, VolJob{Script: "echo used", Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name,
		Dest: filepath.Join(dir, "data"), Access: "single-node-writer", Create: true, CreateType: "dir",
		Secrets: map[string]string{"token": canary}, Context: map[string]string{"k": "v"}}}})
	okAlloc := a.WaitAlloc(t, ok.ID, volTimeout, StatusComplete)
	id := fx.VolumeID(name)
	volWaitCount(t, fx, "NodeUnstageVolume", id, 1, 30*time.Second)
	// Refused by the plugin at NodeStageVolume, with the secrets in the
	// request: a dir volume cannot take filesystem mount options.
	bad := a.RunVolJob(t, VolJob{Script: "echo used", Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name,
		Dest: filepath.Join(dir, "data"), Access: "single-node-writer", MountFlags: []string{"noatime", "size=1m"},
		Secrets: map[string]string{"token": canary}}}})
	badAlloc := a.WaitAlloc(t, bad.ID, volTimeout, StatusFailed)
	must.StrContains(t, volDriverError(badAlloc), "are not supported for dir volumes")
	must.SliceEmpty(t, a.WaitVolJournalClear(10*time.Second, id), must.Sprint("journal records left"))

	for _, al := range []*Allocation{okAlloc, badAlloc} {
		// The task states as the API gives them (the allocation's job
		// holds the secret, as any Nomad job spec does).
		var raw struct{ TaskStates json.RawMessage }
		must.NoError(t, a.GetJSON("/v1/allocation/"+al.ID, &raw))
		must.StrNotContains(t, string(raw.TaskStates), canary, must.Sprintf("the events of allocation %s show the secret", al.ID))
		must.StrContains(t, string(raw.TaskStates), `volume \"data\"`) // events were there to read
		if al.ID == okAlloc.ID {
			must.StrNotContains(t, a.AllocLogs(t, al.ID, "t", false)+a.AllocLogs(t, al.ID, "t", true), canary)
		}
	}
	agentLog, err := a.ReadLog()
	must.NoError(t, err)
	// The log was there to read: it has the driver's lines of this case.
	must.StrContains(t, agentLog, badAlloc.ID, must.Sprint("the agent log does not name the failed allocation"))
	must.StrNotContains(t, agentLog, canary, must.Sprint("the agent log shows the secret"))
	pluginLogs := a.AllocLogs(t, fx.AllocID, "plugin", false) + a.AllocLogs(t, fx.AllocID, "plugin", true)
	must.StrNotContains(t, pluginLogs, canary, must.Sprint("the plugin's log shows the secret"))
	t.Logf("secrets: canary absent from the agent log (%d bytes), plugin logs (%d bytes) and the events of 2 allocations; failure was: %s",
		len(agentLog), len(pluginLogs), volDriverError(badAlloc))
}

func volDriverError(al *Allocation) string {
	var msg string
	for _, e := range al.Events("t") {
		if e.DriverError != "" {
			msg = e.DriverError
		}
	}
	return msg
}

// ControllerPublishVolume comes before NodeStageVolume, and
// ControllerUnpublishVolume is the last call for the volume.
func testVolumeControllerPublish(t *testing.T, a *Agent) {
	fx := a.StartVolFixture(t, "fxcp", VolFixtureOptions{Args: []string{"--controller-publish"}})
	name := volUniq("cp")
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{Script: fmt.Sprintf("echo hi > %s/f && cat %s/f", dest, dest), Volumes: []VolSpec{{
		Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer", Create: true, CreateType: "ext4"}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusComplete)
	must.StrContains(t, a.AllocLogs(t, al.ID, "t", false), "hi")
	id := fx.VolumeID(name)
	volWaitCount(t, fx, "ControllerUnpublishVolume", id, 1, 30*time.Second)
	want := []string{"ControllerPublishVolume", "NodeStageVolume", "NodePublishVolume",
		"NodeUnpublishVolume", "NodeUnstageVolume", "ControllerUnpublishVolume"}
	must.Eq(t, want, fx.VolumeCalls(id))
	must.StrContains(t, eventsText(al, "t"), `Attaching volume "data"`)
	must.StrContains(t, eventsText(al, "t"), `Unpublished, unstaged and detached volume "data"`)
	t.Logf("controller_publish: calls for %s: %v", id, fx.VolumeCalls(id))
}

// 3. The client restarts with volume tasks running: no stage or publish
// is repeated, no mount is replaced, the tasks keep their processes and
// data, and stopping them afterwards leaves nothing mounted.
func TestVolumeAgentRestart(t *testing.T) {
	t.Parallel()
	start := time.Now()
	a := volAgent(t, true)
	fx := a.StartVolFixture(t, "fixture", VolFixtureOptions{})
	type task struct {
		name, dest, volID string
		job               Job
		alloc             string
		pids              []int
	}
	var tasks []*task
	for i, typ := range []string{"dir", "dir", "ext4"} {
		name := volUniq(fmt.Sprintf("restart%d", i))
		tk := &task{name: name, dest: filepath.Join(volDir(a, name), "data")}
		access := "single-node-writer"
		if i == 1 {
			access = "multi-node-multi-writer"
		}
		tk.job = a.RunVolJob(t, VolJob{Type: "service",
			Script:  fmt.Sprintf("echo before-%s > %s/f && %s", name, tk.dest, volSleeper),
			Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: tk.dest, Access: access, Create: true, CreateType: typ}}})
		tasks = append(tasks, tk)
	}
	// Each volume is staged at one path and published at one target, both
	// mounted, and nothing else is mounted under the staging and publish
	// roots.
	var paths []string
	for _, tk := range tasks {
		tk.alloc = a.WaitAlloc(t, tk.job.ID, volTimeout, StatusRunning).ID
		a.WaitLogs(t, tk.alloc, "t", "started", volTimeout)
		tk.pids = TaskPIDs(tk.alloc, "t")
		must.SliceNotEmpty(t, tk.pids)
		tk.volID = fx.VolumeID(tk.name)
		must.NotEq(t, "", tk.volID)
		p := a.VolJournalPaths(tk.volID)
		must.SliceLen(t, 2, p, must.Sprintf("journal paths of volume %s (a staging path and a target)", tk.volID))
		paths = append(paths, p...)
	}
	sort.Strings(paths)
	stageRoot := filepath.Join(a.DriverRoot, "mnt")
	mountsBefore := volMountIDs(t, stageRoot)
	must.Eq(t, paths, volVolumeMounts(stageRoot, mountsBefore), must.Sprintf("mounts under %s: %v", stageRoot, mountsBefore))
	callsBefore := fx.Calls()
	t.Logf("before the restart: %d calls, mounts %v", len(callsBefore), mountsBefore)

	restartAt := time.Now()
	must.NoError(t, a.Restart())
	t.Logf("client restarted in %v", time.Since(restartAt).Round(time.Millisecond))
	a.WaitVolPluginHealthy(t, fx.ID, volTimeout)
	// The driver has taken every task back (its volumes' recovery runs at
	// its start, before that); the exact calls of each volume, checked
	// after the teardown below, cover any call made later.
	var allocs []string
	for _, tk := range tasks {
		allocs = append(allocs, tk.alloc)
	}
	volWaitRecovered(t, a, allocs, volTimeout)
	for _, tk := range tasks {
		al := a.WaitAllocID(t, tk.alloc, volTimeout, StatusRunning)
		must.Eq(t, tk.pids, TaskPIDs(tk.alloc, "t"), must.Sprintf("task %s has other processes after the restart", tk.name))
		must.StrContains(t, volExec(t, a, al.ID, "cat "+tk.dest+"/f && echo after > "+tk.dest+"/g && cat "+tk.dest+"/g"),
			"before-"+tk.name+"\nafter")
	}
	for _, m := range []string{"CreateVolume", "ControllerPublishVolume", "NodeStageVolume", "NodePublishVolume",
		"NodeUnpublishVolume", "NodeUnstageVolume"} {
		before, after := 0, fx.Count(m, "")
		for _, c := range callsBefore {
			if strings.HasPrefix(c, m+" ") {
				before++
			}
		}
		must.Eq(t, before, after, must.Sprintf("%s calls before and after the restart", m))
	}
	must.Eq(t, mountsBefore, volMountIDs(t, stageRoot), must.Sprint("mounts under the stage root changed"))

	for _, tk := range tasks {
		a.VolStopAndWait(t, tk.job.ID, volTimeout)
	}
	want := []string{"NodeStageVolume", "NodePublishVolume", "NodeUnpublishVolume", "NodeUnstageVolume"}
	for _, tk := range tasks {
		volWaitCount(t, fx, "NodeUnstageVolume", tk.volID, 1, 30*time.Second)
		// The stats loop may sample the volume at any time: a read
		// beside the lifecycle, not part of it.
		calls := slices.DeleteFunc(fx.VolumeCalls(tk.volID), func(m string) bool { return m == "NodeGetVolumeStats" })
		must.Eq(t, want, calls, must.Sprintf("lifecycle calls for volume %s across the restart", tk.volID))
	}
	must.SliceEmpty(t, a.WaitVolMountsGone(10*time.Second), must.Sprint("mounted after the tasks stopped"))
	must.SliceEmpty(t, VolMountedAmong(paths))
	ids := make([]string, 0, len(tasks))
	for _, tk := range tasks {
		ids = append(ids, tk.volID)
	}
	must.SliceEmpty(t, a.WaitVolJournalClear(10*time.Second, ids...), must.Sprint("journal records left"))
	t.Logf("restart: %v; calls after the restart: %v", time.Since(start).Round(time.Millisecond), fx.Calls()[len(callsBefore):])
}

// volVolumeMounts lists, sorted, the mount points of mounts (volMountIDs of
// the stage root) strictly below the stage root: the volumes' staging
// paths and targets, without the stage root's own self-bind.
func volVolumeMounts(stageRoot string, mounts map[string]string) []string {
	var out []string
	for p := range mounts {
		if p != stageRoot {
			out = append(out, p)
		}
	}
	sort.Strings(out)
	return out
}

// volWaitRecovered waits until the log of the agent's current process says
// the driver recovered the task of each allocation.
func volWaitRecovered(t *testing.T, a *Agent, allocIDs []string, timeout time.Duration) {
	t.Helper()
	timeout = Scaled(timeout)
	deadline := time.Now().Add(timeout)
	for {
		log, err := a.ReadLog()
		must.NoError(t, err)
		if i := strings.LastIndex(log, "==== harness: starting"); i >= 0 {
			log = log[i:]
		}
		var missing []string
		for _, id := range allocIDs {
			if !slices.ContainsFunc(strings.Split(log, "\n"), func(line string) bool {
				return strings.Contains(line, "task recovered") && strings.Contains(line, "alloc_id="+id)
			}) {
				missing = append(missing, id)
			}
		}
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the driver did not recover the tasks of allocations %v within %v; its log lines:\n%s", missing, timeout, a.driverLogLines(30))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// volMountIDs maps each mount point at or below dir to its mount id (field 1
// of mountinfo): a remount gets a new id.
func volMountIDs(t *testing.T, dir string) map[string]string {
	t.Helper()
	table, err := mounter.New().List()
	must.NoError(t, err)
	out := map[string]string{}
	for _, mp := range table {
		if mounter.PathWithin(mp.Path, dir) {
			out[mp.Path] += strconv.Itoa(mp.ID) + " "
		}
	}
	return out
}
