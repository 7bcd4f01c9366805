//go:build e2e

package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// escAllocBlockReader is what the reader of a shared block-device volume
// tries at $1: read the byte the writer wrote, write it (dd), and open it
// for reading and writing.
const escAllocBlockReader = `d=$1
test -b "$d" && echo BLOCK
echo "FIRST $(dd if="$d" bs=1 count=1 2>/dev/null)"
if printf Z | dd of="$d" bs=1 count=1 conv=notrunc 2>/dev/null; then echo WRITTEN; else echo WRITE-REFUSED; fi
if (exec 3<>"$d") 2>/dev/null; then echo RDWR-OPENED; else echo RDWR-REFUSED; fi
echo DONE
`

// A task of an allocation that reads a single-node-writer block-device
// volume (read_only = true) beside a writer of the allocation shares the
// writer's one read/write publish (NodePublishVolume is made once, by
// whichever task starts first, read/write), yet cannot write the device:
// its device filter allows the device for reading alone. The reader starts
// and publishes first; the writer writes through the reader's publish and
// exits, leaving the reader alone on a read/write publish, which it still
// cannot write nor open for writing, as root with exec's default
// capabilities.
func TestVolumeAllocBlockReaderBesideWriter(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "allocblk", VolFixtureOptions{})
	name := "allocblk-" + escUniq()
	vol := func(dest string, readOnly bool) string {
		return VolSpec{Name: "dev", Plugin: fx.ID, ID: name, Dest: dest, Attach: "block-device", ReadOnly: readOnly,
			Create: true, CreateType: "ext4"}.HCL()
	}
	job := a.RunJob(t, "volume_alloc_block", map[string]string{
		"ReaderVolumes": vol("/dev/xvdr", true),
		"WriterVolumes": vol("/dev/xvdw", false),
		"WriterScript":  volHCLString(`if printf Q | dd of=/dev/xvdw bs=1 count=1 conv=notrunc 2>/dev/null; then echo WRITTEN; else echo WRITE-REFUSED; fi`),
	})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)

	// The writer is done, and its record gone: the reader alone holds the
	// publish.
	deadline := time.Now().Add(Scaled(volTimeout))
	for {
		cur, err := a.allocation(al.ID)
		must.NoError(t, err)
		w := cur.Task("writer")
		writerRecs := 0
		st, err := a.VolJournal()
		must.NoError(t, err)
		for _, tk := range st.Tasks {
			if strings.Contains(tk.TaskID, "/writer/") {
				writerRecs++
			}
		}
		if w != nil && w.State == "dead" && writerRecs == 0 {
			must.False(t, w.Failed, must.Sprintf("the writer failed:\n%s", cur.Describe()))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the writer did not finish and leave the volume (records %d):\n%s", writerRecs, cur.Describe())
		}
		time.Sleep(200 * time.Millisecond)
	}
	must.StrContains(t, escRead(t, a, al.ID, "writer", false), "WRITTEN\n", must.Sprint("the writer could not write through the reader's publish"))

	id := fx.VolumeID(name)
	must.NotEq(t, "", id)
	must.Eq(t, 1, fx.Count("NodePublishVolume", id), must.Sprintf("one publish for the allocation; calls: %v", fx.VolumeCalls(id)))
	must.Eq(t, 0, fx.Count("NodeUnpublishVolume", id), must.Sprintf("the reader's publish stays; calls: %v", fx.VolumeCalls(id)))
	paths := a.VolJournalPaths(id)
	must.SliceNotEmpty(t, VolMountedAmong(paths), must.Sprintf("nothing mounted of %v", paths))

	out, err := a.AllocExec(al.ID, "reader", "/bin/sh", "-c", escAllocBlockReader, "reader", "/dev/xvdr")
	must.NoError(t, err, must.Sprint(out))
	t.Logf("the reader said:\n%s", out)
	must.StrContains(t, out, "DONE\n", must.Sprint("the reader's script did not run to its end"))
	for _, want := range []string{"BLOCK", "FIRST Q", "WRITE-REFUSED", "RDWR-REFUSED"} {
		must.StrContains(t, out, want+"\n", must.Sprintf("reader: %q missing", want))
	}

	a.VolStopAndWait(t, job.ID, volTimeout)
	volWaitCount(t, fx, "NodeUnstageVolume", id, 1, 30*time.Second)
	must.Eq(t, 1, fx.Count("NodeUnpublishVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	must.SliceEmpty(t, VolMountedAmong(paths), must.Sprint("still mounted after the allocation stopped"))
	must.SliceEmpty(t, a.WaitVolJournalClear(10*time.Second, id), must.Sprint("journal records left"))
}
