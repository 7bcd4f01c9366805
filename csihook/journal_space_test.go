package csihook

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/wal"
)

// setCompactDelay sets compactDelay for the test.
func setCompactDelay(t *testing.T, d time.Duration) {
	t.Helper()
	old := compactDelay
	compactDelay = d
	t.Cleanup(func() { compactDelay = old })
}

// mountTmpfs mounts a tmpfs of size under the test's temp dir and
// unmounts it when the test ends, failed or not. It needs root.
func mountTmpfs(t *testing.T, size string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a size-limited tmpfs")
	}
	dir := filepath.Join(t.TempDir(), "fs")
	must.NoError(t, os.Mkdir(dir, 0o700))
	must.NoError(t, unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size="+size+",mode=0700"))
	// Registered after t.TempDir's removal, so it runs before it.
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("failed to unmount %s: %v", dir, err)
		}
	})
	return dir
}

// fill writes a file into fsDir until the file system is full, and
// returns the file's path.
func fill(t *testing.T, fsDir string) string {
	t.Helper()
	path := filepath.Join(fsDir, "filler")
	f, err := os.Create(path)
	must.NoError(t, err)
	defer f.Close()
	for _, n := range []int{1 << 20, 4 << 10, 1} {
		buf := make([]byte, n)
		for {
			_, err := f.Write(buf)
			if err != nil {
				must.ErrorIs(t, err, syscall.ENOSPC)
				break
			}
		}
	}
	var st unix.Statfs_t
	must.NoError(t, unix.Statfs(fsDir, &st))
	must.Eq(t, uint64(0), st.Bavail, must.Sprint("the file system is not full"))
	return path
}

func waitLog(t *testing.T, logs *syncBuffer, sub string) {
	t.Helper()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return strings.Contains(logs.String(), sub) }),
		wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)), must.Sprintf("no log line %q in:\n%s", sub, logs))
}

func tmpFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, ".tmp-*"))
	must.NoError(t, err)
	return m
}

// TestJournal_OpensOnFullDisk: a journal on a full file system opens and
// replays its records (it writes nothing that needs space), goes on taking
// commits into the space zero-filled ahead, and the compaction it wants
// (to drop secrets no record needs, or damage) fails harmlessly, leaving
// the log in use, until there is space again. It needs root.
func TestJournal_OpensOnFullDisk(t *testing.T) {
	setCompactDelay(t, time.Hour)
	other := map[string]string{"token": "another-secret"}
	cases := []struct {
		name string
		// damage spoils the log at the offset of its second batch.
		damage bool
	}{
		{name: "secrets to drop"},
		{name: "damaged in the middle", damage: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fsDir := mountTmpfs(t, "4m")
			dir := filepath.Join(fsDir, "journal")
			j, _ := openTestJournal(t, dir)
			must.NoError(t, j.commit(volPut(testVol("v1", phaseStaging)), taskPut(testTask("t1", "v1", phasePublishing))))
			second := int(j.log.Stats().Size)
			// Published and staged: the log holds secrets no record needs.
			must.NoError(t, j.commit(volPut(testVol("v1", phaseStaged)), taskPut(testTask("t1", "v1", phasePublished))))
			v2 := testVol("v2", phaseStaging)
			v2.Secrets = other
			must.NoError(t, j.commit(volPut(v2)))
			j.close()
			if tc.damage {
				data := readLog(t, dir)
				data[second+wal.HeaderSize+10] ^= 0x01
				must.NoError(t, os.WriteFile(filepath.Join(dir, logName), data, 0o600))
			}
			want := scanLog(readLog(t, dir), hclog.NewNullLogger()).state
			want.dropUnneededSecrets()
			filler := fill(t, fsDir)
			before := readLog(t, dir)
			must.StrContains(t, string(before), canary)

			j2, logs := openTestJournal(t, dir)
			must.Eq(t, want.encoded(t), j2.state.encoded(t))
			// The compaction scheduled at open cannot write its file.
			waitLog(t, logs, "failed to compact the journal; the log stays in use as it is")
			must.StrContains(t, logs.String(), "no space left on device")
			must.Eq(t, before, readLog(t, dir))
			must.SliceEmpty(t, tmpFiles(t, dir))
			if tc.damage {
				must.StrContains(t, logs.String(), "no copy of it could be kept yet")
				bad, _ := filepath.Glob(filepath.Join(dir, "*.bad"))
				must.SliceEmpty(t, bad)
			}
			// A compaction past the size limit fails the same way.
			j2.log.SetLimits(wal.DefaultCompactMin, 0)
			must.NoError(t, j2.commit(taskDrop("t1", "data")))
			waitLog(t, logs, "failed to compact the journal; it goes on growing")
			must.SliceEmpty(t, tmpFiles(t, dir))
			// The log stays in use: commits land in its zero-filled space.
			must.NoError(t, j2.commit(volPut(testVol("v3", phaseStaged))))
			live := j2.state.encoded(t)
			must.Eq(t, live, scanLog(readLog(t, dir), hclog.NewNullLogger()).state.encoded(t))
			must.Eq(t, 0, j2.log.Stats().Compactions)
			j2.close()

			// With space again, the next start compacts: the secrets no
			// record needs are gone from the file, a damaged log is
			// copied first.
			must.NoError(t, os.Remove(filler))
			j3, logs3 := openTestJournal(t, dir)
			must.Eq(t, live, j3.state.encoded(t))
			waitCleanedUp(t, j3)
			must.Eq(t, 1, j3.log.Stats().Compactions)
			after := readLog(t, dir)
			// Only what a live record needs: when the batch that
			// finished v1 and t1 is lost to damage, they are still
			// being staged and published, and need theirs.
			must.Eq(t, tc.damage, strings.Contains(live, canary))
			must.Eq(t, tc.damage, bytes.Contains(after, []byte(canary)))
			must.StrContains(t, string(after), other["token"], must.Sprint("a volume being staged keeps its secrets"))
			must.Eq(t, live, diskJournal(t, dir).encoded(t))
			bad, _ := filepath.Glob(filepath.Join(dir, "*.bad"))
			if tc.damage {
				must.Len(t, 1, bad)
				must.StrContains(t, logs3.String(), "copy="+bad[0])
			} else {
				must.SliceEmpty(t, bad)
			}
		})
	}
}

// failCompactions makes every compaction's write fail, as on a full disk,
// until the test ends.
func failCompactions(t *testing.T) {
	t.Helper()
	old := createTemp
	createTemp = func(dir, pattern string) (*os.File, error) {
		f, err := os.CreateTemp(dir, pattern)
		if err != nil {
			return nil, err
		}
		name := f.Name()
		f.Close()
		// Read-only: writing it fails.
		return os.Open(name)
	}
	t.Cleanup(func() { createTemp = old })
}

// TestJournal_FailedCompactionLeavesTheLogInUse is the unprivileged
// counterpart of TestJournal_OpensOnFullDisk: compactions whose write
// fails leave the old log in use, its records and later commits intact,
// and nothing behind.
func TestJournal_FailedCompactionLeavesTheLogInUse(t *testing.T) {
	setCompactDelay(t, time.Hour)
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaging)), taskPut(testTask("t1", "v1", phasePublishing))))
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaged)), taskPut(testTask("t1", "v1", phasePublished))))
	j.close()
	failCompactions(t)

	// Opening does not need the compaction it schedules (for the secrets
	// the log holds that no record needs).
	j2, logs := openTestJournal(t, dir)
	waitLog(t, logs, "failed to compact the journal; the log stays in use as it is")
	j2.log.SetLimits(wal.DefaultCompactMin, 0)
	must.NoError(t, j2.commit(taskPut(testTask("t2", "v1", phasePublishing))))
	waitLog(t, logs, "failed to compact the journal; it goes on growing")
	must.NoError(t, j2.commit(taskPut(testTask("t2", "v1", phasePublished))))
	must.Eq(t, 0, j2.log.Stats().Compactions)
	must.SliceEmpty(t, tmpFiles(t, dir))
	live := j2.state.encoded(t)
	must.Eq(t, []string{"task t1/data v1 published", "task t2/data v1 published", "vol p/v1 staged"}, j2.state.summary())
	j2.close()
	j3, _ := openTestJournal(t, dir)
	must.Eq(t, live, j3.state.encoded(t))
}

// TestJournal_SnapshotOfManyLargeRecords: records a job can make large (a
// context within MaxMapBytes that JSON writes at six bytes a byte), more
// of them than fit in one frame, are compacted into frames of bounded
// size and read back.
func TestJournal_SnapshotOfManyLargeRecords(t *testing.T) {
	dir := t.TempDir()
	j, logs := openTestJournal(t, dir)
	big := strings.Repeat("<", MaxMapBytes-1)
	const n = 180 // 180 records of ~384 KiB: more than wal.MaxFrame together
	// As if committed one by one (each fits a frame easily), without
	// writing each.
	j.mu.Lock()
	for i := range n {
		tr := testTask(fmt.Sprintf("t%03d", i), "v1", phasePublished)
		tr.VolumeContext = map[string]string{"k": big}
		j.state.apply(taskPut(tr).forDisk())
	}
	j.mu.Unlock()
	// The next commit compacts.
	j.log.SetLimits(wal.DefaultCompactMin, 0)
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaged))))
	must.Eq(t, 1, j.log.Stats().Compactions)
	must.StrNotContains(t, logs.String(), "failed to compact")
	must.Greater(t, int64(wal.MaxFrame), j.log.Stats().Size)

	data := readLog(t, dir)
	frames := 0
	for off := 0; off < int(j.log.Stats().Size); frames++ {
		payload, next, ok := wal.ReadFrame(data, off)
		must.True(t, ok, must.Sprintf("no frame at %d", off))
		must.LessEq(t, snapshotFrame, len(payload))
		off = next
	}
	must.Greater(t, 60, frames)
	j.close()

	j2, _ := openTestJournal(t, dir)
	vols, tasks := j2.records()
	must.SliceLen(t, 1, vols)
	must.SliceLen(t, n, tasks)
	for _, tr := range tasks {
		// Not must.Eq: a diff of this takes long.
		must.True(t, tr.VolumeContext["k"] == big, must.Sprintf("task %s read back with another context", tr.TaskID))
	}
}

// TestJournal_BadCopiesRotated: each start that finds the log damaged
// keeps a copy of it, mode 0600 (it holds secrets), says where, and keeps
// only the newest three.
func TestJournal_BadCopiesRotated(t *testing.T) {
	setCompactDelay(t, time.Millisecond)
	dir := t.TempDir()
	copyRE := regexp.MustCompile(`copy=(\S+\.bad)`)
	var made []string
	const keep = 3 // at most a few copies: they hold secrets
	for round := range keep + 2 {
		j, _ := openTestJournal(t, dir)
		vol := fmt.Sprintf("v%d", round)
		must.NoError(t, j.commit(volPut(testVol(vol+"a", phaseStaging))))
		second := int(j.log.Stats().Size)
		must.NoError(t, j.commit(volPut(testVol(vol+"b", phaseStaging))))
		must.NoError(t, j.commit(volPut(testVol(vol+"c", phaseStaging))))
		j.close()
		data := readLog(t, dir)
		data[second+wal.HeaderSize+10] ^= 0x01
		must.NoError(t, os.WriteFile(filepath.Join(dir, logName), data, 0o600))

		j2, logs := openTestJournal(t, dir)
		m := copyRE.FindStringSubmatch(logs.String())
		must.SliceLen(t, 2, m, must.Sprintf("no copy named in:\n%s", logs))
		must.StrContains(t, logs.String(), "journal is damaged")
		made = append(made, m[1])
		if round >= keep {
			must.StrContains(t, logs.String(), "removed old copies of a damaged journal")
		}
		waitCleanedUp(t, j2)
		j2.close()
	}
	copies, err := filepath.Glob(filepath.Join(dir, logName+".*.bad"))
	must.NoError(t, err)
	sort.Strings(copies)
	must.Eq(t, made[len(made)-keep:], copies)
	for _, c := range copies {
		fi, err := os.Stat(c)
		must.NoError(t, err)
		must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())
	}
}

// TestSecrets_LeaveTheLogOnceNoCallNeedsThem: the journal keeps a secret
// on disk only while a call that takes it may still be made for the
// record: NodeStage and NodePublish until they are done,
// ControllerUnpublish while the volume is attached. Once published and
// staged, a volume of a plugin without ControllerPublish has none left in
// the log file; one attached keeps them in its volume record, and after a
// restart they reach ControllerUnpublishVolume. A volume staged again
// after a restart takes the request's secrets.
func TestSecrets_LeaveTheLogOnceNoCallNeedsThem(t *testing.T) {
	setCompactDelay(t, time.Millisecond)
	ctx := context.Background()
	logFile := func(h *harness) []byte {
		data, err := os.ReadFile(filepath.Join(h.root, "journal", logName))
		must.NoError(t, err)
		return data
	}
	waitNoCanary := func(h *harness) {
		t.Helper()
		must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return !bytes.Contains(logFile(h), []byte(canary)) }),
			wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)), must.Sprint("the secret stays in the journal"))
	}
	r := req("data", "vol1", "/data")
	r.AccessMode = AccessMultiNodeMultiWriter

	t.Run("staged, not attached", func(t *testing.T) {
		h := newHarness(t)
		p := fullPlugin("p")
		p.ControllerPublish = false
		h.setPlugin(p)
		_, err := h.m.Setup(ctx, "t1", []VolumeRequest{r})
		must.NoError(t, err)
		waitNoCanary(h)
		must.Eq(t, []string{"task t1/data published", "vol p/vol1 staged/"}, h.journalRecords())

		// After a restart the staging mount is gone: staging it again
		// for another task takes that request's secrets.
		h.restart()
		must.NoError(t, h.mnt.Unmount(h.m.StagingPath("p", "vol1")))
		h.fake.ResetCalls()
		_, err = h.m.Setup(ctx, "t2", []VolumeRequest{r})
		must.NoError(t, err)
		stages := 0
		for _, c := range h.fake.Calls() {
			if c.Method == MethodNodeStageVolume || c.Method == MethodNodePublishVolume {
				must.Eq(t, canary, c.Secrets["token"], must.Sprint(c.Method))
				stages++
			}
		}
		must.Eq(t, 2, stages)
		waitNoCanary(h)
	})

	t.Run("attached", func(t *testing.T) {
		h := newHarness(t)
		_, err := h.m.Setup(ctx, "t1", []VolumeRequest{r})
		must.NoError(t, err)
		// The task record loses its secrets; the volume record keeps
		// them for ControllerUnpublishVolume.
		must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
			return bytes.Count(logFile(h), []byte(canary)) == 1
		}), wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)))
		disk := diskJournal(t, filepath.Join(h.root, "journal"))
		must.Eq(t, canary, disk.vols[volKey{"p", "vol1"}].Secrets["token"])
		must.MapEmpty(t, disk.task("t1", "data").Secrets)

		h.restart()
		h.fake.ResetCalls()
		must.NoError(t, h.m.Teardown(ctx, "t1"))
		must.Eq(t, 1, h.fake.Count(MethodControllerUnpublishVolume))
		for _, c := range h.fake.Calls() {
			if c.Method == MethodControllerUnpublishVolume {
				must.Eq(t, canary, c.Secrets["token"])
			}
		}
		waitNoCanary(h)
		must.SliceEmpty(t, h.journalRecords())
	})
}

// The error a failed compaction returns names the journal, whatever
// failed.
func TestJournal_CompactionErrorNamesTheJournal(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	failCompactions(t)
	err := j.log.Compact()
	must.Error(t, err)
	must.StrContains(t, err.Error(), `failed to compact journal "`+filepath.Join(dir, logName)+`"`)
	must.True(t, errors.Is(err, os.ErrClosed) || errors.Is(err, syscall.EBADF), must.Sprint(err))
}

// A log written before records were kept without the secrets no call
// needs (a build before forDisk) holds them in the puts of records that
// need none, such as the last put of a staged volume or a published task.
// Once such a record is dropped, no live record holds them, yet the log
// does: opening it asks for the compaction that removes them, as it does
// for the secrets of a record a later put replaced.
func TestSecrets_DroppedRecordsOfAnOlderLogAreCompactedAway(t *testing.T) {
	setCompactDelay(t, time.Millisecond)
	dir := t.TempDir()
	var data []byte
	for _, batch := range [][]journalOp{
		// A compaction of the older build wrote each record whole.
		{volPut(testVol("v1", phaseStaged)), taskPut(testTask("t1", "v1", phasePublished))},
		{taskDrop("t1", "data"), volDrop(volKey{"p", "v1"})},
	} {
		frame, err := encodeFrame(batch)
		must.NoError(t, err)
		data = append(data, frame...)
	}
	must.NoError(t, os.WriteFile(filepath.Join(dir, logName), data, 0o600))

	j, _ := openTestJournal(t, dir)
	vols, tasks := j.records()
	must.SliceEmpty(t, vols)
	must.SliceEmpty(t, tasks)
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return !bytes.Contains(readLog(t, dir), []byte(canary))
	}), wait.Timeout(5*time.Second), wait.Gap(5*time.Millisecond)), must.Sprint("the secrets of dropped records stay in the log"))
}
