package csihook

import (
	"context"
	"os"
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
	for _, id := range []string{"alloc-a/app/11111111", "alloc-a/sidecar/33333333"} {
		must.NoError(t, h.m.Teardown(ctx, id))
	}
	must.SliceEmpty(t, h.journalRecords())
}
