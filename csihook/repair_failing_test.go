package csihook

import (
	"context"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A repair whose call the plugin keeps refusing (its backend gone) is not
// tried again at every periodic check for ever: each failure in a row
// doubles the wait before the next (20 s, 40 s, 80 s ... up to 5 min), as
// a relapse does. The task is told once that the volume is stale and once
// that its repair failed; each pass held back logs it at Debug.
func TestRepairStale_FailingRepairBacksOff(t *testing.T) {
	h, clock, target := newRelapseHarness(t)
	ctx := context.Background()
	h.mnt.SetStale(target, true)
	h.fake.SetError(MethodNodePublishVolume, status.Error(codes.Internal, "backend gone"))
	var tried []int
	for i := range 13 {
		clock.next()
		h.fake.ResetCalls()
		_, err := h.m.RepairStale(ctx, "p")
		if h.fake.Count(MethodNodePublishVolume) > 0 {
			must.Error(t, err)
			tried = append(tried, i)
		} else {
			must.NoError(t, err)
		}
	}
	// 0 fails (waits 20 s: 1 tries), 1 fails (40 s: 3), 3 fails (80 s:
	// 6), 6 fails (160 s: 12).
	must.Eq(t, []int{0, 1, 3, 6, 12}, tried, must.Sprint(h.eventMsgs()))
	must.Eq(t, 1, countEvents(h, `Volume "data" is stale`), must.Sprint(h.eventMsgs()))
	must.Eq(t, 1, countEvents(h, `Repair of stale volume "data" failed`), must.Sprint(h.eventMsgs()))
	must.Eq(t, 8, strings.Count(h.logs.String(), "not repaired in this pass: its last repairs failed"), must.Sprint(h.logs.String()))

	// The retries of one repair are not held back by its own failures.
	h.m.ResetRepairBackoff("p")
	h.fake.ResetCalls()
	_, err := h.m.RepairStaleRetry(ctx, "p", 3)
	must.Error(t, err)
	must.Eq(t, 3, h.fake.Count(MethodNodePublishVolume))

	// The plugin back healthy (a new process) ends the wait: the repair
	// that follows is not held back, and the volume is repaired.
	clock.next()
	h.fake.SetError(MethodNodePublishVolume, nil)
	h.fake.ResetCalls()
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceEmpty(t, rep, must.Sprint("held back by the failures of the retries"))
	h.m.ResetRepairBackoff("p")
	rep, err = h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceLen(t, 1, rep)
	must.SliceContains(t, h.mountPaths(), target)

	// Repaired and seen alive: its next failing repair waits 20 s again,
	// not where the last episode left off.
	must.Eq(t, 0, h.pass(clock))
	h.mnt.SetStale(target, true)
	h.fake.SetError(MethodNodePublishVolume, status.Error(codes.Internal, "backend gone"))
	clock.next()
	_, err = h.m.RepairStale(ctx, "p")
	must.Error(t, err)
	clock.next()
	_, err = h.m.RepairStale(ctx, "p")
	must.Error(t, err, must.Sprint("a second failure 30 s after the first is tried"))

	h.fake.SetError(MethodNodePublishVolume, nil)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
}
