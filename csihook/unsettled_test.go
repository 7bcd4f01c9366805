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
