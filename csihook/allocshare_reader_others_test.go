package csihook

import (
	"context"
	"fmt"
	"testing"

	"github.com/shoenig/test/must"
)

// read_only = true lets a task share its own allocation's single-node-
// writer publish, and nothing more: a task of another allocation, or one
// whose ID names no allocation (SplitTaskID), is refused whether it reads
// or writes and whether the task holding the volume reads or writes, by
// the sharing rules (checkShare), which name the holder. The refusal calls
// nothing and leaves the holder's records as they were.
func TestClaims_SingleNodeWriter_ReaderOfAnotherAllocationRefused(t *testing.T) {
	const holder = "alloc-a/app/11111111"
	for _, second := range []string{"alloc-b/app/22222222", "alloc-a", "alloc-a/app", "alloc-a//1", "alloc-a/app/1/2"} {
		for _, holderReads := range []bool{false, true} {
			for _, secondReads := range []bool{true, false} {
				t.Run(fmt.Sprintf("%s/holder_ro=%v/ro=%v", second, holderReads, secondReads), func(t *testing.T) {
					h := newHarness(t)
					ctx := context.Background()
					first := req("data", "vol1", "/data")
					first.ReadOnly = holderReads
					_, err := h.m.Setup(ctx, holder, []VolumeRequest{first})
					must.NoError(t, err)
					before := h.journalRecords()
					h.fake.ResetCalls()

					r := req("data", "vol1", "/data")
					r.ReadOnly = secondReads
					_, err = h.m.Setup(ctx, second, []VolumeRequest{r})
					must.ErrorIs(t, err, ErrConflict)
					// The refusal names the task holding it, and what to do.
					must.ErrorContains(t, err, fmt.Sprintf("task %q", holder))
					must.ErrorContains(t, err, "stop that allocation first")
					// It says how the holder has it, truly.
					if holderReads {
						must.ErrorContains(t, err, "read-only in that task")
						must.StrNotContains(t, err.Error(), "writable")
					} else {
						must.ErrorContains(t, err, "already has it published writable on this node")
					}
					must.SliceEmpty(t, h.fake.Methods())
					must.Eq(t, before, h.journalRecords())

					must.NoError(t, h.m.Teardown(ctx, holder))
					must.SliceEmpty(t, h.journalRecords())
				})
			}
		}
	}
}

// Of the tasks of the allocation holding a single-node-writer volume, the
// refusal names one that writes it, if any, though a reader comes first.
func TestClaims_SingleNodeWriter_RefusalNamesTheWriter(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	const reader, writer = "alloc-a/aaa/11111111", "alloc-a/app/22222222"
	r := req("data", "vol1", "/data")
	r.ReadOnly = true
	_, err := h.m.Setup(ctx, reader, []VolumeRequest{r})
	must.NoError(t, err)
	_, err = h.m.Setup(ctx, writer, []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)

	_, err = h.m.Setup(ctx, "alloc-b/app/33333333", []VolumeRequest{r})
	must.ErrorIs(t, err, ErrConflict)
	must.ErrorContains(t, err, fmt.Sprintf(`task %q of allocation "alloc-a" already has it published writable on this node`, writer))
	h.teardownAll(ctx, writer, reader)
	must.SliceEmpty(t, h.journalRecords())
}
