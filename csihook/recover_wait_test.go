package csihook

import (
	"context"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// A recovery that waits for its plugin to become healthy looks at the
// staging path again at each attempt: a staging mount alive at the first
// attempt and gone by the one that runs once the plugin is back (a plugin
// that took its mounts with it when it restarted) is staged again, not
// taken as held because an attempt that made no call saw it once.
func TestRecover_StagingLostWhileWaitingForThePlugin(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	k := volKey{"p", "vol1"}
	_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.NoError(t, err)
	// The driver stopped during an attach made again (a controller the
	// plugin gained since): uncertain, so recovery waits for the plugin.
	v, ok := h.m.vol(k)
	must.True(t, ok)
	v.Controller = phasePublishing
	must.NoError(t, h.m.commit(volPut(v)))

	h.restart()
	sick := fullPlugin("p")
	sick.Healthy = false
	h.setPlugin(sick)
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	// The first attempt found the plugin not healthy and waits.
	must.Wait(t, waitFor(func() bool { return strings.Contains(h.logs.String(), "retrying in") }))
	must.NoError(t, h.mnt.Unmount(h.m.StagingPath("p", "vol1")))
	h.setPlugin(fullPlugin("p"))
	h.waitIdle()

	must.Eq(t, []string{`ControllerPublishVolume vol1 staging= target= secrets=[token=` + canary + `]`,
		`NodeStageVolume vol1 staging=<staging> target= secrets=[token=` + canary + `]`}, traceCalls(h))
	must.Eq(t, []string{"task a/data published", "vol p/vol1 staged/published"}, h.journalRecords())
	mounted, err := h.mnt.IsMountPoint(h.m.StagingPath("p", "vol1"))
	must.NoError(t, err)
	must.True(t, mounted, must.Sprint("the staging path after recovery"))
}
