package csihook

import (
	"context"
	"fmt"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The back-off of failed repairs (failures, retryAt) is kept per task
// volume: tasks whose repairs failed and that then ended leave
// no entry in Manager.repairs, whether the repair failed once or was held
// back by its back-off when the task ended.
func TestRepairStale_FailedRepairBackoffForgottenWithTheirTasks(t *testing.T) {
	h, clock, _ := newRelapseHarness(t)
	ctx := context.Background()
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	for i := range 200 {
		task := fmt.Sprintf("task-%04d", i)
		_, err := h.m.Setup(ctx, task, []VolumeRequest{req("data", fmt.Sprintf("vol-%04d", i%7), "/data")})
		must.NoError(t, err)
		h.mnt.SetStale(h.m.TargetPath(task, "data"), true)
		h.fake.SetError(MethodNodePublishVolume, status.Error(codes.Internal, "backend gone"))
		clock.next()
		_, err = h.m.RepairStale(ctx, "p")
		must.Error(t, err)
		if i%2 == 0 {
			// Failed twice (it waits 40 s), and held back by its
			// back-off when the task ends.
			clock.next()
			_, err = h.m.RepairStale(ctx, "p")
			must.Error(t, err)
			clock.next()
			h.fake.ResetCalls()
			_, err = h.m.RepairStale(ctx, "p")
			must.NoError(t, err)
			must.Eq(t, 0, h.fake.Count(MethodNodePublishVolume))
		}
		h.m.mu.Lock()
		n := len(h.m.repairs)
		h.m.mu.Unlock()
		must.Eq(t, 1, n)
		must.NoError(t, h.m.Teardown(ctx, task))
		h.fake.SetError(MethodNodePublishVolume, nil)
		h.m.mu.Lock()
		n = len(h.m.repairs)
		h.m.mu.Unlock()
		must.Eq(t, 0, n, must.Sprintf("after the teardown of %s", task))
	}
	must.SliceEmpty(t, h.journalRecords())
}
