package csihook

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"

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
