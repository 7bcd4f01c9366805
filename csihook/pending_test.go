package csihook

import (
	"context"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// PluginWork lists the tasks holding volumes of one plugin, marks those
// whose teardown a background worker retries, and empties once the
// volumes are released; other plugins' volumes are not listed.
func TestManager_PluginWork(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(fullPlugin("q"))
	ctx := context.Background()
	other := req("other", "vol-q", "/q")
	other.PluginID = "q"
	_, err := h.m.Setup(ctx, "t1", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	_, err = h.m.Setup(ctx, "t2", []VolumeRequest{other})
	must.NoError(t, err)

	must.Eq(t, PluginWork{Tasks: []string{"t1"}}, h.m.PluginWork("p"))
	must.Eq(t, PluginWork{Tasks: []string{"t2"}}, h.m.PluginWork("q"))
	must.True(t, h.m.PluginWork("none").Empty())

	// The unstage fails for a while: the task's teardown is retried in
	// the background, and the volume is still the plugin's work.
	h.fake.SetError(MethodNodeUnstageVolume, status.Error(codes.Unavailable, "down"))
	must.Error(t, h.m.Teardown(ctx, "t1"))
	w := h.m.PluginWork("p")
	must.Eq(t, []string{"t1"}, w.Tasks)
	must.Eq(t, []string{"t1"}, w.Retrying)
	must.False(t, w.Empty())

	h.fake.SetError(MethodNodeUnstageVolume, nil)
	h.waitIdle()
	must.True(t, h.m.PluginWork("p").Empty(), must.Sprintf("%+v", h.m.PluginWork("p")))
	must.NoError(t, h.m.Teardown(ctx, "t2"))
	must.True(t, h.m.PluginWork("q").Empty())
}
