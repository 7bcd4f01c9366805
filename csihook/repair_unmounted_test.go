package csihook

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// A publish target that is no mount any more (a plugin that unmounted its
// targets when it restarted, an operator's umount) is dead: the task's
// copy of it is dead or an empty directory. It is published again, and
// the task told, like a target whose mount is dead.
func TestRepairStale_UnmountedTargetIsRepaired(t *testing.T) {
	h := newHarness(t)
	target := h.setupData()
	staging := h.m.StagingPath("p", "vol1")
	must.NoError(t, h.mnt.Unmount(target))
	h.fake.ResetCalls()

	rep, err := h.m.RepairStale(context.Background(), "p")
	must.NoError(t, err)
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodePublishVolume}, h.fake.Methods())
	must.Eq(t, []Repaired{{TaskID: "task-a", Name: "data", PluginID: "p", VolumeID: "vol1",
		HostPath: target, Destination: "/data"}}, rep)
	must.True(t, containsEvent(h.eventMsgs(), `Volume "data" is stale`), must.Sprint(h.eventMsgs()))
	must.Eq(t, []string{staging, target}, h.mountPaths())

	// Mounted again: the next pass leaves it alone.
	h.fake.ResetCalls()
	rep, err = h.m.RepairStale(context.Background(), "p")
	must.NoError(t, err)
	must.SliceEmpty(t, rep)
	must.SliceEmpty(t, h.fake.Methods())
}

// A staging path is the plugin's (CSI spec): a plugin may stage without a
// mount (a block volume's staging, a plugin that keeps only state there).
// Only its publish targets must be mounts: a volume staged without a mount
// and published is healthy, and left alone.
func TestRepairStale_StagingWithoutMountIsHealthy(t *testing.T) {
	h := newHarness(t)
	target := h.setupData()
	staging := h.m.StagingPath("p", "vol1")
	must.NoError(t, h.mnt.Unmount(staging))
	must.Eq(t, []string{target}, h.mountPaths())
	h.fake.ResetCalls()

	rep, err := h.m.RepairStale(context.Background(), "p")
	must.NoError(t, err)
	must.SliceEmpty(t, rep)
	must.SliceEmpty(t, h.fake.Methods())
}

// A repaired target unmounted again before a check saw it mounted relapsed,
// as one whose mount died again does: its repair backs off, and the task is
// told once, rather than its back-off ending as if the mount held.
func TestRepairStale_UnmountedAgainBacksOff(t *testing.T) {
	h, clock, target := newRelapseHarness(t)
	var published []int
	for i := range 6 {
		must.NoError(t, h.mnt.Unmount(target))
		if h.pass(clock) > 0 {
			published = append(published, i)
		}
	}
	// As TestRepairStale_RelapsingVolumeBacksOff: 0 repairs; 1 relapses
	// (20 s: 2 repairs); 3 relapses (40 s: 5 repairs).
	must.Eq(t, []int{0, 2, 5}, published, must.Sprint(h.eventMsgs()))
	must.Eq(t, 1, countEvents(h, relapseEvent), must.Sprint(h.eventMsgs()))

	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
}

// notMounted against the kernel: a publish target is alive only while a
// mount is at the path itself, whether a directory's bind or a block
// volume's (a device file bound on a file), and never through a symbolic
// link.
func TestNotMounted_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("test needs root: it mounts")
	}
	dir := t.TempDir()
	// Private, so nothing made here propagates to the host's namespace.
	must.NoError(t, unix.Mount(dir, dir, "", unix.MS_BIND, ""))
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	must.NoError(t, unix.Mount("", dir, "", unix.MS_PRIVATE, ""))

	bindDir := filepath.Join(dir, "dir")
	must.NoError(t, os.Mkdir(bindDir, 0o755))
	must.NoError(t, unix.Mount(t.TempDir(), bindDir, "", unix.MS_BIND, ""))
	t.Cleanup(func() { _ = unix.Unmount(bindDir, unix.MNT_DETACH) })

	// A block volume's target: a file with a device node bound on it.
	bindDev := filepath.Join(dir, "block")
	must.NoError(t, os.WriteFile(bindDev, nil, 0o600))
	must.NoError(t, unix.Mount("/dev/null", bindDev, "", unix.MS_BIND, ""))
	t.Cleanup(func() { _ = unix.Unmount(bindDev, unix.MNT_DETACH) })

	plainDir := filepath.Join(dir, "plain")
	must.NoError(t, os.Mkdir(plainDir, 0o755))
	plainFile := filepath.Join(dir, "file")
	must.NoError(t, os.WriteFile(plainFile, nil, 0o600))
	link := filepath.Join(dir, "link")
	must.NoError(t, os.Symlink(bindDir, link))

	m := mounter.New()
	for _, tc := range []struct {
		path string
		want bool
	}{
		{bindDir, false},
		{bindDev, false},
		{plainDir, true},
		{plainFile, true},
		{link, true},
		{filepath.Join(dir, "missing"), true},
	} {
		got, err := notMounted(m, tc.path, true)
		must.NoError(t, err)
		must.Eq(t, tc.want, got, must.Sprintf("notMounted(%q)", tc.path))
	}

	// A target published without a mount: a device node the plugin made
	// there (mknod, as a block plugin may) is alive; gone, or a symbolic
	// link, it is dead.
	node := filepath.Join(dir, "node")
	must.NoError(t, unix.Mknod(node, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3))))
	for _, tc := range []struct {
		path string
		want bool
	}{
		{node, false},
		{link, true},
		{filepath.Join(dir, "missing"), true},
	} {
		got, err := notMounted(m, tc.path, false)
		must.NoError(t, err)
		must.Eq(t, tc.want, got, must.Sprintf("notMounted(%q) of a publish without a mount", tc.path))
	}
}

// A plugin may publish without a mount: the CSI spec has it publish at
// target_path, and one that makes a block volume's device node there by
// mknod(2) leaves no mount. Such a target, no mount right after its
// publish too, is no mount that died: it is left alone, not unpublished
// and published again under the running task at every check (and the
// task told to restart for a plugin that keeps losing it).
func TestRepairStale_TargetPublishedWithoutMountIsLeftAlone(t *testing.T) {
	h := newHarness(t)
	h.fake.PublishWithoutMount = true
	target := h.setupData()
	fi, err := os.Lstat(target)
	must.NoError(t, err)
	must.True(t, fi.Mode().IsRegular())

	for range 3 {
		h.fake.ResetCalls()
		rep, err := h.m.RepairStale(context.Background(), "p")
		must.NoError(t, err)
		must.SliceEmpty(t, rep)
		must.SliceEmpty(t, h.fake.Methods())
	}
	must.False(t, containsEvent(h.eventMsgs(), `is stale`), must.Sprint(h.eventMsgs()))

	// Gone from its path (the plugin removed it) or a symlink, it is dead
	// as any publish target is.
	must.NoError(t, os.Remove(target))
	h.fake.ResetCalls()
	rep, err := h.m.RepairStale(context.Background(), "p")
	must.NoError(t, err)
	must.Len(t, 1, rep)
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodePublishVolume}, h.fake.Methods())
	_, err = os.Lstat(target)
	must.NoError(t, err)

	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
	must.SliceEmpty(t, h.journalRecords())
}

// A driver restart does not publish again a live task's volume that its
// plugin published without a mount (a device node at the target): the
// target is no mount because it never was one, not because it was lost.
func TestRecover_TargetPublishedWithoutMountIsKept(t *testing.T) {
	h := newHarness(t)
	h.fake.PublishWithoutMount = true
	target := h.setupData()

	h.restart()
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(id string) bool { return id == "task-a" }))
	h.waitIdle()
	must.SliceEmpty(t, h.fake.Methods())
	must.False(t, containsEvent(h.eventMsgs(), `Re-publishing volume`), must.Sprint(h.eventMsgs()))
	_, err := os.Lstat(target)
	must.NoError(t, err)

	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
	must.SliceEmpty(t, h.journalRecords())
}

// A publish its plugin made without a mount (Unmounted) is a publish for
// every setup that asks whether the target is published: the tasks of an
// allocation share it (a read-only sidecar binds it read-only) rather than
// publish it a second time at the same target, where a plugin that checks
// would refuse another readonly flag (ALREADY_EXISTS, CSI spec); and a
// task's setup run again finds it published and calls nothing.
func TestSetup_TargetPublishedWithoutMountIsShared(t *testing.T) {
	h := newHarness(t)
	h.fake.PublishWithoutMount = true
	ctx := context.Background()
	const (
		app     = "alloc-a/app/11111111"
		sidecar = "alloc-a/backup/22222222"
	)
	first, err := h.m.Setup(ctx, app, []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)

	h.fake.ResetCalls()
	_, err = h.m.Setup(ctx, app, []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.SliceEmpty(t, h.fake.Methods())

	reader := req("backup", "vol1", "/backup")
	reader.ReadOnly = true
	second, err := h.m.Setup(ctx, sidecar, []VolumeRequest{reader})
	must.NoError(t, err)
	must.SliceEmpty(t, h.fake.Methods())
	must.Eq(t, first[0].HostPath, second[0].HostPath)
	must.True(t, second[0].ReadOnly)
	must.True(t, containsEvent(h.eventMsgs(), `sharing its publish for task "`+app+`"`), must.Sprint(h.eventMsgs()))

	// The sidecar's record is one of a publish without a mount too: a
	// check leaves it alone.
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceEmpty(t, rep)
	must.SliceEmpty(t, h.fake.Methods())

	must.NoError(t, h.m.Teardown(ctx, app))
	must.SliceEmpty(t, h.fake.Methods())
	must.NoError(t, h.m.Teardown(ctx, sidecar))
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())
}

// Which kind a target is (a mount, or a publish without one) is decided at
// its publish, not at a repair's: a target that had a mount, repaired by a
// plugin that answers OK and mounts nothing, is a failed repair, tried
// again, and never taken for a publish without a mount, which would leave
// the task on an empty directory no check looks at again.
func TestRepairStale_RepairWithoutMountOfAMountFails(t *testing.T) {
	h := newHarness(t, noRepairBackoff)
	ctx := context.Background()
	target := h.setupData()
	must.NoError(t, h.mnt.Unmount(target))

	h.fake.PublishWithoutMount = true
	for pass := range 2 {
		h.fake.ResetCalls()
		rep, err := h.m.RepairStale(ctx, "p")
		must.Error(t, err, must.Sprintf("pass %d", pass))
		must.ErrorContains(t, err, "left no mount")
		must.SliceEmpty(t, rep)
		must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodePublishVolume}, h.fake.Methods(), must.Sprintf("pass %d", pass))
	}
	must.True(t, containsEvent(h.eventMsgs(), `left no mount`), must.Sprint(h.eventMsgs()))

	// The plugin mounts again: the next pass repairs it, and the one
	// after finds it alive.
	h.fake.PublishWithoutMount = false
	h.fake.ResetCalls()
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.Len(t, 1, rep)
	mounted, err := h.mnt.IsMountPoint(target)
	must.NoError(t, err)
	must.True(t, mounted)
	h.fake.ResetCalls()
	rep, err = h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceEmpty(t, rep)
	must.SliceEmpty(t, h.fake.Methods())

	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.journalRecords())
}
