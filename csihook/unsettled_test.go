package csihook

import (
	"context"
	"errors"
	"os"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A task of the allocation that starts while another task's unpublish of
// their single-node-writer volume failed (retried in the background) is
// refused with a conflict that passes (ErrUnsettled): once the unpublish
// is done, the same request works. The other conflicts do not pass.
func TestClaims_SingleNodeWriter_UnsettledPublishPasses(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.RetryAttempts = 1 })
	ctx := context.Background()
	first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))

	// Another context: a conflict that stays.
	r := req("data", "vol1", "/data")
	r.Context = map[string]string{"ctx": "other"}
	_, err = h.m.Setup(ctx, "alloc-a/sidecar/22222222", []VolumeRequest{r})
	must.ErrorIs(t, err, ErrConflict)
	must.False(t, errors.Is(err, ErrUnsettled), must.Sprint("a conflict that stays is unsettled"))

	h.fake.SetError(MethodNodeUnpublishVolume, status.Error(codes.Internal, "stuck"))
	must.Error(t, h.m.Teardown(ctx, "alloc-a/app/11111111"))
	_, err = h.m.Setup(ctx, "alloc-a/sidecar/33333333", []VolumeRequest{req("data", "vol1", "/data")})
	must.ErrorContains(t, err, "is being published or unpublished on this node for another task of this allocation")
	must.ErrorIs(t, err, ErrConflict)
	must.ErrorIs(t, err, ErrUnsettled)

	h.fake.SetError(MethodNodeUnpublishVolume, nil)
	must.NoError(t, h.m.Teardown(ctx, "alloc-a/app/11111111"))
	_, err = h.m.Setup(ctx, "alloc-a/sidecar/33333333", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.teardownAll(ctx, "alloc-a/sidecar/33333333")
	must.SliceEmpty(t, h.journalRecords())
}

// A task of another allocation whose unpublish of a single-node-writer
// volume failed (retried in the background: that allocation is being
// stopped, as in a job's update that places the new allocation on the
// same node) refuses a new allocation's task with a conflict that passes
// (ErrUnsettled), and the same request works once the unpublish is done.
// Another allocation that has the volume published, alive, refuses it
// with a conflict that stays.
func TestClaims_SingleNodeWriter_OtherAllocationUnpublishingPasses(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.RetryAttempts = 1 })
	ctx := context.Background()
	first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))

	_, err = h.m.Setup(ctx, "alloc-b/app/22222222", []VolumeRequest{req("data", "vol1", "/data")})
	must.ErrorIs(t, err, ErrConflict)
	must.False(t, errors.Is(err, ErrUnsettled), must.Sprintf("another allocation's live publish passes: %v", err))

	h.fake.SetError(MethodNodeUnpublishVolume, status.Error(codes.Internal, "stuck"))
	must.Error(t, h.m.Teardown(ctx, "alloc-a/app/11111111"))
	_, err = h.m.Setup(ctx, "alloc-b/app/33333333", []VolumeRequest{req("data", "vol1", "/data")})
	must.ErrorIs(t, err, ErrConflict)
	must.ErrorIs(t, err, ErrUnsettled)
	must.ErrorContains(t, err, `task "alloc-a/app/11111111" of allocation "alloc-a", which had it published on this node, is still unpublishing it`)

	h.fake.SetError(MethodNodeUnpublishVolume, nil)
	must.NoError(t, h.m.Teardown(ctx, "alloc-a/app/11111111"))
	_, err = h.m.Setup(ctx, "alloc-b/app/33333333", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.teardownAll(ctx, "alloc-b/app/33333333")
	must.SliceEmpty(t, h.journalRecords())
}

// The same for a multi-node-single-writer volume that another
// allocation's writer is still unpublishing.
func TestClaims_MultiNodeSingleWriter_OtherAllocationUnpublishingPasses(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.RetryAttempts = 1 })
	ctx := context.Background()
	mnsw := func() VolumeRequest {
		r := req("data", "vol1", "/data")
		r.AccessMode = AccessMultiNodeSingleWriter
		return r
	}
	first, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{mnsw()})
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(first[0].HostPath, 0o750))

	_, err = h.m.Setup(ctx, "alloc-b/app/22222222", []VolumeRequest{mnsw()})
	must.ErrorIs(t, err, ErrConflict)
	must.False(t, errors.Is(err, ErrUnsettled), must.Sprintf("another allocation's live writer passes: %v", err))

	h.fake.SetError(MethodNodeUnpublishVolume, status.Error(codes.Internal, "stuck"))
	must.Error(t, h.m.Teardown(ctx, "alloc-a/app/11111111"))
	_, err = h.m.Setup(ctx, "alloc-b/app/33333333", []VolumeRequest{mnsw()})
	must.ErrorIs(t, err, ErrUnsettled)
	must.ErrorContains(t, err, "is multi-node-single-writer and task \"alloc-a/app/11111111\"")

	h.fake.SetError(MethodNodeUnpublishVolume, nil)
	must.NoError(t, h.m.Teardown(ctx, "alloc-a/app/11111111"))
	_, err = h.m.Setup(ctx, "alloc-b/app/33333333", []VolumeRequest{mnsw()})
	must.NoError(t, err)
	h.teardownAll(ctx, "alloc-b/app/33333333")
	must.SliceEmpty(t, h.journalRecords())
}
