package csihook

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
)

// scanUsers is what the index replaces: every task record, each looked at.
func scanUsers(s *journalState) map[volKey]map[taskRef]int {
	out := map[volKey]map[taskRef]int{}
	for _, recs := range s.tasks {
		for _, t := range recs {
			if out[t.key()] == nil {
				out[t.key()] = map[taskRef]int{}
			}
			out[t.key()][taskRef{t.TaskID, t.Name}]++
		}
	}
	return out
}

// indexed is the index as the same sets, each reference counted as often
// as the index holds it.
func indexed(s *journalState) map[volKey]map[taskRef]int {
	out := map[volKey]map[taskRef]int{}
	for k, refs := range s.byVolume {
		out[k] = map[taskRef]int{}
		for _, r := range refs {
			out[k][r]++
		}
	}
	return out
}

// The index of task records by volume is what a pass over every record
// finds, after any sequence of puts (new records, a record put again with
// another volume) and drops, whether applied as commits apply them or
// replayed from the log.
func TestJournalState_ByVolumeIsEveryRecord(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	s := newJournalState()
	for i := range 5000 {
		tid := fmt.Sprintf("alloc-%d/t/x", rng.IntN(40))
		name := fmt.Sprintf("v%d", rng.IntN(3))
		if rng.IntN(3) == 0 {
			s.apply(journalOp{Op: opDropTask, TaskID: tid, Name: name})
		} else {
			rec := taskRecord{TaskID: tid, Name: name, PluginID: fmt.Sprintf("p%d", rng.IntN(2)), VolumeID: fmt.Sprintf("vol-%d", rng.IntN(6))}
			s.apply(taskPut(rec))
		}
		if i%97 == 0 {
			must.Eq(t, scanUsers(s), indexed(s), must.Sprintf("after %d ops", i+1))
		}
	}
	must.Eq(t, scanUsers(s), indexed(s))
	must.MapNotEmpty(t, s.byVolume)

	// Put again under another volume: the record leaves the first.
	s = newJournalState()
	s.apply(taskPut(taskRecord{TaskID: "a", Name: "data", PluginID: "p", VolumeID: "one"}))
	s.apply(taskPut(taskRecord{TaskID: "a", Name: "data", PluginID: "p", VolumeID: "two"}))
	must.MapNotContainsKey(t, s.byVolume, volKey{"p", "one"})
	must.Eq(t, []taskRef{{"a", "data"}}, s.byVolume[volKey{"p", "two"}])
	s.apply(journalOp{Op: opDropTask, TaskID: "a", Name: "data"})
	must.MapEmpty(t, s.byVolume)
}

// A manager loaded from a journal counts a volume's users, and finds the
// other task holding it, from the records the log held.
func TestManager_UsersFromTheLog(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Logger = hclog.NewNullLogger() })
	ctx := context.Background()
	shared := req("data", "vol1", "/data")
	shared.AccessMode = AccessMultiNodeMultiWriter
	for _, id := range []string{"task-a", "task-b"} {
		_, err := h.m.Setup(ctx, id, []VolumeRequest{shared})
		must.NoError(t, err)
	}
	h.m.Close()
	h.m = h.newManager()
	must.Eq(t, 2, h.m.Users("p", "vol1"))
	// A single-node-writer request for the volume names the first other
	// task holding it, by task ID.
	single := req("data", "vol1", "/data")
	err := h.m.checkShare("task-c", single, "vol1")
	must.ErrorContains(t, err, "in use on this node")
	must.ErrorContains(t, err, `stop task "task-a"`)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.Eq(t, 1, h.m.Users("p", "vol1"))
	must.NoError(t, h.m.Teardown(ctx, "task-b"))
	must.Eq(t, 0, h.m.Users("p", "vol1"))
	h.m.mu.Lock()
	left := len(h.m.byVolume)
	h.m.mu.Unlock()
	must.Zero(t, left)
}

// BenchmarkShareCheck is what a setup asks of a volume before it is set
// up, and a teardown after, with many other tasks' volumes on the node:
// the sharing check and the count of the volume's users. Before the index
// by volume (journalState.byVolume) each was a pass over every task record
// of the node:
//
//	go test -run '^$' -bench ShareCheck ./csihook/
func BenchmarkShareCheck(b *testing.B) {
	for _, n := range []int{10, 1000, 10000} {
		b.Run(fmt.Sprintf("%d-tasks", n), func(b *testing.B) {
			h := newHarness(b, func(c *Config) { c.Logger = hclog.NewNullLogger() })
			for i := range n {
				rec := taskRecord{TaskID: fmt.Sprintf("alloc-%05d/t/x", i), Name: "data", PluginID: "p", VolumeID: fmt.Sprintf("vol-%05d", i),
					AccessMode: AccessSingleNodeWriter, AttachmentMode: AttachmentFileSystem, State: phasePublished}
				if err := h.m.commitLazy(taskPut(rec)); err != nil {
					b.Fatal(err)
				}
			}
			r := req("data", "vol-new", "/data")
			for b.Loop() {
				if err := h.m.checkShare("task-new", r, "vol-new"); err != nil {
					b.Fatal(err)
				}
				if h.m.Users("p", "vol-00000") != 1 {
					b.Fatal("the volume's user is not counted")
				}
			}
		})
	}
}

// TasksWithPrefix lists the task IDs with the prefix that hold records or
// volumes still to be released, each once, sorted; Tasks is all of them.
func TestManager_TasksWithPrefix(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Logger = hclog.NewNullLogger() })
	for _, id := range []string{"alloc-2/web/b", "alloc-1/web/a", "alloc-1/web/c", "alloc-1/webx/d", "alloc-1/db/e"} {
		rec := taskRecord{TaskID: id, Name: "data", PluginID: "p", VolumeID: "vol-" + id, State: phasePublished}
		must.NoError(t, h.m.commitLazy(taskPut(rec)))
	}
	h.m.mu.Lock()
	// One with records and a volume still to release, one with the volume
	// alone (its record gone).
	h.m.unreleased["alloc-1/web/c"] = map[volKey]string{{"p", "old"}: "data"}
	h.m.unreleased["alloc-1/web/f"] = map[volKey]string{{"p", "gone"}: "data"}
	h.m.mu.Unlock()
	must.Eq(t, []string{"alloc-1/web/a", "alloc-1/web/c", "alloc-1/web/f"}, h.m.TasksWithPrefix("alloc-1/web/"))
	must.Eq(t, []string{"alloc-2/web/b"}, h.m.TasksWithPrefix("alloc-2/"))
	must.SliceEmpty(t, h.m.TasksWithPrefix("alloc-3/"))
	must.Eq(t, []string{"alloc-1/db/e", "alloc-1/web/a", "alloc-1/web/c", "alloc-1/web/f", "alloc-1/webx/d", "alloc-2/web/b"}, h.m.Tasks())
}

// checkIndex fails unless the index by volume is exactly the task records:
// each record once, under its own volume, and no volume without one (an
// empty entry of the index is a volume the scan does not have).
func checkIndex(t *testing.T, s *journalState) {
	t.Helper()
	must.Eq(t, scanUsers(s), indexed(s))
}

// checkManagerIndex is checkIndex of a manager's records, read under its
// lock and compared after it (a failure must not leave the lock held for
// the manager's Close).
func checkManagerIndex(t *testing.T, m *Manager) {
	t.Helper()
	m.mu.Lock()
	scanned, index := scanUsers(m.journal.state), indexed(m.journal.state)
	m.mu.Unlock()
	must.Eq(t, scanned, index)
}

// The index is the records on every path that writes them besides a
// commit: a replay of the log (a record put again under another volume,
// dropped, put back), records of the file-per-record format moved in over
// the log (one of them naming another volume than the log's record of the
// same task volume), and the journal reopened after the compaction that
// took them in.
func TestJournal_ByVolumeThroughReplayAndMigration(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	for _, batch := range [][]journalOp{
		{taskPut(testTask("t1", "v1", phasePublished)), taskPut(testTask("t2", "v1", phasePublished))},
		{taskPut(testTask("t1", "v2", phasePublished))},
		{taskDrop("t2", "data"), taskPut(testTask("t3", "v1", phasePublishing))},
		{taskPut(testTask("t2", "v2", phasePublished)), taskDrop("t2", "data"), taskPut(testTask("t2", "v1", phasePublished))},
	} {
		must.NoError(t, j.commit(batch...))
	}
	// Nothing but this test's commits writes the records.
	checkIndex(t, j.state)
	live := indexed(j.state)
	j.close()

	j2, _ := openTestJournal(t, dir)
	checkIndex(t, j2.state)
	must.Eq(t, live, indexed(j2.state))
	j2.close()

	// t1's record file names v3, the log v2: the file wins, and t1 leaves v2.
	writeOldRecord(t, dir, taskPut(testTask("t1", "v3", phasePublished)))
	writeOldRecord(t, dir, taskPut(testTask("t4", "v2", phasePublished)))
	j3, _ := openTestJournal(t, dir)
	checkIndex(t, j3.state)
	must.Eq(t, []taskRef{{"t1", "data"}}, j3.state.byVolume[volKey{"p", "v3"}])
	must.Eq(t, []taskRef{{"t4", "data"}}, j3.state.byVolume[volKey{"p", "v2"}])
	must.NoError(t, j3.log.Compact())
	j3.close()
	j4, _ := openTestJournal(t, dir)
	checkIndex(t, j4.state)
	must.Eq(t, 2, len(j4.state.byVolume[volKey{"p", "v1"}]))
}

// Setups and teardowns of many tasks at once, on one shared volume and on
// a volume each, keep the index the records (run with -race: the index is
// read and written under the manager's lock only): all set up, the shared
// volume has each task once; all torn down, no volume has a user.
func TestManager_ByVolumeUnderConcurrency(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Logger = hclog.NewNullLogger() })
	ctx := context.Background()
	shared := req("shared", "vol-shared", "/shared")
	shared.AccessMode = AccessMultiNodeMultiWriter
	const n = 16
	each := func(f func(id string, own VolumeRequest) error) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- f(fmt.Sprintf("alloc-%d/web/x", i), req("own", fmt.Sprintf("vol-%d", i), "/own"))
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			must.NoError(t, err)
		}
	}
	for round := range 2 {
		each(func(id string, own VolumeRequest) error {
			_, err := h.m.Setup(ctx, id, []VolumeRequest{shared, own})
			_ = h.m.Users("p", "vol-shared")
			return err
		})
		checkManagerIndex(t, h.m)
		must.Eq(t, n, h.m.Users("p", "vol-shared"), must.Sprintf("round %d", round))
		must.Eq(t, 1, h.m.Users("p", "vol-3"))
		each(func(id string, _ VolumeRequest) error {
			if err := h.m.checkShare("other", shared, "vol-shared"); err != nil {
				return err
			}
			return h.m.Teardown(ctx, id)
		})
		checkManagerIndex(t, h.m)
		h.m.mu.Lock()
		users, records := len(h.m.byVolume), len(h.m.tasks)
		h.m.mu.Unlock()
		must.Eq(t, 0, users)
		must.Eq(t, 0, records)
	}
}
