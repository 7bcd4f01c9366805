package csihook

import (
	"context"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A stage made again for a plugin that forgot it (see
// TestSpec_PublishNotStagedStagesAgain) that the plugin refuses fails the
// starting task alone: the task that has the volume keeps its mount, the
// record says the stage is uncertain, and a driver restart stages it again
// before anything else; the last task's teardown then unstages it.
func TestSpec_RestageRefusedLeavesOthersAndRecovers(t *testing.T) {
	var p *stageForgetting
	h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return p, nil } })
	p = &stageForgetting{FakeClient: h.fake, staged: map[string]bool{}}
	ctx := context.Background()
	multi := func(r VolumeRequest) VolumeRequest { r.AccessMode = AccessMultiNodeMultiWriter; return r }

	_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.NoError(t, err)
	p.forget()
	h.fake.ResetCalls()
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.InvalidArgument, "refused"))
	_, err = h.m.Setup(ctx, "b", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.ErrorContains(t, err, "InvalidArgument: refused")
	must.Eq(t, []string{MethodNodeStageVolume, MethodNodeUnpublishVolume}, h.fake.Methods())
	must.Eq(t, []string{"task a/data published", "vol p/vol1 staging/published"}, h.journalRecords())
	must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))

	h.restart()
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	h.waitIdle()
	must.Eq(t, []string{MethodNodeStageVolume}, h.fake.Methods())
	must.Eq(t, []string{"task a/data published", "vol p/vol1 staged/published"}, h.journalRecords())
	must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))

	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, "a"))
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}
