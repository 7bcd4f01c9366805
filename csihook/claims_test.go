package csihook

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/shoenig/test/must"
)

// Nomad documents multi-node-single-writer as "the scheduler only allows
// one allocation to have read/write access": any number of readers, one
// writing allocation. The CSI spec's limit is about nodes, so on a node
// only the driver can keep a second allocation from writing a volume
// another allocation holds as its single writer.
func TestClaims_MultiNodeSingleWriter_OneWritingAllocation(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	mnsw := func(readOnly bool) VolumeRequest {
		r := req("data", "vol1", "/data")
		r.AccessMode, r.ReadOnly = AccessMultiNodeSingleWriter, readOnly
		return r
	}
	// Nomad task IDs: allocation ID/task name/invocation.
	const (
		writer  = "alloc-a/db/11111111"
		sibling = "alloc-a/backup/22222222"
		reader  = "alloc-b/report/33333333"
		hostile = "alloc-c/evil/44444444"
	)
	_, err := h.m.Setup(ctx, writer, []VolumeRequest{mnsw(false)})
	must.NoError(t, err)

	// A reader of another allocation shares the writer's volume,
	// published read-only.
	pubs, err := h.m.Setup(ctx, reader, []VolumeRequest{mnsw(true)})
	must.NoError(t, err)
	must.True(t, pubs[0].ReadOnly)
	np := h.callsOf(MethodNodePublishVolume)
	must.True(t, np[len(np)-1].Readonly)

	// Another task of the writing allocation writes under its claim.
	_, err = h.m.Setup(ctx, sibling, []VolumeRequest{mnsw(false)})
	must.NoError(t, err)

	// A second allocation asking to write is refused before any call.
	h.fake.ResetCalls()
	h.mnt.ResetActions()
	before := h.journalRecords()
	_, err = h.m.Setup(ctx, hostile, []VolumeRequest{mnsw(false)})
	must.ErrorIs(t, err, ErrConflict)
	must.ErrorContains(t, err, `volume "data": volume_id "vol1" is multi-node-single-writer and task "alloc-a/backup/22222222" of allocation "alloc-a" has it published writable on this node`)
	must.ErrorContains(t, err, `set read_only = true to read it, stop that allocation first, or use access_mode = "multi-node-multi-writer"`)
	must.SliceEmpty(t, h.fake.Methods())
	must.SliceEmpty(t, h.mnt.GetActions())
	must.Eq(t, before, h.journalRecords())

	// Once the writing allocation is gone another may write, while the
	// reader stays.
	must.NoError(t, h.m.Teardown(ctx, writer))
	_, err = h.m.Setup(ctx, hostile, []VolumeRequest{mnsw(false)})
	must.ErrorIs(t, err, ErrConflict)
	must.NoError(t, h.m.Teardown(ctx, sibling))
	_, err = h.m.Setup(ctx, hostile, []VolumeRequest{mnsw(false)})
	must.NoError(t, err)
	for _, id := range []string{hostile, reader} {
		must.NoError(t, h.m.Teardown(ctx, id))
	}
	must.SliceEmpty(t, h.journalRecords())
}

// A restart of the writing task (a new invocation of the same allocation's
// task) is not a second writer, even while the earlier invocation still
// holds the volume.
func TestClaims_MultiNodeSingleWriter_RestartIsNotASecondWriter(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "vol1", "/data")
	r.AccessMode = AccessMultiNodeSingleWriter
	_, err := h.m.Setup(ctx, "alloc-a/db/11111111", []VolumeRequest{r})
	must.NoError(t, err)
	_, err = h.m.Setup(ctx, "alloc-a/db/55555555", []VolumeRequest{r})
	must.NoError(t, err)
	for _, id := range []string{"alloc-a/db/11111111", "alloc-a/db/55555555"} {
		must.NoError(t, h.m.Teardown(ctx, id))
	}
}

// A task of another namespace is refused for the namespace alone: the
// sharing rules are the owner's business, and their error would name a
// task (allocation ID and task name) of the namespace that holds the
// volume.
func TestClaims_OtherNamespaceHearsNothingOfTheHolder(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "vol1", "/data")
	r.AccessMode, r.Namespace = AccessMultiNodeSingleWriter, "team-a"
	_, err := h.m.Setup(ctx, "alloc-a/db/11111111", []VolumeRequest{r})
	must.NoError(t, err)

	for name, mode := range map[string]string{"writer": AccessMultiNodeSingleWriter, "other mode": AccessMultiNodeMultiWriter} {
		t.Run(name, func(t *testing.T) {
			o := req("data", "vol1", "/data")
			o.AccessMode, o.Namespace = mode, "team-b"
			_, err := h.m.Setup(ctx, "alloc-b/evil/22222222", []VolumeRequest{o})
			must.ErrorIs(t, err, ErrOtherNamespace)
			must.False(t, errors.Is(err, ErrConflict))
			must.StrNotContains(t, err.Error(), "alloc-a")
		})
	}
	must.NoError(t, h.m.Teardown(ctx, "alloc-a/db/11111111"))
}

// The writer's claim outlives the driver process: after a restart it still
// refuses a second writing allocation while its task lives, and goes with
// the task once recovery finds it gone (a task that died without
// DestroyTask).
func TestClaims_MultiNodeSingleWriter_ClaimKeptUntilReaped(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "vol1", "/data")
	r.AccessMode = AccessMultiNodeSingleWriter
	_, err := h.m.Setup(ctx, "alloc-a/db/11111111", []VolumeRequest{r})
	must.NoError(t, err)
	ro := r
	ro.ReadOnly = true
	_, err = h.m.Setup(ctx, "alloc-b/report/33333333", []VolumeRequest{ro})
	must.NoError(t, err)

	h.restart()
	must.NoError(t, h.m.Recover(func(id string) bool { return id != "alloc-c/evil/44444444" }))
	h.waitIdle()
	_, err = h.m.Setup(ctx, "alloc-c/evil/44444444", []VolumeRequest{r})
	must.ErrorIs(t, err, ErrConflict)

	// The writer died; the reader, read-only in the journal, stays.
	h.restart()
	must.NoError(t, h.m.Recover(func(id string) bool { return id == "alloc-b/report/33333333" }))
	h.waitIdle()
	must.Eq(t, 1, h.m.Users("p", "vol1"))
	_, err = h.m.Setup(ctx, "alloc-c/evil/44444444", []VolumeRequest{r})
	must.NoError(t, err)
	for _, id := range []string{"alloc-c/evil/44444444", "alloc-b/report/33333333"} {
		must.NoError(t, h.m.Teardown(ctx, id))
	}
	must.SliceEmpty(t, h.journalRecords())
}

// Two allocations starting at once: the volume's lock orders them, and
// one of them writes.
func TestClaims_MultiNodeSingleWriter_ConcurrentWriters(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "vol1", "/data")
	r.AccessMode = AccessMultiNodeSingleWriter
	ids := []string{"alloc-a/db/11111111", "alloc-b/db/22222222"}
	errs := make([]error, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = h.m.Setup(ctx, id, []VolumeRequest{r})
		}()
	}
	wg.Wait()
	ok := 0
	for _, err := range errs {
		if err == nil {
			ok++
		} else {
			must.ErrorIs(t, err, ErrConflict)
		}
	}
	must.Eq(t, 1, ok)
	for _, id := range ids {
		must.NoError(t, h.m.Teardown(ctx, id))
	}
	must.SliceEmpty(t, h.journalRecords())
}

// Two blocks of one task may name a multi-node-single-writer volume, one
// of them read-only: one task, one allocation.
func TestClaims_MultiNodeSingleWriter_TwoBlocksOfOneTask(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	a, b := req("a", "vol1", "/a"), req("b", "vol1", "/b")
	a.AccessMode, b.AccessMode, b.ReadOnly = AccessMultiNodeSingleWriter, AccessMultiNodeSingleWriter, true
	pubs, err := h.m.Setup(ctx, "alloc-a/db/11111111", []VolumeRequest{a, b})
	must.NoError(t, err)
	must.False(t, pubs[0].ReadOnly)
	must.True(t, pubs[1].ReadOnly)
	must.NoError(t, h.m.Teardown(ctx, "alloc-a/db/11111111"))
}
