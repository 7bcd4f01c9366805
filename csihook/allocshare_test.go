package csihook

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/shoenig/test/must"
)

// Nomad claims a volume per allocation: the tasks of the allocation that
// claims a single-node-writer volume all mount it. The CSI spec lets a
// SINGLE_NODE_WRITER volume be published once on a node, so the tasks of
// one allocation share one NodePublishVolume, which is unpublished when
// the last of them is gone, and not before, across a driver restart.
func TestClaims_SingleNodeWriter_TasksOfOneAllocationShareOnePublish(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	const (
		app     = "alloc-a/app/11111111"
		sidecar = "alloc-a/backup/22222222"
		other   = "alloc-b/app/33333333"
	)
	first, err := h.m.Setup(ctx, app, []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	// The plugin makes target_path (CSI spec), in the publishing task's
	// directory; the fake does not.
	must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))
	// The sidecar names the volume its own way.
	second, err := h.m.Setup(ctx, sidecar, []VolumeRequest{req("backup", "vol1", "/backup")})
	must.NoError(t, err)
	must.Len(t, 1, h.callsOf(MethodNodePublishVolume))
	must.Len(t, 1, h.callsOf(MethodNodeStageVolume))
	must.Eq(t, first[0].HostPath, second[0].HostPath, must.Sprint("both tasks bind the one publish"))
	must.Eq(t, "/backup", second[0].Destination)
	must.False(t, second[0].ReadOnly)
	must.Eq(t, 2, h.m.Users("p", "vol1"))

	// A second allocation is still refused before any call.
	h.fake.ResetCalls()
	before := h.journalRecords()
	_, err = h.m.Setup(ctx, other, []VolumeRequest{req("data", "vol1", "/data")})
	must.ErrorIs(t, err, ErrConflict)
	must.ErrorContains(t, err, `volume_id "vol1" is single-node-writer and task "alloc-a/app/11111111" of allocation "alloc-a" already has it published writable`)
	must.SliceEmpty(t, h.fake.Methods())
	must.Eq(t, before, h.journalRecords())

	// The task that published it stops first: the sidecar keeps it.
	must.NoError(t, h.m.Teardown(ctx, app))
	must.SliceEmpty(t, h.fake.Methods())
	mounted, err := h.mnt.IsMountPoint(second[0].HostPath)
	must.NoError(t, err)
	must.True(t, mounted, must.Sprint("the sidecar's volume was unpublished under it"))

	// The count is the journal's: a restart keeps it.
	h.restart()
	must.NoError(t, h.m.Recover(func(id string) bool { return id == sidecar }))
	h.waitIdle()
	must.SliceEmpty(t, h.fake.Methods())
	must.Eq(t, 1, h.m.Users("p", "vol1"))
	again, err := h.m.Setup(ctx, sidecar, []VolumeRequest{req("backup", "vol1", "/backup")})
	must.NoError(t, err)
	must.Eq(t, second[0].HostPath, again[0].HostPath)
	must.SliceEmpty(t, h.fake.Methods())

	// The last task of the allocation stops: unpublished and unstaged
	// once each, nothing left.
	must.NoError(t, h.m.Teardown(ctx, sidecar))
	must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
	must.Eq(t, second[0].HostPath, h.callsOf(MethodNodeUnpublishVolume)[0].TargetPath)
	must.Len(t, 1, h.callsOf(MethodNodeUnstageVolume))
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, publishDirs(t, h))

	// Now the other allocation may have it.
	_, err = h.m.Setup(ctx, other, []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.NoError(t, h.m.Teardown(ctx, other))
}

// Recovery drops the record of a task of the allocation that is gone
// without unpublishing what a live task of it still uses, and unpublishes
// once when none is left.
func TestClaims_SingleNodeWriter_RecoveryKeepsTheAllocationsPublish(t *testing.T) {
	for _, tc := range []struct {
		name string
		// gone: the tasks gone at the first recovery.
		gone []string
	}{
		{"publisher gone first", []string{"alloc-a/app/11111111"}},
		{"sharer gone first", []string{"alloc-a/backup/22222222"}},
		{"both gone", []string{"alloc-a/app/11111111", "alloc-a/backup/22222222"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			ctx := context.Background()
			tasks := []string{"alloc-a/app/11111111", "alloc-a/backup/22222222"}
			target := h.shareData(ctx, tasks...)
			// The plugin makes target_path (CSI spec); the fake does not.
			must.NoError(t, os.MkdirAll(target, 0o750))
			must.Len(t, 1, h.callsOf(MethodNodePublishVolume))
			h.fake.ResetCalls()

			h.restart()
			gone := map[string]bool{}
			for _, id := range tc.gone {
				gone[id] = true
			}
			must.NoError(t, h.m.Recover(func(id string) bool { return !gone[id] }))
			h.waitIdle()
			if len(tc.gone) < len(tasks) {
				must.SliceEmpty(t, h.fake.Methods())
				must.Eq(t, 1, h.m.Users("p", "vol1"))
				mounted, err := h.mnt.IsMountPoint(target)
				must.NoError(t, err)
				must.True(t, mounted)
				h.restart()
				must.NoError(t, h.m.Recover(func(string) bool { return false }))
				h.waitIdle()
			}
			must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
			must.Eq(t, target, h.callsOf(MethodNodeUnpublishVolume)[0].TargetPath)
			must.Len(t, 1, h.callsOf(MethodNodeUnstageVolume))
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
			must.SliceEmpty(t, publishDirs(t, h))
		})
	}
}

// publishDirs lists what is left in the publish root.
func publishDirs(t *testing.T, h *harness) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(h.root, "publish"))
	must.NoError(t, err)
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

// Nomad lets a task claim a multi-node-multi-writer volume read-only: it is
// published for that task read-only, beside the writers.
func TestClaims_MultiNodeMultiWriter_ReadOnlyTask(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	mnmw := func(readOnly bool) VolumeRequest {
		r := req("data", "vol1", "/data")
		r.AccessMode, r.ReadOnly = AccessMultiNodeMultiWriter, readOnly
		return r
	}
	w, err := h.m.Setup(ctx, "alloc-a/writer/11111111", []VolumeRequest{mnmw(false)})
	must.NoError(t, err)
	must.False(t, w[0].ReadOnly)
	r, err := h.m.Setup(ctx, "alloc-b/reader/22222222", []VolumeRequest{mnmw(true)})
	must.NoError(t, err)
	must.True(t, r[0].ReadOnly)
	np := h.callsOf(MethodNodePublishVolume)
	must.Len(t, 2, np)
	must.False(t, np[0].Readonly)
	must.True(t, np[1].Readonly)
	h.teardownAll(ctx, "alloc-a/writer/11111111", "alloc-b/reader/22222222")
	must.SliceEmpty(t, h.journalRecords())
}

// Nomad starts the tasks of a group together: the ones that find the
// volume being published wait for that publish and share it.
func TestClaims_SingleNodeWriter_TasksOfOneAllocationStartTogether(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	tasks := []string{"alloc-a/app/11111111", "alloc-a/backup/22222222", "alloc-a/logs/33333333"}
	pubs := make([][]Published, len(tasks))
	errs := make([]error, len(tasks))
	var wg sync.WaitGroup
	for i, id := range tasks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pubs[i], errs[i] = h.m.Setup(ctx, id, []VolumeRequest{req("data", "vol1", "/data")})
		}()
	}
	wg.Wait()
	for i := range tasks {
		must.NoError(t, errs[i])
		must.Eq(t, pubs[0][0].HostPath, pubs[i][0].HostPath)
	}
	must.Len(t, 1, h.callsOf(MethodNodePublishVolume))
	h.teardownAll(ctx, tasks...)
	must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
	must.Len(t, 1, h.callsOf(MethodNodeUnstageVolume))
	must.SliceEmpty(t, h.journalRecords())
}

// A restarted driver that finds the allocation's shared publish gone (a
// reboot) publishes it again once, for every task of the allocation.
func TestClaims_SingleNodeWriter_RecoveryRepublishesTheSharedTargetOnce(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	tasks := []string{"alloc-a/app/11111111", "alloc-a/backup/22222222"}
	target := h.shareData(ctx, tasks...)
	h.restart()
	must.NoError(t, h.mnt.Unmount(target))
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	h.waitIdle()
	must.Len(t, 1, h.callsOf(MethodNodePublishVolume))
	must.Eq(t, target, h.callsOf(MethodNodePublishVolume)[0].TargetPath)
	h.teardownAll(ctx, tasks...)
	must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
	must.SliceEmpty(t, h.journalRecords())
}

// A dead shared publish (a FUSE plugin restarted) is unpublished and
// published again once, and every task of the allocation hears of it, to
// bind it afresh.
func TestClaims_SingleNodeWriter_RepairOfTheSharedPublish(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	tasks := []string{"alloc-a/app/11111111", "alloc-a/backup/22222222"}
	target := h.shareData(ctx, tasks...)
	h.mnt.SetStale(target, true)
	h.fake.ResetCalls()
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodePublishVolume}, h.fake.Methods())
	must.Len(t, 2, rep)
	for i, r := range rep {
		must.Eq(t, tasks[i], r.TaskID)
		must.Eq(t, target, r.HostPath)
	}
	h.teardownAll(ctx, tasks...)
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}

// shareData sets volume "data" (vol1 of plugin p, at /data) up for each
// task in turn, tasks of one allocation sharing one publish, and returns
// its target, which each of them must have been given.
func (h *harness) shareData(ctx context.Context, tasks ...string) string {
	h.t.Helper()
	var target string
	for _, id := range tasks {
		pubs, err := h.m.Setup(ctx, id, []VolumeRequest{req("data", "vol1", "/data")})
		must.NoError(h.t, err)
		if target == "" {
			target = pubs[0].HostPath
		}
		must.Eq(h.t, target, pubs[0].HostPath, must.Sprintf("task %s", id))
	}
	return target
}

// teardownAll tears each task down, which must succeed.
func (h *harness) teardownAll(ctx context.Context, tasks ...string) {
	h.t.Helper()
	for _, id := range tasks {
		must.NoError(h.t, h.m.Teardown(ctx, id))
	}
}
