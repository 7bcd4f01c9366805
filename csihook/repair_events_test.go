package csihook

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// countEvents counts the events that contain sub.
func countEvents(h *harness, sub string) int {
	n := 0
	for _, e := range h.eventMsgs() {
		if strings.Contains(e, sub) {
			n++
		}
	}
	return n
}

// noRepairBackoff makes every pass repair what it finds dead, for tests of
// what a repair tells the task (the back-off has its own tests).
func noRepairBackoff(c *Config) {
	c.RepairBackoffBase, c.RepairBackoffMax = time.Nanosecond, time.Nanosecond
}

// A repair that fails pass after pass (every 30 s, by the driver's
// periodic check, once its back-off let it) tells the task once that the volume is stale and once
// that its repair failed, even when the plugin's message changes with
// each answer (a request id, a time): Nomad keeps a task's last ten
// events, and the task's own must not be pushed out by these. A failure
// of another kind is told, and a volume repaired, seen alive and then dead
// again is told again.
func TestRepairStale_FailingPassesTellTheTaskOnce(t *testing.T) {
	h := newHarness(t, noRepairBackoff)
	ctx := context.Background()
	target := h.setupData()
	pass := func(code codes.Code, i int) {
		t.Helper()
		h.fake.SetError(MethodNodePublishVolume, status.Error(code, fmt.Sprintf("backend gone (request %d)", i)))
		_, err := h.m.RepairStale(ctx, "p")
		must.Error(t, err)
	}
	const stale, failed = `Volume "data" is stale`, `Repair of stale volume "data" failed`

	h.mnt.SetStale(target, true)
	for i := range 5 {
		pass(codes.Internal, i)
	}
	must.Eq(t, 1, countEvents(h, stale), must.Sprint(h.eventMsgs()))
	must.Eq(t, 1, countEvents(h, failed), must.Sprint(h.eventMsgs()))
	pass(codes.ResourceExhausted, 5)
	must.Eq(t, 1, countEvents(h, stale), must.Sprint(h.eventMsgs()))
	must.Eq(t, 2, countEvents(h, failed), must.Sprint(h.eventMsgs()))

	h.fake.SetError(MethodNodePublishVolume, nil)
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceLen(t, 1, rep)
	// A check finds the fresh mount alive: its next death is no relapse
	// (which would wait, see TestRepairStale_RelapsingVolumeBacksOff).
	rep, err = h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceEmpty(t, rep)
	h.mnt.SetStale(target, true)
	pass(codes.Internal, 6)
	must.Eq(t, 2, countEvents(h, stale), must.Sprint(h.eventMsgs()))
	must.Eq(t, 3, countEvents(h, failed), must.Sprint(h.eventMsgs()))

	h.fake.SetError(MethodNodePublishVolume, nil)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.journalRecords())
}

// A dead mount that comes back by itself (a FUSE daemon that reconnects
// while the repair's NodeUnpublishVolume fails) ends what the failed
// repair remembers of it: when the volume dies again, the task is told it
// is stale, and told the repair's failure, as the first time.
func TestRepairStale_RelapseAfterTheMountCameBackIsTold(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	target := h.setupData()
	const stale, failed = `Volume "data" is stale`, `Repair of stale volume "data" failed`
	h.fake.SetError(MethodNodeUnpublishVolume, status.Error(codes.Internal, "daemon busy"))
	// The mount comes back alive while the plugin fails to unpublish it:
	// the repair fails (the live mount is still there), leaving the
	// volume healthy.
	dieAndComeBack := func() {
		t.Helper()
		h.mnt.SetStale(target, true)
		release := h.fake.HangMethod(MethodNodeUnpublishVolume)
		defer release()
		done := h.repairInFlight(MethodNodeUnpublishVolume)
		h.mnt.SetStale(target, false)
		release()
		must.ErrorContains(t, <-done, "daemon busy")
	}

	dieAndComeBack()
	must.Eq(t, 1, countEvents(h, stale), must.Sprint(h.eventMsgs()))
	must.Eq(t, 1, countEvents(h, failed), must.Sprint(h.eventMsgs()))
	// The next pass finds it healthy.
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceEmpty(t, rep)

	dieAndComeBack()
	must.Eq(t, 2, countEvents(h, stale), must.Sprint(h.eventMsgs()))
	must.Eq(t, 2, countEvents(h, failed), must.Sprint(h.eventMsgs()))

	h.fake.SetError(MethodNodeUnpublishVolume, nil)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.journalRecords())
}

// Each volume of a task is told its own repair's failure, however alike
// the failures are: that of one volume does not silence another's,
// whether they die one after the other or in the same pass.
func TestRepairStale_EachVolumeOfATaskIsTold(t *testing.T) {
	for _, together := range []bool{false, true} {
		t.Run(fmt.Sprintf("together=%v", together), func(t *testing.T) {
			h := newHarness(t, noRepairBackoff)
			ctx := context.Background()
			_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data"), req("logs", "vol2", "/logs")})
			must.NoError(t, err)
			h.fake.SetError(MethodNodePublishVolume, status.Error(codes.Internal, "backend gone"))
			for _, name := range []string{"data", "logs"} {
				h.mnt.SetStale(h.m.TargetPath("task-a", name), true)
				if !together {
					_, err = h.m.RepairStale(ctx, "p")
					must.Error(t, err)
				}
			}
			for range 2 {
				_, err = h.m.RepairStale(ctx, "p")
				must.Error(t, err)
			}
			for _, name := range []string{"data", "logs"} {
				must.Eq(t, 1, countEvents(h, fmt.Sprintf("Volume %q is stale", name)), must.Sprint(h.eventMsgs()))
				must.Eq(t, 1, countEvents(h, fmt.Sprintf("Repair of stale volume %q failed", name)), must.Sprint(h.eventMsgs()))
			}
			h.fake.SetError(MethodNodePublishVolume, nil)
			must.NoError(t, h.m.Teardown(ctx, "task-a"))
			must.SliceEmpty(t, h.journalRecords())
		})
	}
}
