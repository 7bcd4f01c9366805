package csihook

import (
	"context"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// restartEvents are the events that tell a task to restart to get its
// volume back.
func restartEvents(h *harness) []string {
	var out []string
	for _, e := range h.eventMsgs() {
		if strings.Contains(e, "restart the task") {
			out = append(out, e)
		}
	}
	return out
}

// A task whose volume recovery cannot publish again (its secrets are no
// longer held) is told once to restart, however many times Recover
// settles the same journal: a second Recover of the same state finds
// nothing new to tell. A driver restart (a new manager) tells it again.
func TestRecover_TwiceTellsRestartOnce(t *testing.T) {
	h := newHarness(t)
	stagingPlugin(h)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.NoError(t, err)

	h.restart()
	must.NoError(t, h.mnt.Unmount(h.m.TargetPath("a", "data")))
	h.fake.ResetCalls()
	live := func(string) bool { return true }
	must.NoError(t, h.m.Recover(live))
	h.waitIdle()
	must.Len(t, 1, restartEvents(h))

	must.NoError(t, h.m.Recover(live))
	h.waitIdle()
	must.Len(t, 1, restartEvents(h), must.Sprint(h.eventMsgs()))
	must.SliceEmpty(t, h.fake.Methods())
	must.Eq(t, []string{"task a/data published", "vol p/vol1 staged/"}, h.journalRecords())

	// A new driver process knows nothing of what was told: the task
	// hears it after that restart as well.
	h.restart()
	must.NoError(t, h.m.Recover(live))
	h.waitIdle()
	must.Len(t, 2, restartEvents(h), must.Sprint(h.eventMsgs()))
	must.SliceEmpty(t, h.fake.Methods())
}

// A mount a Recover finds alive again has what an earlier one told of it
// forgotten, as a repair's check that finds it alive forgets it: lost a
// second time, the task is told again to restart, not kept silent by what
// was told of the first loss.
func TestRecover_AliveAgainThenLostTellsRestartAgain(t *testing.T) {
	h := newHarness(t)
	stagingPlugin(h)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.NoError(t, err)

	h.restart()
	target := h.m.TargetPath("a", "data")
	must.NoError(t, h.mnt.Unmount(target))
	live := func(string) bool { return true }
	must.NoError(t, h.m.Recover(live))
	h.waitIdle()
	must.Len(t, 1, restartEvents(h))

	// Mounted again (by hand, say): a Recover finds it alive.
	must.NoError(t, h.mnt.BindMount(h.m.StagingPath("p", "vol1"), target, false, false))
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(live))
	h.waitIdle()
	must.Len(t, 1, restartEvents(h))
	must.SliceEmpty(t, h.fake.Methods())

	// Lost again: told again.
	must.NoError(t, h.mnt.Unmount(target))
	must.NoError(t, h.m.Recover(live))
	h.waitIdle()
	must.Len(t, 2, restartEvents(h), must.Sprint(h.eventMsgs()))
	must.SliceEmpty(t, h.fake.Methods())
}

// What a Recover tells a task and what a repair remembers of its own
// failure are kept apart: a repair that fails the same way pass after
// pass tells the task once, though a Recover told it something else in
// between.
func TestRecover_RepairFailureToldOnceAcrossRecover(t *testing.T) {
	h := newHarness(t)
	stagingPlugin(h)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.NoError(t, err)

	h.restart()
	must.NoError(t, h.mnt.Unmount(h.m.TargetPath("a", "data")))
	h.fake.ResetCalls()
	repairFailures := func() int { return countEvents(h, "Repair of stale volume") }
	_, err = h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "needs its secrets")
	must.Eq(t, 1, repairFailures())
	// No CSI call failed: the event tells the repair's own error, not a
	// teardown's.
	for _, e := range h.eventMsgs() {
		if strings.HasPrefix(e, "Repair of stale volume") {
			must.StrContains(t, e, `Repair of stale volume "data" failed: `)
			must.StrContains(t, e, "needs its secrets")
			must.StrNotContains(t, e, "Tearing down")
		}
	}

	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	h.waitIdle()
	must.Eq(t, 1, countEvents(h, "is not mounted after a driver restart"), must.Sprint(h.eventMsgs()))

	_, err = h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "needs its secrets")
	must.Eq(t, 1, repairFailures(), must.Sprint(h.eventMsgs()))
	must.SliceEmpty(t, h.fake.Methods())
}
