package csihook

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/wal"
)

// openTestJournal opens the journal in dir, logging into the returned
// buffer, and closes it when the test ends.
func openTestJournal(t *testing.T, dir string) (*journal, *syncBuffer) {
	t.Helper()
	logs := &syncBuffer{}
	j, err := openJournal(dir, hclog.New(&hclog.LoggerOptions{Level: hclog.Trace, Output: logs}))
	must.NoError(t, err)
	t.Cleanup(j.close)
	return j, logs
}

func testVol(volume, stage string) volRecord {
	return volRecord{PluginID: "p", VolumeID: volume, StagingPath: "/staging/" + volume, NodeID: "node-1",
		AccessMode: AccessSingleNodeWriter, AttachmentMode: AttachmentFileSystem,
		Secrets: map[string]string{"token": canary}, Stage: stage}
}

func testTask(taskID, volume, state string) taskRecord {
	return taskRecord{TaskID: taskID, Name: "data", PluginID: "p", VolumeID: volume, Target: "/publish/" + taskID + "/data",
		Destination: "/data", AccessMode: AccessSingleNodeWriter, AttachmentMode: AttachmentFileSystem,
		Secrets: map[string]string{"token": canary}, State: state}
}

// summary describes a state by its records' keys and phases, sorted.
func (s *journalState) summary() []string {
	out := []string{}
	for _, v := range s.vols {
		out = append(out, fmt.Sprintf("vol %s/%s %s", v.PluginID, v.VolumeID, v.Stage))
	}
	for _, recs := range s.tasks {
		for _, t := range recs {
			out = append(out, fmt.Sprintf("task %s/%s %s %s", t.TaskID, t.Name, t.VolumeID, t.State))
		}
	}
	for _, c := range s.created {
		out = append(out, fmt.Sprintf("created %s/%s %s", c.PluginID, c.Name, c.VolumeID))
	}
	sort.Strings(out)
	return out
}

// encoded is a state's records in full, for exact comparison.
func (s *journalState) encoded(t *testing.T) string {
	t.Helper()
	data, err := json.Marshal(s.snapshot())
	must.NoError(t, err)
	return string(data)
}

func readLog(t *testing.T, dir string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, logName))
	must.NoError(t, err)
	return data
}

func TestJournal_ReplayOrderAndDrops(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	for _, batch := range [][]journalOp{
		{volPut(testVol("v1", phaseStaging)), taskPut(testTask("t1", "v1", phasePending))},
		{volPut(testVol("v1", phaseStaged)), taskPut(testTask("t1", "v1", phasePublishing))},
		{taskPut(testTask("t1", "v1", phasePublished))},
		{volPut(testVol("v2", phaseStaging)), taskPut(testTask("t2", "v2", phasePending))},
		{createdPut(createdRecord{PluginID: "p", Name: "made", VolumeID: "v-made"})},
		{taskDrop("t2", "data"), volDrop(volKey{"p", "v2"})},
		{createdPut(createdRecord{PluginID: "p", Name: "gone", VolumeID: "v-gone"})},
		{createdDrop("p", "gone")},
		// Within a batch, too, the last op of a record wins.
		{volPut(testVol("v3", phaseStaging)), volPut(testVol("v3", phaseStaged)), taskPut(testTask("t3", "v3", phasePending)), taskDrop("t3", "data")},
	} {
		must.NoError(t, j.commit(batch...))
	}
	want := []string{
		"created p/made v-made",
		"task t1/data v1 published",
		"vol p/v1 staged",
		"vol p/v3 staged",
	}
	must.Eq(t, want, j.state.summary())
	c, ok := j.created("p", "made")
	must.True(t, ok)
	must.Eq(t, "v-made", c.VolumeID)
	_, ok = j.created("p", "gone")
	must.False(t, ok)
	inMemory := j.state.encoded(t)

	// What the disk holds replays to the same records.
	scan := scanLog(readLog(t, dir), hclog.NewNullLogger())
	must.Eq(t, 0, scan.torn+scan.damaged+scan.badOps)
	must.Eq(t, inMemory, scan.state.encoded(t))

	j.close()
	j2, logs := openTestJournal(t, dir)
	must.Eq(t, inMemory, j2.state.encoded(t))
	vols, tasks := j2.records()
	must.Len(t, 2, vols)
	must.Len(t, 1, tasks)
	// Published, the task record needs its secrets no more.
	must.MapEmpty(t, tasks[0].Secrets)
	must.StrNotContains(t, logs.String(), canary)
}

// waitCleanedUp waits for the compaction a journal schedules when its log
// holds what only a compaction removes.
func waitCleanedUp(t *testing.T, j *journal) {
	t.Helper()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return !j.log.Stats().CleanupPending
	}), wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)))
}

// TestJournal_BatchAtomicOnTornTail cuts the last batch at every byte, as a
// crash during its write would, both by truncating the file and by leaving
// zeros where the rest of the batch should be (the file is zero-filled
// ahead of the log): replay gives the records before the batch or, with
// the whole batch, after it, never part of it.
func TestJournal_BatchAtomicOnTornTail(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaging)), taskPut(testTask("t1", "v1", phasePending))))
	must.NoError(t, j.commit(taskPut(testTask("t2", "v1", phasePublished))))
	before := j.state.encoded(t)
	start := j.log.Stats().Size
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaged)), taskPut(testTask("t1", "v1", phasePublishing)),
		taskDrop("t2", "data"), volPut(testVol("v2", phaseStaging))))
	after := j.state.encoded(t)
	end := j.log.Stats().Size
	must.NotEq(t, before, after)
	j.close()

	data := readLog(t, dir)
	must.Greater(t, end, int64(len(data))) // zeros after the log
	null := hclog.NewNullLogger()
	for cut := start; cut <= end; cut++ {
		zeroed := append([]byte(nil), data...)
		clear(zeroed[cut:end])
		for how, d := range map[string][]byte{"truncated": data[:cut], "zeroed": zeroed} {
			scan := scanLog(d, null)
			want, torn := before, cut > start && cut < end
			if cut == end {
				want = after
			}
			must.Eq(t, want, scan.state.encoded(t), must.Sprintf("%s at %d of %d..%d", how, cut, start, end))
			must.Eq(t, torn, scan.torn > 0, must.Sprintf("%s at %d", how, cut))
			must.Eq(t, 0, scan.damaged+scan.badOps, must.Sprintf("%s at %d", how, cut))
		}
	}

	// On disk: the torn batch is dropped and cut off, and the journal goes
	// on from the records before it.
	must.NoError(t, os.Truncate(filepath.Join(dir, logName), start+(end-start)/2))
	j2, logs := openTestJournal(t, dir)
	must.Eq(t, before, j2.state.encoded(t))
	must.StrContains(t, logs.String(), "journal ends in a partly written batch")
	must.StrContains(t, logs.String(), fmt.Sprintf("offset=%d bytes=%d", start, (end-start)/2))
	must.StrNotContains(t, logs.String(), "journal is damaged")
	bad, _ := filepath.Glob(filepath.Join(dir, "*.bad"))
	must.SliceEmpty(t, bad)
	must.StrNotContains(t, logs.String(), canary)
	scan := scanLog(readLog(t, dir), null)
	must.Eq(t, 0, scan.torn+scan.damaged)
	must.NoError(t, j2.commit(taskDrop("t1", "data")))
	j2.close()
	j3, _ := openTestJournal(t, dir)
	must.Eq(t, []string{"task t2/data v1 published", "vol p/v1 staging"}, j3.state.summary())
}

func TestJournal_CorruptTailTruncated(t *testing.T) {
	cases := []struct {
		name  string
		spoil func(data []byte, last, end int) []byte
	}{
		{"garbage after the log", func(d []byte, _, end int) []byte {
			return append(d[:end:end], []byte("\x07garbage that is no frame")...)
		}},
		{"bit flipped in the last batch", func(d []byte, last, _ int) []byte {
			d[last+wal.HeaderSize+3] ^= 0x10
			return d
		}},
		{"length of the last batch too long", func(d []byte, last, _ int) []byte {
			d[last+4] = 0xee
			return d
		}},
		{"half a header", func(d []byte, last, _ int) []byte { return d[:last+wal.HeaderSize/2] }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			j, _ := openTestJournal(t, dir)
			must.NoError(t, j.commit(volPut(testVol("v1", phaseStaged)), taskPut(testTask("t1", "v1", phasePublished))))
			before, last := j.state.encoded(t), int(j.log.Stats().Size)
			must.NoError(t, j.commit(taskPut(testTask("t2", "v1", phasePublishing))))
			end := int(j.log.Stats().Size)
			j.close()
			path := filepath.Join(dir, logName)
			must.NoError(t, os.WriteFile(path, tc.spoil(readLog(t, dir), last, end), 0o600))

			j2, logs := openTestJournal(t, dir)
			want := before
			if tc.name == "garbage after the log" {
				want = "" // the last batch is whole; only what follows it goes
			}
			if want != "" {
				must.Eq(t, want, j2.state.encoded(t))
			} else {
				must.Eq(t, []string{"task t1/data v1 published", "task t2/data v1 publishing", "vol p/v1 staged"}, j2.state.summary())
			}
			must.StrContains(t, logs.String(), "journal ends in a partly written batch")
			must.StrNotContains(t, logs.String(), "journal is damaged")
			must.StrNotContains(t, logs.String(), canary)
			scan := scanLog(readLog(t, dir), hclog.NewNullLogger())
			must.Eq(t, 0, scan.torn+scan.damaged+scan.badOps)
			must.Eq(t, j2.state.encoded(t), scan.state.encoded(t))
			matches, _ := filepath.Glob(filepath.Join(dir, "*.bad"))
			must.SliceEmpty(t, matches)
		})
	}
}

// TestJournal_DamageInTheMiddle: a damaged batch followed by intact ones is
// skipped, loudly, and the batches after it are kept: they are newer and
// say what is mounted now. A copy of the log as it was is kept.
func TestJournal_DamageInTheMiddle(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaged)), taskPut(testTask("t1", "v1", phasePublished))))
	second := int(j.log.Stats().Size)
	must.NoError(t, j.commit(taskPut(testTask("t2", "v1", phasePublished))))
	third := int(j.log.Stats().Size)
	must.NoError(t, j.commit(volPut(testVol("v2", phaseStaging))))
	must.NoError(t, j.commit(volPut(testVol("v2", phaseStaged))))
	j.close()
	path := filepath.Join(dir, logName)
	data := readLog(t, dir)
	data[second+wal.HeaderSize+10] ^= 0x01
	must.NoError(t, os.WriteFile(path, data, 0o600))

	j2, logs := openTestJournal(t, dir)
	// Kept: the batches before and after the damaged one (t2 is lost).
	must.Eq(t, []string{"task t1/data v1 published", "vol p/v1 staged", "vol p/v2 staged"}, j2.state.summary())
	// Reported: what is lost, how much, and where the copy is.
	must.StrContains(t, logs.String(), "journal is damaged")
	must.StrContains(t, logs.String(), "[ERROR]")
	must.StrContains(t, logs.String(), fmt.Sprintf("damaged_bytes=%d unusable_records=0", third-second))
	must.StrNotContains(t, logs.String(), canary)
	bad, err := filepath.Glob(filepath.Join(dir, logName+".*.bad"))
	must.NoError(t, err)
	must.Len(t, 1, bad)
	must.StrContains(t, logs.String(), "path="+path+" copy="+bad[0])
	kept, err := os.ReadFile(bad[0])
	must.NoError(t, err)
	must.Eq(t, bytes.TrimRight(data, "\x00"), kept)
	fi, err := os.Stat(bad[0])
	must.NoError(t, err)
	must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())
	// The log itself is whole again once the compaction scheduled at
	// open is done.
	waitCleanedUp(t, j2)
	scan := scanLog(readLog(t, dir), hclog.NewNullLogger())
	must.Eq(t, 0, scan.torn+scan.damaged+scan.badOps)
}

func TestJournal_RecordOfAnotherVersionSkipped(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaged))))
	v := testVol("v2", phaseStaged)
	v.Version = journalVersion + 1
	// Written as is, past the checks a commit makes.
	payload, err := encodeBatch([]journalOp{{Op: opPutVol, Vol: &v}, volDrop(volKey{"p", "v1"})})
	must.NoError(t, err)
	must.NoError(t, j.log.Append(payload, false, nil))
	j.close()

	j2, logs := openTestJournal(t, dir)
	// The drop in the same batch is valid and applied.
	must.SliceEmpty(t, j2.state.summary())
	must.StrContains(t, logs.String(), "journal record cannot be used")
	must.StrContains(t, logs.String(), "volume_id=v2")
	must.StrNotContains(t, logs.String(), canary)
	bad, _ := filepath.Glob(filepath.Join(dir, "*.bad"))
	must.Len(t, 1, bad)
}

func TestJournal_CompactionKeepsLiveRecords(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	j.log.SetLimits(8<<10, 8<<10)
	for i := range 400 {
		vol := fmt.Sprintf("v%d", i%7)
		task := fmt.Sprintf("t%d", i%11)
		ops := []journalOp{volPut(testVol(vol, phaseStaged)), taskPut(testTask(task, vol, phasePublished))}
		if i%3 == 0 {
			ops = append(ops, taskDrop(fmt.Sprintf("t%d", (i+5)%11), "data"))
		}
		if i%5 == 0 {
			ops = append(ops, volDrop(volKey{"p", fmt.Sprintf("v%d", (i+3)%7)}))
		}
		must.NoError(t, j.commit(ops...))
		st := j.log.Stats()
		size, limit := st.Size, st.Limit
		must.LessEq(t, limit, size, must.Sprintf("commit %d", i))
	}
	live := j.state.encoded(t)
	must.Less(t, int64(16<<10), j.log.Stats().Size) // 400 commits of ~1.5 KiB each would be ~600 KiB
	fi, err := os.Stat(filepath.Join(dir, logName))
	must.NoError(t, err)
	must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())
	scan := scanLog(readLog(t, dir), hclog.NewNullLogger())
	must.Eq(t, 0, scan.torn+scan.damaged+scan.badOps)
	must.Eq(t, live, scan.state.encoded(t))
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	must.Len(t, 2, entries) // .lock and the log, no temp file left
	j.close()

	// Opening writes nothing (it must work on a full disk): the log is
	// replayed as it is, and compacted with a later commit once it has
	// grown past its limit.
	before := readLog(t, dir)
	j2, _ := openTestJournal(t, dir)
	must.Eq(t, live, j2.state.encoded(t))
	must.Eq(t, before, readLog(t, dir))
	must.Eq(t, 0, j2.log.Stats().Compactions)
	j2.log.SetLimits(wal.DefaultCompactMin, 0) // as when it has grown past its limit
	must.NoError(t, j2.commit(volPut(testVol("v-last", phaseStaged))))
	must.Eq(t, 1, j2.log.Stats().Compactions)
	snapshot, err := encodeSnapshot(j2.state.snapshot())
	must.NoError(t, err)
	must.Eq(t, int64(len(snapshot)), j2.log.Stats().Size)
	must.Eq(t, j2.state.encoded(t), diskJournal(t, dir).encoded(t))
}

func TestJournal_ConcurrentCommits(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 20 {
				task := fmt.Sprintf("t%d-%d", g, i)
				if err := j.commit(taskPut(testTask(task, "v1", phasePending))); err != nil {
					t.Error(err)
				}
				if err := j.commit(taskPut(testTask(task, "v1", phasePublished))); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	must.MapLen(t, 160, j.state.tasks)
	must.Eq(t, 320, j.log.Stats().Batches)
	must.LessEq(t, 320, j.log.Stats().Syncs)
	live := j.state.encoded(t)
	j.close()
	j2, _ := openTestJournal(t, dir)
	must.Eq(t, live, j2.state.encoded(t))
}

func TestJournal_ClosedRefusesCommits(t *testing.T) {
	j, _ := openTestJournal(t, t.TempDir())
	j.close()
	must.ErrorContains(t, j.commit(volDrop(volKey{"p", "v"})), "is closed")
}

// writeOldRecord writes a put's record as the file-per-record journal did.
func writeOldRecord(t *testing.T, dir string, o journalOp) string {
	t.Helper()
	var rec any
	switch {
	case o.Vol != nil:
		rec = o.Vol
	case o.Task != nil:
		rec = o.Task
	default:
		rec = o.Created
	}
	data, err := json.Marshal(rec)
	must.NoError(t, err)
	path := filepath.Join(dir, o.fileName())
	must.NoError(t, os.WriteFile(path, data, 0o600))
	return path
}

func TestJournal_MigratesFilePerRecordFormat(t *testing.T) {
	dir := t.TempDir()
	must.NoError(t, os.MkdirAll(dir, 0o700))
	writeOldRecord(t, dir, volPut(testVol("v1", phaseStaged)))
	writeOldRecord(t, dir, taskPut(testTask("t1", "v1", phasePublished)))
	writeOldRecord(t, dir, createdPut(createdRecord{PluginID: "p", Name: "made", VolumeID: "v-made",
		VolumeContext: map[string]string{"k": "v"}}))
	// Set aside: another version, no target, a name not matching the ids.
	other := taskPut(testTask("t2", "v1", phasePublished))
	other.Task.Version = 7
	writeOldRecord(t, dir, other)
	noTarget := taskPut(testTask("t3", "v1", phasePublished))
	noTarget.Task.Target = ""
	writeOldRecord(t, dir, noTarget)
	moved := writeOldRecord(t, dir, volPut(testVol("v9", phaseStaged)))
	must.NoError(t, os.Rename(moved, filepath.Join(dir, "v-0000000000000000.json")))
	must.NoError(t, os.WriteFile(filepath.Join(dir, "c-1111111111111111.json"), []byte(`{"password":"`+canary), 0o600))
	must.NoError(t, os.WriteFile(filepath.Join(dir, ".tmp-42"), []byte("half"), 0o600))

	j, logs := openTestJournal(t, dir)
	want := []string{"created p/made v-made", "task t1/data v1 published", "vol p/v1 staged"}
	must.Eq(t, want, j.state.summary())
	// The files go once the log holds their records, after the
	// compaction scheduled at open.
	waitCleanedUp(t, j)
	c, ok := j.created("p", "made")
	must.True(t, ok)
	must.Eq(t, "v", c.VolumeContext["k"])
	// A staged volume without an attachment needs its secrets no more.
	must.MapEmpty(t, j.state.vols[volKey{"p", "v1"}].Secrets)
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	must.Eq(t, sortedStrings([]string{
		".lock",
		"c-1111111111111111.json.bad",
		logName,
		noTarget.fileName() + ".bad",
		other.fileName() + ".bad",
		"v-0000000000000000.json.bad",
	}), sortedStrings(names))
	out := logs.String()
	must.StrContains(t, out, "unreadable journal record set aside")
	must.StrContains(t, out, "record version 7")
	must.StrContains(t, out, "moved journal records from one file each into the log")
	must.StrNotContains(t, out, canary)
	fi, err := os.Stat(filepath.Join(dir, logName))
	must.NoError(t, err)
	must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())
	j.close()

	// The log holds them durably now.
	j2, _ := openTestJournal(t, dir)
	must.Eq(t, want, j2.state.summary())
}

// An old file beside the log is from a start that moved it into the log
// but stopped before removing it, or from an older driver that ran after
// this one: either way it is at least as new as the log's record.
func TestJournal_MigrationOverLog(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaging)), taskPut(testTask("t1", "v1", phasePending))))
	j.close()
	writeOldRecord(t, dir, volPut(testVol("v1", phaseStaged)))
	j2, _ := openTestJournal(t, dir)
	must.Eq(t, []string{"task t1/data v1 pending", "vol p/v1 staged"}, j2.state.summary())
	waitCleanedUp(t, j2)
	matches, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	must.SliceEmpty(t, matches)
}

func sortedStrings(s []string) []string {
	out := append([]string(nil), s...)
	sort.Strings(out)
	return out
}

// A lazy commit is in the log at once (a driver that dies after it loses
// nothing) but costs no fdatasync: the next commit's covers it, or a sync
// of its own within lazySyncDelay, or close.
func TestJournal_LazyCommits(t *testing.T) {
	old := lazySyncDelay
	lazySyncDelay = 50 * time.Millisecond
	t.Cleanup(func() { lazySyncDelay = old })
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	syncs := func() int {
		return j.log.Stats().Syncs
	}
	unsynced := func() bool {
		return j.log.Stats().Unsynced
	}

	base := syncs()
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaging))))
	must.Eq(t, base+1, syncs())
	must.NoError(t, j.commitLazy(volPut(testVol("v1", phaseStaged))))
	must.Eq(t, base+1, syncs())
	must.True(t, unsynced())
	// Another reader of the file sees it already.
	st, err := ReadJournal(dir)
	must.NoError(t, err)
	must.Eq(t, phaseStaged, st.Volumes[0].Stage)

	// The next commit syncs both.
	must.NoError(t, j.commit(taskPut(testTask("t1", "v1", phasePublishing))))
	must.Eq(t, base+2, syncs())
	must.False(t, unsynced())

	// Alone, a lazy commit is synced within lazySyncDelay.
	must.NoError(t, j.commitLazy(taskPut(testTask("t1", "v1", phasePublished))))
	must.True(t, unsynced())
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return !unsynced() }),
		wait.Timeout(5*time.Second), wait.Gap(10*time.Millisecond)))
	must.Eq(t, base+3, syncs())

	// And close syncs what is left.
	must.NoError(t, j.commitLazy(taskDrop("t1", "data")))
	must.True(t, unsynced())
	live := j.state.encoded(t)
	j.close()
	must.False(t, unsynced())
	must.Eq(t, base+4, syncs())
	j2, _ := openTestJournal(t, dir)
	must.Eq(t, live, j2.state.encoded(t))
}
