//go:build e2e

package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// The tasks of one allocation share its claim on a single-node-writer
// volume, as in Nomad: one NodePublishVolume for the allocation, read/write
// even when the task that makes it reads only, and the reader's view of it
// read-only. The reader starts first (the writer is a poststart task that
// stays), so a publish made with the reader's read_only would leave the
// writer unable to write.
func testVolumeOneAllocationWriterAndReader(t *testing.T, a *Agent, fx *VolFixture) {
	name := volUniq("onealloc")
	destW, destR := filepath.Join(volDir(a, name), "w"), filepath.Join(volDir(a, name), "r")
	vol := func(dest string, readOnly bool) string {
		return VolSpec{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer", ReadOnly: readOnly,
			Create: true, CreateType: "dir"}.HCL()
	}
	job := a.RunJob(t, "volume_alloc_reader", map[string]string{
		"ReaderVolumes": vol(destR, true),
		"WriterVolumes": vol(destW, false),
		"WriterScript":  volHCLString(volSleeper),
	})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	exec := func(task, script string) string {
		t.Helper()
		out, err := a.AllocExec(al.ID, task, "/bin/sh", "-c", script)
		must.NoError(t, err, must.Sprintf("nomad alloc exec -task %s %s sh -c %q: %s", task, al.ID, script, out))
		return out
	}
	// The allocation runs once the reader does: wait for the writer's
	// start, which is what shares the reader's publish.
	a.WaitEvent(t, al.ID, "writer", "Started", volTimeout)
	cur, err := a.allocation(al.ID)
	must.NoError(t, err)
	t.Logf("%s", cur.Describe())
	// The reader made the publish, the writer shared it.
	must.StrContains(t, eventsText(cur, "writer"), "sharing its publish for task \""+al.ID+"/reader/", must.Sprint(cur.Describe()))

	id := fx.VolumeID(name)
	must.NotEq(t, "", id)
	must.Eq(t, 1, fx.Count("NodeStageVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	must.Eq(t, 1, fx.Count("NodePublishVolume", id), must.Sprintf("one publish for the allocation; calls: %v", fx.VolumeCalls(id)))
	// Both tasks' records name the allocation's one target.
	paths := slices.Compact(slices.Sorted(slices.Values(a.VolJournalPaths(id))))
	must.Len(t, 2, paths, must.Sprintf("one staging path and one target for the allocation: %v", paths))
	// The publish itself is read/write, whichever task made it (the
	// plugin's own record of it says how it was asked): a plugin that
	// mounts a read-only publish as a read-only file system would leave
	// no task of the allocation able to write. The host's mount table
	// cannot tell: the fixture makes a bind read-only with a remount in
	// its own mount namespace, which does not propagate.
	rec := volFixtureRecord(t, fx, id)
	must.MapLen(t, 1, rec.Targets, must.Sprintf("the fixture's targets: %v", rec.Targets))
	for target, r := range rec.Targets {
		must.False(t, r.ReadOnly, must.Sprintf("NodePublishVolume at %s asked for read-only", target))
	}

	exec("writer", "echo from-writer > "+destW+"/f")
	must.StrContains(t, exec("reader", "cat "+destR+"/f"), "from-writer")
	out := exec("reader", "if touch "+destR+"/x 2>&1; then echo WRITABLE; else echo refused; fi; "+
		"if rm "+destR+"/f 2>&1; then echo REMOVED; fi")
	must.StrContains(t, out, "Read-only file system")
	must.StrNotContains(t, out, "WRITABLE")
	must.StrNotContains(t, out, "REMOVED")
	must.StrContains(t, exec("writer", "cat "+destW+"/f"), "from-writer")

	a.VolStopAndWait(t, job.ID, volTimeout)
	volWaitCount(t, fx, "NodeUnstageVolume", id, 1, 30*time.Second)
	must.Eq(t, 1, fx.Count("NodeUnpublishVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	must.SliceEmpty(t, VolMountedAmong(paths), must.Sprint("still mounted after the allocation stopped"))
	must.SliceEmpty(t, a.WaitVolJournalClear(10*time.Second, id), must.Sprint("journal records left"))
	t.Logf("one allocation, writer and reader: reader said %q; calls for %s: %v", strings.TrimSpace(out), id, fx.VolumeCalls(id))
}

// volFixtureRecord reads the fixture's record of a volume
// (--state-dir/meta/<id>.json): where it is staged and published, and how.
func volFixtureRecord(t *testing.T, fx *VolFixture, id string) (rec struct {
	Targets map[string]struct {
		ReadOnly bool `json:"read_only"`
	} `json:"targets"`
}) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(fx.StateDir, "meta", id+".json"))
	must.NoError(t, err)
	must.NoError(t, json.Unmarshal(data, &rec), must.Sprintf("the fixture's record: %s", data))
	return rec
}
