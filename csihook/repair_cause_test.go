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

// staleEvents are the task's events that told it a volume is stale.
func (h *harness) staleEvents() []string {
	var out []string
	for _, e := range h.eventMsgs() {
		if strings.Contains(e, " is stale (") {
			out = append(out, e)
		}
	}
	return out
}

// The task is told what the driver knows of why its volume's mount is
// gone: a plugin restart only when the plugin became healthy again before
// the pass that found it (the driver's repair on its return); an operator's
// umount, or a plugin that stayed up and unmounted or lost the mount, is
// told as the mount being gone, at the path that was found so.
func TestRepairStale_StaleEventNamesRestartOnlyWhenThereWasOne(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, noRepairBackoff)
	target := h.setupData()
	staging := h.m.StagingPath("p", "vol1")
	pass := func(want string) {
		t.Helper()
		_, err := h.m.RepairStale(ctx, "")
		must.NoError(t, err)
		got := h.staleEvents()
		must.SliceNotEmpty(t, got)
		must.Eq(t, want, got[len(got)-1])
		// A pass that finds it alive ends what this repair remembers.
		_, err = h.m.RepairStale(ctx, "")
		must.NoError(t, err)
	}

	// An operator's umount, the plugin healthy all along.
	must.NoError(t, h.mnt.Unmount(target))
	pass(fmt.Sprintf(`Volume "data" is stale (its mount at %s was gone); repairing`, target))

	// The plugin came back healthy (its process died): its FUSE mount is dead.
	h.m.ResetRepairBackoff("p")
	h.mnt.SetStale(target, true)
	pass(fmt.Sprintf(`Volume "data" is stale (its mount at %s was gone after plugin "p" restarted); repairing`, target))

	// That return was dealt with: a later death is not blamed on it.
	h.mnt.SetStale(target, true)
	pass(fmt.Sprintf(`Volume "data" is stale (its mount at %s was gone); repairing`, target))

	// Another plugin's return is not this one's.
	h.m.ResetRepairBackoff("other")
	must.NoError(t, h.mnt.Unmount(target))
	pass(fmt.Sprintf(`Volume "data" is stale (its mount at %s was gone); repairing`, target))

	// A dead staging mount, its publish a bind of it: the staging path.
	h.mnt.SetStale(staging, true)
	pass(fmt.Sprintf(`Volume "data" is stale (its mount at %s was gone); repairing`, staging))
	must.Eq(t, 5, len(h.staleEvents()), must.Sprint(h.eventMsgs()))
}

// A plugin's return stays the explanation until a pass has checked all
// its volumes and set up again those it found dead: a pass whose repair
// failed (the plugin refused it) keeps it, and so does a pass
// over another plugin's volumes.
func TestRepairStale_RestartKeptUntilItsVolumesAreDealtWith(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, noRepairBackoff)
	target := h.setupData()
	returned := func() map[string]bool {
		h.m.mu.Lock()
		defer h.m.mu.Unlock()
		out := map[string]bool{}
		for p := range h.m.returned {
			out[p] = true
		}
		return out
	}
	h.m.ResetRepairBackoff("p")
	h.m.ResetRepairBackoff("q")
	_, err := h.m.RepairStale(ctx, "q")
	must.NoError(t, err)
	must.Eq(t, map[string]bool{"p": true}, returned(), must.Sprint("a pass over plugin q deals with q's return alone"))

	h.mnt.SetStale(target, true)
	h.fake.SetNextError(MethodNodePublishVolume, status.Error(codes.Internal, "backend not ready"))
	_, err = h.m.RepairStale(ctx, "")
	must.Error(t, err)
	must.Eq(t, map[string]bool{"p": true}, returned(), must.Sprint("a failed repair keeps the return"))
	must.Eq(t, []string{fmt.Sprintf(`Volume "data" is stale (its mount at %s was gone after plugin "p" restarted); repairing`, target)},
		h.staleEvents())

	_, err = h.m.RepairStale(ctx, "")
	must.NoError(t, err)
	must.MapEmpty(t, returned())
}

// The relapse event says what was seen (the repaired mount gone again
// while the plugin stayed healthy), not why.
func TestRepairStale_RelapseEventSaysWhatWasSeen(t *testing.T) {
	h, clock, target := newRelapseHarness(t)
	h.mnt.SetStale(target, true)
	must.Eq(t, 1, h.pass(clock))
	h.mnt.SetStale(target, true)
	must.Eq(t, 0, h.pass(clock))
	var got []string
	for _, e := range h.eventMsgs() {
		if strings.HasPrefix(e, relapseEvent) {
			got = append(got, e)
		}
	}
	must.Eq(t, []string{fmt.Sprintf(`Volume "data" died again soon after its repair (its mount at %s was gone again; plugin "p" stayed healthy): it is repaired again in 20s, and less often (up to every 5m0s) while this goes on; check the plugin, or restart the task`, target)}, got)
	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
}

// A plugin that comes back while a pass is under way (the periodic check,
// held up by another volume) has not had its return dealt with by that
// pass: the pass may have found its volumes alive before the restart
// killed them. The repair that follows the return still tells the task
// its mount died with the restart, also when the plugin had come back
// once before the pass began (that return the pass did deal with).
func TestRepairStale_ReturnDuringAPassOutlivesIt(t *testing.T) {
	for _, returnedBefore := range []bool{false, true} {
		t.Run(fmt.Sprintf("returned before the pass too: %v", returnedBefore), func(t *testing.T) {
			testReturnDuringAPass(t, returnedBefore)
		})
	}
}

func testReturnDuringAPass(t *testing.T, returnedBefore bool) {
	ctx := context.Background()
	h := newHarness(t, noRepairBackoff)
	target := h.setupData()
	_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{req("logs", "vol2", "/logs")})
	must.NoError(t, err)
	other := h.m.TargetPath("task-b", "logs")
	if returnedBefore {
		h.m.ResetRepairBackoff("p")
	}
	// The periodic pass: vol1 is found alive, then the repair of vol2
	// (unmounted) hangs in its first call to the plugin.
	must.NoError(t, h.mnt.Unmount(other))
	release := h.fake.Hang("vol2")
	h.fake.ResetCalls()
	done := make(chan error, 1)
	go func() {
		_, err := h.m.RepairStale(ctx, "")
		done <- err
	}()
	calledVol2 := func() bool {
		for _, c := range h.fake.Calls() {
			if c.VolumeID == "vol2" {
				return true
			}
		}
		return false
	}
	for !calledVol2() {
		select {
		case err := <-done:
			t.Fatalf("the pass ended before it called the plugin for vol2: %v", err)
		default:
			time.Sleep(time.Millisecond)
		}
	}
	// Meanwhile the plugin's process dies, taking vol1's mount, and it
	// comes back healthy.
	h.mnt.SetStale(target, true)
	h.m.ResetRepairBackoff("p")
	release()
	must.NoError(t, <-done)

	// The repair on its return.
	_, err = h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	got := h.staleEvents()
	must.SliceNotEmpty(t, got)
	must.Eq(t, fmt.Sprintf(`Volume "data" is stale (its mount at %s was gone after plugin "p" restarted); repairing`, target),
		got[len(got)-1], must.Sprint(h.eventMsgs()))
}
