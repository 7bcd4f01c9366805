package csihook

import (
	"context"
	"fmt"
	"testing"

	"github.com/shoenig/test/must"
)

// A Nomad task ID is <alloc ID>/<task name>/<invocation>: Nomad refuses '/'
// in a task name, and makes the allocation ID (a UUID) and the invocation
// without one. Anything else names no allocation.
func TestSplitTaskID(t *testing.T) {
	for _, tc := range []struct {
		id                      string
		alloc, task, invocation string
		ok                      bool
	}{
		{"a/web/1", "a", "web", "1", true},
		{"5f6c2f4e-1d2b-4c3a-9e8f-0a1b2c3d4e5f/app/9c1e2f3a", "5f6c2f4e-1d2b-4c3a-9e8f-0a1b2c3d4e5f", "app", "9c1e2f3a", true},
		{"a/w/e/b/1", "", "", "", false},
		{"a/web/1/", "", "", "", false},
		{"a/web/", "", "", "", false},
		{"a//1", "", "", "", false},
		{"/web/1", "", "", "", false},
		{"//", "", "", "", false},
		{"a/1", "", "", "", false},
		{"t1", "", "", "", false},
		{"", "", "", "", false},
	} {
		alloc, task, inv, ok := SplitTaskID(tc.id)
		must.Eq(t, []any{tc.alloc, tc.task, tc.invocation, tc.ok}, []any{alloc, task, inv, ok}, must.Sprint(tc.id))
	}
}

// A task whose ID names no allocation (SplitTaskID) shares a
// single-node-writer publish with no other task, and no other task shares
// its: it is never taken for a task of the allocation its ID starts with,
// nor for the task of another such ID. Nor may it write a
// multi-node-single-writer volume another task writes on the node, or
// another task one it writes.
func TestClaims_MalformedTaskIDsAreNoOtherTasksAllocation(t *testing.T) {
	const wellFormed = "alloc-a/app/11111111"
	var pairs [][2]string
	for _, bad := range []string{"alloc-a", "alloc-a//1", "alloc-a/app/", "alloc-a/app/1/2", "alloc-a/app"} {
		pairs = append(pairs, [2]string{bad, wellFormed}, [2]string{wellFormed, bad})
	}
	pairs = append(pairs, [2]string{"alloc-a", "alloc-a//1"}, [2]string{"alloc-a/app/1/2", "alloc-a//1"})
	for _, pair := range pairs {
		for _, mode := range []string{AccessSingleNodeWriter, AccessMultiNodeSingleWriter} {
			t.Run(fmt.Sprintf("%s/%s then %s", mode, pair[0], pair[1]), func(t *testing.T) {
				h := newHarness(t)
				ctx := context.Background()
				r := req("data", "vol1", "/data")
				r.AccessMode = mode
				_, err := h.m.Setup(ctx, pair[0], []VolumeRequest{r})
				must.NoError(t, err)
				_, err = h.m.Setup(ctx, pair[1], []VolumeRequest{r})
				must.ErrorIs(t, err, ErrConflict)
				must.NoError(t, h.m.Teardown(ctx, pair[0]))
				must.SliceEmpty(t, h.journalRecords())
			})
		}
	}
}
