package csihook

import (
	"context"
	"runtime"
	"testing"

	"github.com/shoenig/test/must"
)

// checkInFlight waits until a check of path has begun (and not returned).
func (h *harness) checkInFlight(path string) {
	h.t.Helper()
	for {
		if _, ok := h.m.staleChecks.Load(path); ok {
			return
		}
		runtime.Gosched()
	}
}

// A check of a volume's mounts that hangs (a hung network mount) runs
// before the volume's lock: the volume's teardown does not wait behind
// it.
func TestRepairStale_HungCheckHoldsNoLock(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	target := h.setupData()
	release := make(chan struct{})
	h.mnt.SetStaleHang(target, release)
	released := false
	t.Cleanup(func() {
		if !released {
			close(release)
		}
	})
	done := make(chan error, 1)
	go func() {
		_, err := h.m.RepairStale(ctx, "p")
		done <- err
	}()
	h.checkInFlight(target)
	must.Eq(t, 0, h.m.locks.waiters(volKey{"p", "vol1"}.String()), must.Sprint("the volume is locked while its check hangs"))
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	close(release)
	released = true
	must.NoError(t, <-done)
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
}

// A mount found dead before the volume's lock is checked again under it
// before anything is done to it: one that came back meanwhile (a daemon
// that reconnected, another repair) is left alone, never unpublished.
func TestRepairStale_DeadFoundBeforeTheLockIsCheckedAgain(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	shared := req("data", "vol1", "/data")
	shared.AccessMode = AccessMultiNodeMultiWriter
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{shared})
	must.NoError(t, err)
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{shared})
	must.NoError(t, err)
	a, b := h.m.TargetPath("task-a", "data"), h.m.TargetPath("task-b", "data")
	h.mnt.SetStale(a, true)
	// task-b's target is checked after task-a's: held there, the pass
	// has found task-a's dead and not taken the lock yet.
	release := make(chan struct{})
	h.mnt.SetStaleHang(b, release)
	h.fake.ResetCalls()
	type result struct {
		rep []Repaired
		err error
	}
	done := make(chan result, 1)
	go func() {
		rep, err := h.m.RepairStale(ctx, "p")
		done <- result{rep, err}
	}()
	h.checkInFlight(b)
	h.mnt.SetStale(a, false)
	close(release)
	res := <-done
	must.NoError(t, res.err)
	must.SliceEmpty(t, res.rep)
	must.SliceEmpty(t, h.fake.Methods())
	must.SliceContains(t, h.mountPaths(), a)

	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.NoError(t, h.m.Teardown(ctx, "task-b"))
	must.SliceEmpty(t, h.journalRecords())
}
