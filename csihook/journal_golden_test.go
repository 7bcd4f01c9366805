package csihook

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
)

// updateGolden rewrites the golden journal files from the current code:
// go test -run TestJournal_Golden -update-golden ./csihook/
var updateGolden = flag.Bool("update-golden", false, "rewrite testdata/journal/*.log")

// goldenBatches are commits of every kind of op, with fixed times so that
// the log they make is the same bytes on every run.
func goldenBatches() []struct {
	lazy bool
	ops  []journalOp
} {
	at := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	vol := func(volume, stage, controller string) journalOp {
		v := testVol(volume, stage)
		v.Controller, v.Version, v.Updated, v.Server, v.MountFlags = controller, journalVersion, at, "srv", []string{"noatime"}
		v.VolumeContext, v.PublishContext, v.HadSecrets = map[string]string{"ctx": "1"}, map[string]string{"dev": "/dev/x"}, true
		return journalOp{Op: opPutVol, Vol: &v}
	}
	task := func(taskID, volume, state string) journalOp {
		tr := testTask(taskID, volume, state)
		tr.Version, tr.Updated, tr.Seq, tr.HadSecrets, tr.ApplyGroup = journalVersion, at, 1, true, "100"
		return journalOp{Op: opPutTask, Task: &tr}
	}
	created := func(name, volume string) journalOp {
		return journalOp{Op: opPutCreated, Created: &createdRecord{Version: journalVersion, PluginID: "p", Name: name,
			VolumeID: volume, VolumeContext: map[string]string{"k": "v"}, Requested: 1 << 30, Capacity: 1 << 30, Updated: at}}
	}
	owner := journalOp{Op: opPutOwner, Owner: &ownerRecord{Version: journalVersion, PluginID: "p", VolumeID: "v1",
		Namespace: "default", Updated: at}}
	return []struct {
		lazy bool
		ops  []journalOp
	}{
		{false, []journalOp{owner, vol("v1", phaseStaging, phasePublishing), task("t1", "v1", phasePending)}},
		{true, []journalOp{vol("v1", phaseStaged, phasePublished)}},
		{false, []journalOp{task("t1", "v1", phasePublishing)}},
		{true, []journalOp{task("t1", "v1", phasePublished)}},
		{false, []journalOp{created("made", "v-made"), vol("v2", phaseStaging, phaseNone), task("t2", "v2", phasePending)}},
		{false, []journalOp{created("gone", "v-gone"), vol("v3", phaseStaged, phaseNone)}},
		{false, []journalOp{createdDrop("p", "gone"), taskDrop("t2", "data"), volDrop(volKey{"p", "v2"})}},
		// Within a batch the last op of a record wins.
		{false, []journalOp{vol("v4", phaseStaging, phaseNone), vol("v4", phaseStaged, phaseNone), task("t4", "v4", phasePending), taskDrop("t4", "data")}},
		// Stages the plugin refused: on disk without the secrets, but
		// for those an attached volume's detach takes.
		{false, []journalOp{vol("v5", phaseStaging, phaseNone), vol("v6", phaseStaging, phasePublished)}},
		{false, []journalOp{vol("v5", phaseStageRefused, phaseNone), vol("v6", phaseStageRefused, phasePublished)}},
	}
}

// TestJournal_GoldenLog guards the on-disk format: the log the commits of
// goldenBatches make is byte for byte the one the code wrote when the
// golden file was made (testdata/journal/v1.log, the log without the
// zeros the file is kept longer by), that log and its compaction
// (v1-compacted.log) load into the same records, and a compaction of
// those records is byte for byte the golden one.
func TestJournal_GoldenLog(t *testing.T) {
	dir := t.TempDir()
	j, _ := openTestJournal(t, dir)
	for _, b := range goldenBatches() {
		if b.lazy {
			must.NoError(t, j.commitLazy(b.ops...))
		} else {
			must.NoError(t, j.commit(b.ops...))
		}
	}
	live := j.state.encoded(t)
	j.close()
	written := bytes.TrimRight(readLog(t, dir), "\x00")
	compacted, err := encodeSnapshot(diskJournal(t, dir).snapshot())
	must.NoError(t, err)

	logPath, compactedPath := filepath.Join("testdata", "journal", "v1.log"), filepath.Join("testdata", "journal", "v1-compacted.log")
	if *updateGolden {
		must.NoError(t, os.MkdirAll(filepath.Dir(logPath), 0o755))
		must.NoError(t, os.WriteFile(logPath, written, 0o644))
		must.NoError(t, os.WriteFile(compactedPath, compacted, 0o644))
	}
	for _, tc := range []struct {
		path string
		now  []byte
	}{{logPath, written}, {compactedPath, compacted}} {
		golden, err := os.ReadFile(tc.path)
		must.NoError(t, err)
		must.True(t, bytes.Equal(golden, tc.now), must.Sprintf("%s differs from what the code writes now:\n%q\n%q", tc.path, golden, tc.now))

		// An existing journal of this format loads: the same records.
		gdir := t.TempDir()
		must.NoError(t, os.WriteFile(filepath.Join(gdir, logName), golden, 0o600))
		scan := scanLog(golden, hclog.NewNullLogger())
		must.Eq(t, 0, scan.torn+scan.damaged+scan.badOps, must.Sprint(tc.path))
		g, logs := openTestJournal(t, gdir)
		must.Eq(t, live, g.state.encoded(t), must.Sprint(tc.path))
		must.Eq(t, []string{"created p/made v-made", "task t1/data v1 published", "vol p/v1 staged", "vol p/v3 staged", "vol p/v4 staged",
			"vol p/v5 refused", "vol p/v6 refused"}, g.state.summary())
		must.MapEmpty(t, g.state.vols[volKey{"p", "v5"}].Secrets, must.Sprint(tc.path))
		must.Eq(t, canary, g.state.vols[volKey{"p", "v6"}].Secrets["token"], must.Sprint(tc.path))
		ns, ok := g.owner("p", "v1")
		must.True(t, ok)
		must.Eq(t, "default", ns)
		must.StrNotContains(t, logs.String(), "damaged")
		g.close()
	}
}
