//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// A FUSE-backed volume whose plugin is killed (kill -9) is dead in the
// running task (ENOTCONN); once Nomad restarts the plugin the driver
// finds the dead mounts, unpublishes, unstages, stages and publishes the
// volume again, and attaches the fresh mount in the running task: the task
// reads its file again without being restarted, and its events say so.
func TestRepairStaleFUSEMount(t *testing.T) {
	var volID string
	// Registered first, so it runs last: after every job (the plugin too)
	// stopped, no FUSE mount of the volume is left anywhere on the host,
	// dead or alive.
	t.Cleanup(func() {
		if volID == "" {
			return
		}
		b, err := os.ReadFile("/proc/self/mountinfo")
		must.NoError(t, err)
		for _, line := range strings.Split(string(b), "\n") {
			if strings.Contains(line, "csi-fixture:"+volID) {
				t.Errorf("a FUSE mount of %s is left: %s", volID, line)
			}
		}
	})
	a := volAgent(t, false)
	// Restarted 8s after it dies: long enough to see the dead mount.
	fx := a.StartVolFixture(t, "fxfuse", VolFixtureOptions{RestartDelay: 8 * time.Second})
	name := volUniq("fuse")
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{{
		Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer", Create: true, CreateType: "fuse"}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	id := fx.VolumeID(name)
	must.NotEq(t, "", id)
	volID = id
	paths := a.VolJournalPaths(id)
	must.Eq(t, 2, len(paths), must.Sprintf("journal paths: %v", paths))
	// The volume is really FUSE, served by the plugin process.
	must.StrContains(t, volExec(t, a, al.ID, "grep ' "+dest+" ' /proc/self/mountinfo"), "fuse.csi-fixture")
	canary := "written-before-the-kill-" + name
	volExec(t, a, al.ID, fmt.Sprintf("echo %s > %s/file && cat %s/file", canary, dest, dest))
	before := a.Allocation(t, al.ID).Task("t")

	pid := fx.PID()
	must.Positive(t, pid)
	must.NoError(t, volKill(pid))
	killed := time.Now()
	t.Logf("killed the plugin (pid %d)", pid)

	// The task sees its mount dead, until the repair.
	deadline := time.Now().Add(volTimeout)
	for {
		out, _ := a.AllocExec(al.ID, "t", "/bin/sh", "-c", "cat "+dest+"/file 2>&1")
		if strings.Contains(out, "not connected") {
			t.Logf("the task sees: %s", strings.TrimSpace(out))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the task never saw its mount dead; last output %q", out)
		}
		time.Sleep(100 * time.Millisecond)
	}

	al = volWaitEvent(t, a, al.ID, `Volume "data" repaired`, volTimeout)
	repaired := time.Now()
	must.StrContains(t, volExec(t, a, al.ID, "cat "+dest+"/file"), canary)
	// Writable again, and the write lands in the volume.
	volExec(t, a, al.ID, "echo after > "+dest+"/after")
	must.StrContains(t, volExec(t, a, al.ID, "grep ' "+dest+" ' /proc/self/mountinfo"), "fuse.csi-fixture")

	// Same task, same start: it was never restarted.
	after := a.Allocation(t, al.ID).Task("t")
	must.Eq(t, before.Restarts, after.Restarts)
	must.Eq(t, before.StartedAt, after.StartedAt)
	must.Eq(t, "running", after.State)
	ev := eventsText(al, "t")
	must.StrContains(t, ev, `Volume "data" is stale`)
	for _, m := range []string{"NodeUnpublishVolume", "NodeUnstageVolume"} {
		must.Positive(t, fx.Count(m, id), must.Sprintf("%s calls: %v", m, fx.VolumeCalls(id)))
	}
	must.Eq(t, 2, fx.Count("NodeStageVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	must.Eq(t, 2, fx.Count("NodePublishVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	t.Logf("repaired %v after the kill; calls for %s: %v", repaired.Sub(killed).Round(time.Millisecond), id, fx.VolumeCalls(id))

	// volFinalCheck: the job stopped, nothing mounted, the journal clear.
	a.VolStopAndWait(t, job.ID, volTimeout)
	if left := a.WaitVolMountsGone(30*time.Second, paths...); len(left) > 0 {
		t.Fatalf("still mounted after the task stopped: %v", left)
	}
}

// A hostile task whose volume died swaps a directory on the way to its
// destination for a symlink to a directory of its choosing (/alloc, with a
// "data" in it) before the repair, to have the fresh mount land there: the
// repair refuses to follow it (its event says so and tells the task to
// restart), and nothing is mounted at the symlink's target, in the task or
// on the host.
func TestRepairStaleSymlinkSwap(t *testing.T) {
	a := volAgent(t, false)
	fx := a.StartVolFixture(t, "fxswap", VolFixtureOptions{RestartDelay: 8 * time.Second})
	name := volUniq("swap")
	// Under the task's own local dir, which the task can write.
	dest := "/local/sub/data"
	job := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{{
		Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer", Create: true, CreateType: "fuse"}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	volExec(t, a, al.ID, "echo x > "+dest+"/file")

	pid := fx.PID()
	must.Positive(t, pid)
	must.NoError(t, volKill(pid))
	// Between the death and the repair: the mount point itself cannot be
	// moved (EBUSY), but its parent can.
	volExec(t, a, al.ID, "mkdir -p /alloc/data && mv /local/sub /local/moved && ln -s /alloc /local/sub && ls -ld /local/sub")

	al = volWaitEvent(t, a, al.ID, `Repair of stale volume "data" failed`, volTimeout)
	ev := eventsText(al, "t")
	for _, e := range al.Events("t") {
		if strings.Contains(e.Text(), "Repair of stale") {
			t.Logf("event: %s", e.Text())
		}
	}
	must.StrContains(t, ev, "symlink")
	must.StrContains(t, ev, "restart the task")
	must.StrNotContains(t, ev, `Volume "data" repaired`)
	// Nothing mounted at the symlink's target, in the task or on the host.
	must.Eq(t, "", strings.TrimSpace(volExec(t, a, al.ID, "grep ' /alloc/data ' /proc/self/mountinfo || true")))
	b, err := os.ReadFile("/proc/self/mountinfo")
	must.NoError(t, err)
	must.StrNotContains(t, string(b), "/alloc/data ")
	must.Eq(t, "running", a.Allocation(t, al.ID).Task("t").State)
}

// A publish target that an operator unmounts on the host (or a plugin
// that unmounts its targets when it restarts) is no mount any more, while
// its staging mount lives: the driver's periodic check finds it, publishes
// the volume again and attaches the fresh mount in the running task, which
// was never restarted.
func TestRepairStaleUnmountedTarget(t *testing.T) {
	a := volAgent(t, false)
	fx := a.StartVolFixture(t, "fxumount", VolFixtureOptions{})
	name := volUniq("umount")
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{{
		Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer", Create: true}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	id := fx.VolumeID(name)
	must.NotEq(t, "", id)
	paths := a.VolJournalPaths(id)
	must.Eq(t, 2, len(paths), must.Sprintf("journal paths: %v", paths))
	st, err := a.VolJournal()
	must.NoError(t, err)
	target := ""
	for _, tk := range st.Tasks {
		if tk.VolumeID == id {
			target = tk.Target
		}
	}
	must.NotEq(t, "", target)
	canary := "written-before-the-umount-" + name
	volExec(t, a, al.ID, fmt.Sprintf("echo %s > %s/file && cat %s/file", canary, dest, dest))
	before := a.Allocation(t, al.ID).Task("t")

	// The operator's umount, of the host's publish target alone.
	must.NoError(t, unix.Unmount(target, 0))
	t.Logf("unmounted %s on the host", target)
	must.SliceEmpty(t, VolMountedAmong([]string{target}))

	// The next periodic check (every 30 s) repairs it.
	al = volWaitEvent(t, a, al.ID, `Volume "data" repaired`, 90*time.Second)
	must.Eq(t, []string{target}, VolMountedAmong([]string{target}))
	must.StrContains(t, volExec(t, a, al.ID, "cat "+dest+"/file"), canary)
	after := a.Allocation(t, al.ID).Task("t")
	must.Eq(t, before.Restarts, after.Restarts)
	must.Eq(t, before.StartedAt, after.StartedAt)
	must.StrContains(t, eventsText(al, "t"), `Volume "data" is stale`)
	must.Eq(t, 2, fx.Count("NodePublishVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	must.Eq(t, 1, fx.Count("NodeStageVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))

	a.VolStopAndWait(t, job.ID, volTimeout)
	if left := a.WaitVolMountsGone(30*time.Second, paths...); len(left) > 0 {
		t.Fatalf("still mounted after the task stopped: %v", left)
	}
}
