//go:build e2e

package e2e

import (
	"testing"

	"github.com/shoenig/test/must"
)

// TestAllocWaitFollowsEventStream proves that the allocation waits hear
// Nomad's event stream, not only their once-a-second recheck: while a task
// runs, the wait signals it (SIGCONT, harmless to sleep) on every recheck
// until the stream has brought the "Signaling" update, and the stream must
// not have broken. With a wrong topic key or a broken stream no event
// comes and the wait fails naming what the stream did.
func TestAllocWaitFollowsEventStream(t *testing.T) {
	t.Parallel()
	a := shared(t)

	job := a.RunJob(t, "sleep", vars("Count", "1"))
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	var signalErr error
	ok, st := a.watchAllocs(job.ID, startTimeout, func(st streamStats) bool {
		if st.Events > 0 {
			return true
		}
		signalErr = a.api.Allocations().Signal(&al.Allocation, nil, "t", "SIGCONT")
		return false
	})
	must.True(t, ok, must.Sprintf("no allocation event for job %s within %v (%s; last signal error: %v)", job.ID, startTimeout, st, signalErr))
	must.NoError(t, st.Err, must.Sprintf("the event stream broke: %s", st))
}
