package csihook

import (
	"context"
	"fmt"
	"runtime"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// repairEntries returns the task volumes Manager.repairs holds left
// repairing, and those with a failure recorded.
func (m *Manager) repairEntries() (repairing, failures []taskRef) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for ref, st := range m.repairs {
		if st.repairing {
			repairing = append(repairing, ref)
		}
		if st.failure != "" {
			failures = append(failures, ref)
		}
	}
	return repairing, failures
}

// A node runs thousands of tasks over weeks: what a failed repair
// remembers of a task volume goes with the task's record, so that tasks
// that came and went leave nothing behind.
func TestRepairStale_FailedRepairsForgottenWithTheirTasks(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	for i := range 20 {
		task := fmt.Sprintf("task-%02d", i)
		_, err := h.m.Setup(ctx, task, []VolumeRequest{req("data", fmt.Sprintf("vol-%02d", i), "/data")})
		must.NoError(t, err)
		h.mnt.SetStale(h.m.TargetPath(task, "data"), true)
		h.fake.SetError(MethodNodePublishVolume, status.Error(codes.Internal, "backend gone"))
		_, err = h.m.RepairStale(ctx, "p")
		must.Error(t, err)
		repairing, failures := h.m.repairEntries()
		must.Eq(t, []taskRef{{task, "data"}}, repairing)
		must.Eq(t, []taskRef{{task, "data"}}, failures)

		h.fake.SetError(MethodNodePublishVolume, nil)
		must.NoError(t, h.m.Teardown(ctx, task))
		repairing, failures = h.m.repairEntries()
		must.SliceEmpty(t, repairing, must.Sprintf("after the teardown of %s", task))
		must.SliceEmpty(t, failures, must.Sprintf("after the teardown of %s", task))
	}
	must.SliceEmpty(t, h.journalRecords())
}

// A teardown that waits for a repair in flight on its volume drops what
// the repair's failure recorded, once the repair lets the volume go.
func TestRepairStale_TeardownWaitingOnFailingRepair(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	h.mnt.SetStale(h.setupData(), true)
	h.fake.SetError(MethodNodePublishVolume, status.Error(codes.Internal, "backend gone"))
	release := h.fake.HangMethod(MethodNodePublishVolume)
	t.Cleanup(release)

	repaired := h.repairInFlight(MethodNodePublishVolume)
	tornDown := make(chan error, 1)
	go func() { tornDown <- h.m.Teardown(ctx, "task-a") }()
	// The teardown waits on the volume's lock, which the repair holds.
	key := volKey{"p", "vol1"}.String()
	for h.m.locks.waiters(key) < 2 {
		runtime.Gosched()
	}
	release()
	must.ErrorContains(t, <-repaired, "backend gone")
	must.NoError(t, <-tornDown)
	repairing, failures := h.m.repairEntries()
	must.SliceEmpty(t, repairing)
	must.SliceEmpty(t, failures)
	must.SliceEmpty(t, h.journalRecords())
}

// waiters is how many hold or wait for key's lock.
func (k *keyLocks) waiters(key string) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	if l, ok := k.locks[key]; ok {
		return l.refs
	}
	return 0
}
