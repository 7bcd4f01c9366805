package csihook

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/shoenig/test/must"
)

// The task that published an allocation's single-node-writer volume
// restarts (Nomad destroys the old invocation and starts a new one, a new
// task id): the new invocation shares the publish the sidecar kept, in the
// old invocation's directory, which goes when the last task does.
func TestClaims_SingleNodeWriter_PublisherRestartsAndShares(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	const (
		app1    = "alloc-a/app/11111111"
		sidecar = "alloc-a/backup/22222222"
		app2    = "alloc-a/app/33333333"
	)
	first, err := h.m.Setup(ctx, app1, []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))
	_, err = h.m.Setup(ctx, sidecar, []VolumeRequest{req("backup", "vol1", "/backup")})
	must.NoError(t, err)
	must.NoError(t, h.m.Teardown(ctx, app1))
	again, err := h.m.Setup(ctx, app2, []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.Eq(t, first[0].HostPath, again[0].HostPath)
	must.Len(t, 1, h.callsOf(MethodNodePublishVolume))
	must.Len(t, 0, h.callsOf(MethodNodeUnpublishVolume))

	must.NoError(t, h.m.Teardown(ctx, sidecar))
	must.Len(t, 0, h.callsOf(MethodNodeUnpublishVolume))
	mounted, err := h.mnt.IsMountPoint(first[0].HostPath)
	must.NoError(t, err)
	must.True(t, mounted)
	must.NoError(t, h.m.Teardown(ctx, app2))
	must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
	must.Len(t, 1, h.callsOf(MethodNodeUnstageVolume))
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, publishDirs(t, h))
}

// A plugin with VOLUME_MOUNT_GROUP applies the group it is sent with the
// publish. A task of the allocation that runs as another group than the
// publish was made with cannot share it without the plugin making it
// writable for its group: it is refused, before any call, rather than
// handed a publish without its group.
func TestClaims_SingleNodeWriter_SharingTaskWithAnotherPluginMountGroup(t *testing.T) {
	h := newHarness(t)
	p := fullPlugin("p")
	p.VolumeMountGroup = true
	h.setPlugin(p)
	ctx := context.Background()
	// The app runs as root: no group is sent.
	first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))
	h.fake.ResetCalls()
	before := h.journalRecords()

	r := req("data", "vol1", "/data")
	r.MountGroup = "65534"
	_, err = h.m.Setup(ctx, "alloc-a/sidecar/22222222", []VolumeRequest{r})
	must.ErrorIs(t, err, ErrConflict)
	must.ErrorContains(t, err, "65534")
	must.SliceEmpty(t, h.fake.Methods())
	must.Eq(t, before, h.journalRecords())

	must.NoError(t, h.m.Teardown(ctx, "alloc-a/app/11111111"))
	must.SliceEmpty(t, h.journalRecords())
}

// The volume context is sent with NodePublishVolume: a task of the
// allocation asking for another context than the one the shared publish
// was made with would silently get the first task's. It is refused, as
// other mount_flags are, and nothing of it is kept.
func TestClaims_SingleNodeWriter_SharingTaskWithAnotherContext(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))
	h.fake.ResetCalls()
	before := h.journalRecords()

	r := req("data", "vol1", "/data")
	r.Context = map[string]string{"ctx": "other"}
	_, err = h.m.Setup(ctx, "alloc-a/sidecar/22222222", []VolumeRequest{r})
	must.ErrorIs(t, err, ErrConflict)
	must.ErrorContains(t, err, "context")
	must.SliceEmpty(t, h.fake.Methods())
	must.Eq(t, before, h.journalRecords())

	// The same context shares.
	_, err = h.m.Setup(ctx, "alloc-a/sidecar/33333333", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.SliceEmpty(t, h.fake.Methods())
	h.teardownAll(ctx, "alloc-a/app/11111111", "alloc-a/sidecar/33333333")
	must.SliceEmpty(t, h.journalRecords())
}

// A task of the allocation that starts while the shared publish is not
// mounted (the plugin lost it, and no repair ran yet) publishes it again,
// at the same target, and the target is unpublished once, with the last.
func TestClaims_SingleNodeWriter_SharingTaskFindsThePublishUnmounted(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	target := first[0].HostPath
	must.NoError(t, os.MkdirAll(target, 0o750))
	must.NoError(t, h.mnt.Unmount(target))
	h.fake.ResetCalls()
	second, err := h.m.Setup(ctx, "alloc-a/sidecar/22222222", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.Eq(t, target, second[0].HostPath)
	must.Len(t, 1, h.callsOf(MethodNodePublishVolume))
	must.Eq(t, target, h.callsOf(MethodNodePublishVolume)[0].TargetPath)
	mounted, err := h.mnt.IsMountPoint(target)
	must.NoError(t, err)
	must.True(t, mounted)

	must.NoError(t, h.m.Teardown(ctx, "alloc-a/app/11111111"))
	must.Len(t, 0, h.callsOf(MethodNodeUnpublishVolume))
	must.NoError(t, h.m.Teardown(ctx, "alloc-a/sidecar/22222222"))
	must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, publishDirs(t, h))
}

// One task of the allocation stops while another starts: whichever goes
// first, the starting task ends with the volume mounted, nothing is
// published twice at once, and nothing is left once it stops too.
func TestClaims_SingleNodeWriter_OneTaskStopsAsAnotherStarts(t *testing.T) {
	for i := 0; i < 20; i++ {
		h := newHarness(t)
		ctx := context.Background()
		first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{req("data", "vol1", "/data")})
		must.NoError(t, err)
		must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))
		var (
			wg      sync.WaitGroup
			pubs    []Published
			setErr  error
			downErr error
		)
		wg.Add(2)
		go func() {
			defer wg.Done()
			pubs, setErr = h.m.Setup(ctx, "alloc-a/sidecar/22222222", []VolumeRequest{req("data", "vol1", "/data")})
		}()
		go func() {
			defer wg.Done()
			downErr = h.m.Teardown(ctx, "alloc-a/app/11111111")
		}()
		wg.Wait()
		must.NoError(t, setErr)
		must.NoError(t, downErr)
		mounted, err := h.mnt.IsMountPoint(pubs[0].HostPath)
		must.NoError(t, err)
		must.True(t, mounted, must.Sprintf("round %d: the starting task's volume is not mounted", i))
		must.NoError(t, h.m.Teardown(ctx, "alloc-a/sidecar/22222222"))
		must.SliceEmpty(t, h.journalRecords())
		must.SliceEmpty(t, h.mountPaths())
		must.Eq(t, len(h.callsOf(MethodNodePublishVolume)), len(h.callsOf(MethodNodeUnpublishVolume)))
	}
}

// After a reboot (publish directories gone with a tmpfs root) the task
// that published the allocation's volume is gone and the sidecar lives:
// the sidecar's record is re-published at the target it names, in the
// gone task's directory, once; its teardown leaves nothing.
func TestClaims_SingleNodeWriter_RecoveryRepublishesForTheSharerAlone(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	const app, sidecar = "alloc-a/app/11111111", "alloc-a/backup/22222222"
	target := h.shareData(ctx, app, sidecar)
	h.restart()
	for _, p := range h.mountPaths() {
		must.NoError(t, h.mnt.Unmount(p))
	}
	must.NoError(t, os.RemoveAll(filepath.Dir(target)))
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(id string) bool { return id == sidecar }))
	h.waitIdle()
	must.Len(t, 1, h.callsOf(MethodNodePublishVolume))
	must.Len(t, 0, h.callsOf(MethodNodeUnpublishVolume))
	must.Eq(t, target, h.callsOf(MethodNodePublishVolume)[0].TargetPath)
	must.Eq(t, 1, h.m.Users("p", "vol1"))
	must.NoError(t, h.m.Teardown(ctx, sidecar))
	must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, publishDirs(t, h))
}

// A plugin with VOLUME_MOUNT_GROUP applies the group it is sent with the
// publish. The shared publish of a task running as a group and a sidecar
// running as root, made again after a restart, is made for the group, not
// for whichever of the two records the restarted driver sees first.
func TestClaims_SingleNodeWriter_RepublishKeepsThePluginMountGroup(t *testing.T) {
	for i := 0; i < 10; i++ {
		h := newHarness(t)
		p := fullPlugin("p")
		p.VolumeMountGroup = true
		h.setPlugin(p)
		ctx := context.Background()
		const app, sidecar = "alloc-a/app/11111111", "alloc-a/aa-root/22222222"
		// No secrets: the repair after the restart needs none.
		r := req("data", "vol1", "/data")
		r.Secrets = nil
		root := r
		r.MountGroup = "65534"
		first, err := h.m.Setup(ctx, app, []VolumeRequest{r})
		must.NoError(t, err)
		target := first[0].HostPath
		must.NoError(t, os.MkdirAll(target, 0o750))
		_, err = h.m.Setup(ctx, sidecar, []VolumeRequest{root})
		must.NoError(t, err)

		h.restart()
		must.NoError(t, h.mnt.Unmount(target))
		h.fake.ResetCalls()
		must.NoError(t, h.m.Recover(func(string) bool { return true }))
		h.waitIdle()
		np := h.callsOf(MethodNodePublishVolume)
		must.Len(t, 1, np)
		must.Eq(t, "65534", np[0].Capability.GetMount().GetVolumeMountGroup(), must.Sprintf("round %d", i))

		h.mnt.SetStale(target, true)
		h.fake.ResetCalls()
		_, err = h.m.RepairStale(ctx, "p")
		must.NoError(t, err)
		np = h.callsOf(MethodNodePublishVolume)
		must.Len(t, 1, np)
		must.Eq(t, "65534", np[0].Capability.GetMount().GetVolumeMountGroup(), must.Sprintf("repair, round %d", i))
		h.teardownAll(ctx, app, sidecar)
		must.SliceEmpty(t, h.journalRecords())
	}
}

// A volume this node created shares as any other: the tasks of the
// allocation, with or without the create block, resolve it to the same
// plugin id and context.
func TestClaims_SingleNodeWriter_CreatedVolumeShares(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	withCreate := req("data", "vol1", "/data")
	withCreate.Create = &CreateRequest{}
	first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{withCreate})
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))
	for _, r := range []VolumeRequest{withCreate, req("data", "vol1", "/data")} {
		id := "alloc-a/sidecar-" + map[bool]string{true: "c", false: "n"}[r.Create != nil] + "/22222222"
		pubs, err := h.m.Setup(ctx, id, []VolumeRequest{r})
		must.NoError(t, err)
		must.Eq(t, first[0].HostPath, pubs[0].HostPath)
	}
	must.Len(t, 1, h.callsOf(MethodNodePublishVolume))
	h.teardownAll(ctx, "alloc-a/app/11111111", "alloc-a/sidecar-c/22222222", "alloc-a/sidecar-n/22222222")
	must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
	must.SliceEmpty(t, h.journalRecords())
}

// The context the journal keeps is the one a task of the allocation
// started after a driver restart compares its own with.
func TestClaims_SingleNodeWriter_SharesAfterARestart(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	withCreate := req("data", "vol1", "/data")
	withCreate.Create = &CreateRequest{}
	first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{withCreate})
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))
	h.restart()
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	h.waitIdle()
	h.fake.ResetCalls()
	pubs, err := h.m.Setup(ctx, "alloc-a/sidecar/22222222", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.Eq(t, first[0].HostPath, pubs[0].HostPath)
	must.SliceEmpty(t, h.fake.Methods())
	h.teardownAll(ctx, "alloc-a/app/11111111", "alloc-a/sidecar/22222222")
	must.SliceEmpty(t, h.journalRecords())
}

// Two tasks of the allocation start while the one that published the
// volume stops: each starting task ends with the volume mounted where it
// binds it, and once they stop nothing is left, every publish undone.
func TestClaims_SingleNodeWriter_TwoStartOneStops(t *testing.T) {
	for i := 0; i < 20; i++ {
		h := newHarness(t)
		ctx := context.Background()
		first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{req("data", "vol1", "/data")})
		must.NoError(t, err)
		must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))
		starting := []string{"alloc-a/one/22222222", "alloc-a/two/33333333"}
		pubs := make([][]Published, len(starting))
		errs := make([]error, len(starting)+1)
		var wg sync.WaitGroup
		for j, id := range starting {
			wg.Add(1)
			go func() {
				defer wg.Done()
				pubs[j], errs[j] = h.m.Setup(ctx, id, []VolumeRequest{req("data", "vol1", "/data")})
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[len(starting)] = h.m.Teardown(ctx, "alloc-a/app/11111111")
		}()
		wg.Wait()
		for j := range errs {
			must.NoError(t, errs[j], must.Sprintf("round %d", i))
		}
		for j := range starting {
			mounted, err := h.mnt.IsMountPoint(pubs[j][0].HostPath)
			must.NoError(t, err)
			must.True(t, mounted, must.Sprintf("round %d: %s", i, starting[j]))
		}
		must.Eq(t, pubs[0][0].HostPath, pubs[1][0].HostPath, must.Sprintf("round %d: one publish", i))
		h.teardownAll(ctx, starting...)
		must.SliceEmpty(t, h.journalRecords())
		must.SliceEmpty(t, h.mountPaths())
		must.Eq(t, len(h.callsOf(MethodNodePublishVolume)), len(h.callsOf(MethodNodeUnpublishVolume)))
	}
}
