package csihook

import (
	"context"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A volume whose last NodeStageVolume the plugin refused is counted as
// refused, not staged, and does not vanish from the counts: the task that
// had it before keeps its publish, and the volume is there until its last
// teardown. A restart counts it the same from the journal; the teardown
// takes it out of every count.
func TestVolumeCounts_Refused(t *testing.T) {
	var p *stageForgetting
	h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return p, nil } })
	p = &stageForgetting{FakeClient: h.fake, staged: map[string]bool{}}
	stagingPlugin(h)
	ctx := context.Background()
	r := multi(req("data", "vol1", "/data"))

	must.Eq(t, VolumeCounts{}, h.m.VolumeCounts())
	_, err := h.m.Setup(ctx, "a", []VolumeRequest{r})
	must.NoError(t, err)
	_, err = h.m.Setup(ctx, "c", []VolumeRequest{multi(req("data", "vol2", "/data"))})
	must.NoError(t, err)
	must.Eq(t, VolumeCounts{Staged: 2, Published: 2}, h.m.VolumeCounts())

	// The plugin forgot its stage of vol1, and refuses to stage it for b.
	p.forget()
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.InvalidArgument, "refused"))
	_, err = h.m.Setup(ctx, "b", []VolumeRequest{r})
	must.ErrorContains(t, err, "InvalidArgument: refused")
	must.SliceContains(t, h.journalRecords(), "vol p/vol1 refused/")
	want := VolumeCounts{Staged: 1, Refused: 1, Published: 2}
	must.Eq(t, want, h.m.VolumeCounts())

	h.restart()
	must.Eq(t, want, h.m.VolumeCounts())

	must.NoError(t, h.m.Teardown(ctx, "a"))
	must.Eq(t, VolumeCounts{Staged: 1, Published: 1}, h.m.VolumeCounts())
	must.NoError(t, h.m.Teardown(ctx, "c"))
	must.Eq(t, VolumeCounts{}, h.m.VolumeCounts())
	must.SliceEmpty(t, h.journalRecords())
}
