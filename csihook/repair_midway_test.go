package csihook

import (
	"context"
	"testing"

	"github.com/shoenig/test/must"
)

// A plugin that dies again half way through a repair (a crash-looping
// daemon), after its dead publish was taken away and before it was
// published again, leaves the volume unmounted, no longer dead: the next
// pass, once the plugin is back, publishes it again all the same.
func TestRepairStale_PluginGoneAfterTheUnpublishIsRepairedLater(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	target := h.setupData()
	info, err := h.m.cfg.Lookup("p")
	must.NoError(t, err)
	h.mnt.SetStale(target, true)

	release := h.fake.HangMethod(MethodNodeUnpublishVolume)
	t.Cleanup(release)
	done := h.repairInFlight(MethodNodeUnpublishVolume)
	h.removePlugin("p")
	release()
	must.ErrorContains(t, <-done, "is not running")
	must.SliceNotContains(t, h.mountPaths(), target)

	h.setPlugin(info)
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceLen(t, 1, rep, must.Sprint(h.eventMsgs()))
	must.SliceContains(t, h.mountPaths(), target)

	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
}
