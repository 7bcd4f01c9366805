package csihook

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/wal"
)

// TestReadJournal reads a journal a manager has open: it sees what the
// manager wrote, never a secret, and changes nothing on disk.
func TestReadJournal(t *testing.T) {
	h := newHarness(t)
	dir := filepath.Join(h.root, "journal")
	st, err := ReadJournal(dir)
	must.NoError(t, err)
	must.True(t, st.Empty())

	r := req("data", "vol1", "/data")
	_, err = h.m.Setup(t.Context(), "task-a", []VolumeRequest{r})
	must.NoError(t, err)
	before, err := os.ReadFile(filepath.Join(dir, logName))
	must.NoError(t, err)
	st, err = ReadJournal(dir)
	must.NoError(t, err)
	must.False(t, st.Empty())
	must.Eq(t, []JournalVolume{{PluginID: "p", VolumeID: "vol1", StagingPath: h.m.StagingPath("p", "vol1"),
		NodeID: "node-1", Stage: phaseStaged, Controller: phasePublished}}, st.Volumes)
	must.Eq(t, []JournalTask{{TaskID: "task-a", Name: "data", PluginID: "p", VolumeID: "vol1",
		Target: h.m.TargetPath("task-a", "data"), Destination: "/data", State: phasePublished, Invocation: true}}, st.Tasks)
	must.SliceEmpty(t, st.Files)
	must.StrNotContains(t, fmt.Sprintf("%#v", st), canary)
	after, err := os.ReadFile(filepath.Join(dir, logName))
	must.NoError(t, err)
	must.Eq(t, before, after)

	must.NoError(t, h.m.Teardown(t.Context(), "task-a"))
	st, err = ReadJournal(dir)
	must.NoError(t, err)
	must.True(t, st.Empty())
}

// TestReadJournal_CreatedNames: a volume created under a job's name is
// read with that name and the plugin's id, and the name stays known after
// the volume is released, as the manager keeps it.
func TestReadJournal_CreatedNames(t *testing.T) {
	h := newHarness(t)
	dir := filepath.Join(h.root, "journal")
	r := req("data", "acc-hold-1", "/data")
	r.Create = &CreateRequest{}
	plain := req("logs", "vol-by-id", "/logs")
	_, err := h.m.Setup(t.Context(), "task-a", []VolumeRequest{r, plain})
	must.NoError(t, err)
	st, err := ReadJournal(dir)
	must.NoError(t, err)
	must.Eq(t, []JournalCreated{{PluginID: "p", Name: "acc-hold-1", VolumeID: "id-acc-hold-1"}}, st.Created)
	must.Eq(t, []string{"acc-hold-1"}, st.NamesOf("p", "id-acc-hold-1"))
	must.SliceEmpty(t, st.NamesOf("p", "vol-by-id"))
	must.SliceEmpty(t, st.NamesOf("other", "id-acc-hold-1"))
	var ids []string
	for _, v := range st.Volumes {
		ids = append(ids, v.VolumeID)
	}
	must.Eq(t, []string{"id-acc-hold-1", "vol-by-id"}, ids)

	must.NoError(t, h.m.Teardown(t.Context(), "task-a"))
	st, err = ReadJournal(dir)
	must.NoError(t, err)
	must.True(t, st.Empty())
	must.Eq(t, []string{"acc-hold-1"}, st.NamesOf("p", "id-acc-hold-1"))
}

// TestReadJournal_TornTailAndDamage: a batch cut short at the end, as
// while it is being written, is not there yet; damage before the end is
// an error, returned with what the intact batches hold.
func TestReadJournal_TornTailAndDamage(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	must.NoError(t, j.commit(volPut(testVol("v1", phaseStaged)), taskPut(testTask("t1", "v1", phasePublished))))
	second := int(j.log.Stats().Size)
	must.NoError(t, j.commit(volPut(testVol("v2", phaseStaged))))
	must.NoError(t, j.commit(volPut(testVol("v3", phaseStaged))))
	end := int(j.log.Stats().Size)
	j.close()
	path := filepath.Join(dir, logName)
	data, err := os.ReadFile(path)
	must.NoError(t, err)

	frame, err := encodeFrame([]journalOp{volPut(testVol("v4", phaseStaging))})
	must.NoError(t, err)
	torn := append([]byte(nil), data...)
	copy(torn[end:], frame[:len(frame)/2])
	must.NoError(t, os.WriteFile(path, torn, 0o600))
	st, err := ReadJournal(dir)
	must.NoError(t, err)
	must.Eq(t, []string{"v1", "v2", "v3"}, volumeIDs(st))
	must.Len(t, 1, st.Tasks)

	damaged := append([]byte(nil), data...)
	damaged[second+wal.HeaderSize+4] ^= 0x01
	must.NoError(t, os.WriteFile(path, damaged, 0o600))
	must.NoError(t, os.WriteFile(filepath.Join(dir, "v-0000000000000000.json.bad"), []byte("{"), 0o600))
	st, err = ReadJournal(dir)
	must.ErrorContains(t, err, "is damaged")
	must.Eq(t, []string{"v1", "v3"}, volumeIDs(st))
	must.Eq(t, []string{"v-0000000000000000.json.bad"}, st.Files)
}

func volumeIDs(st JournalState) []string {
	var out []string
	for _, v := range st.Volumes {
		out = append(out, v.VolumeID)
	}
	return out
}

// A task record's invocation mark names the task's state directory after a
// crash of the host lost its unsynced invocation file (driver/invocations.go),
// for as long as the record lives: a compaction, a restart's replay and a
// teardown that stops half way keep it. A compaction that wrote the record
// without it, then a crash, would leave the task's directory read as an
// older driver's task, its volumes held.
func TestReadJournal_InvocationMarkOutlivesCompaction(t *testing.T) {
	setCompactDelay(t, time.Millisecond)
	ctx := context.Background()
	h := newHarness(t)
	p := fullPlugin("p")
	// Published and staged, no record needs the secrets: the log is
	// compacted to drop them.
	p.ControllerPublish = false
	h.setPlugin(p)
	dir := filepath.Join(h.root, "journal")
	logFile := func() []byte {
		data, err := os.ReadFile(filepath.Join(dir, logName))
		must.NoError(t, err)
		return data
	}
	compacted := func() {
		t.Helper()
		must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return !bytes.Contains(logFile(), []byte(canary)) }),
			wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)), must.Sprint("the log was not compacted"))
	}
	marks := func() map[string]bool {
		t.Helper()
		st, err := ReadJournal(dir)
		must.NoError(t, err)
		out := map[string]bool{}
		for _, tr := range st.Tasks {
			out[tr.TaskID+"/"+tr.Name] = tr.Invocation
		}
		return out
	}
	_, err := h.m.Setup(ctx, "a/t/1", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	compacted()
	must.Eq(t, map[string]bool{"a/t/1/data": true}, marks())

	// Replayed by the next process, compacted again with another task's
	// records dropped.
	h.restart()
	_, err = h.m.Setup(ctx, "b/t/1", []VolumeRequest{req("logs", "vol2", "/logs")})
	must.NoError(t, err)
	compacted()
	must.NoError(t, h.m.Teardown(ctx, "b/t/1"))
	must.Eq(t, map[string]bool{"a/t/1/data": true}, marks())

	// A teardown the plugin cannot finish leaves the record unpublishing,
	// marked still: the task's directory may outlive it.
	h.fake.SetError(MethodNodeUnpublishVolume, status.Error(codes.Unavailable, "connection refused"))
	must.ErrorContains(t, h.m.Teardown(ctx, "a/t/1"), "retrying in the background")
	must.Eq(t, map[string]bool{"a/t/1/data": true}, marks())
	disk := diskJournal(t, dir)
	must.Eq(t, phaseUnpublishing, disk.task("a/t/1", "data").State)
	h.fake.SetError(MethodNodeUnpublishVolume, nil)
}
