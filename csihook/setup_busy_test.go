package csihook

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// A setup whose time is already spent when it reaches a volume that no
// other operation holds (the task's earlier volumes took it) is not told
// that another operation held the volume, and does not match ErrBusy: a
// free lock and an ended context were both ready, and which one the wait
// took was chance. Each round is a new task on a new volume, so nothing
// ever holds the lock.
func TestSetup_TimeSpentOnFreeVolumeIsNotBusy(t *testing.T) {
	h := newHarness(t)
	stagingPlugin(h)
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	for i := range 40 {
		task := fmt.Sprintf("task-%d", i)
		_, err := h.m.Setup(ctx, task, []VolumeRequest{req("data", fmt.Sprintf("vol-%d", i), "/data")})
		must.Error(t, err)
		must.False(t, errors.Is(err, ErrBusy), must.Sprintf("round %d: %v", i, err))
		must.StrNotContains(t, err.Error(), "another operation", must.Sprintf("round %d", i))
		must.ErrorIs(t, err, context.DeadlineExceeded, must.Sprintf("round %d", i))
		must.StrContains(t, err.Error(), `the setup ran out of time before volume "data"`, must.Sprintf("round %d", i))
	}
	// Nothing was staged or published for any of them.
	must.Eq(t, 0, h.fake.Count(MethodNodeStageVolume))
	must.Eq(t, 0, h.fake.Count(MethodNodePublishVolume))
}
