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

// escAllocDirReader is what the reader of a shared file-system volume
// tries at $1: read the file the writer wrote, make a file, remove the
// writer's, remount its view read/write, and bind the volume again
// elsewhere to write through that.
const escAllocDirReader = `d=$1
command -v mount >/dev/null && echo HAVE-MOUNT
echo "FIRST $(cat "$d/f")"
if echo Z > "$d/x" 2>/dev/null; then echo WRITTEN; else echo WRITE-REFUSED; fi
if rm -f "$d/f" 2>/dev/null && [ ! -e "$d/f" ]; then echo REMOVED; else echo REMOVE-REFUSED; fi
if mount -o remount,rw "$d"; then echo REMOUNTED; else echo REMOUNT-REFUSED; fi
mkdir -p /tmp/again
if mount --bind "$d" /tmp/again 2>/dev/null && echo Z > /tmp/again/y 2>/dev/null; then echo REBOUND-WRITTEN; else echo REBIND-REFUSED; fi
echo DONE
`

// A task of an allocation that reads a single-node-writer volume
// (read_only = true) beside a writer of the allocation shares the writer's
// one read/write publish (NodePublishVolume is made once, by whichever task
// starts first, read/write), yet cannot write the volume. The reader
// starts and publishes first; the writer writes through the reader's
// publish and exits, leaving the reader alone on a read/write publish,
// which it still cannot write, as root with exec's default capabilities:
// a block-device volume's device filter allows the device for reading
// alone (the read-only bind of a device node does not stop a write to the
// device), and a file-system volume's bind stays read-only, with no way for
// the task to remount it or bind it again.
func TestVolumeAllocReaderBesideWriter(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "allocro", VolFixtureOptions{})
	for _, tc := range []struct {
		name, attach, typ string
		destR, destW      string
		writer, reader    string
		want              []string
	}{
		{name: "block", attach: "block-device", typ: "ext4", destR: "/dev/xvdr", destW: "/dev/xvdw",
			writer: `if printf Q | dd of=/dev/xvdw bs=1 count=1 conv=notrunc 2>/dev/null; then echo WRITTEN; else echo WRITE-REFUSED; fi`,
			reader: escAllocBlockReader, want: []string{"BLOCK", "FIRST Q", "WRITE-REFUSED", "RDWR-REFUSED"}},
		{name: "file_system", attach: "file-system", typ: "dir", destR: "/srv/r", destW: "/srv/w",
			writer: `if echo Q > /srv/w/f; then echo WRITTEN; else echo WRITE-REFUSED; fi`,
			reader: escAllocDirReader, want: []string{"HAVE-MOUNT", "FIRST Q", "WRITE-REFUSED", "REMOVE-REFUSED", "REMOUNT-REFUSED", "REBIND-REFUSED"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := "allocro-" + escUniq()
			vol := func(dest string, readOnly bool) string {
				return VolSpec{Name: "v", Plugin: fx.ID, ID: name, Dest: dest, Attach: tc.attach, ReadOnly: readOnly,
					Create: true, CreateType: tc.typ}.HCL()
			}
			job := a.RunJob(t, "volume_alloc_reader", map[string]string{
				"ReaderVolumes": vol(tc.destR, true),
				"WriterVolumes": vol(tc.destW, false),
				"WriterScript":  volHCLString(tc.writer),
			})
			al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)

			// The writer is done, and its record gone: the reader alone
			// holds the publish.
			deadline := time.Now().Add(Scaled(volTimeout))
			for {
				cur, err := a.allocation(al.ID)
				must.NoError(t, err)
				w := cur.Task("writer")
				writerRecs := 0
				st, err := a.VolJournal()
				must.NoError(t, err)
				for _, tk := range st.Tasks {
					if strings.HasPrefix(tk.TaskID, al.ID+"/writer/") {
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

			out, err := a.AllocExec(al.ID, "reader", "/bin/sh", "-c", tc.reader, "reader", tc.destR)
			must.NoError(t, err, must.Sprint(out))
			t.Logf("the reader said:\n%s", out)
			must.StrContains(t, out, "DONE\n", must.Sprint("the reader's script did not run to its end"))
			for _, want := range tc.want {
				must.StrContains(t, out, want+"\n", must.Sprintf("reader: %q missing", want))
			}

			a.VolStopAndWait(t, job.ID, volTimeout)
			volWaitCount(t, fx, "NodeUnstageVolume", id, 1, 30*time.Second)
			must.Eq(t, 1, fx.Count("NodeUnpublishVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
			must.SliceEmpty(t, VolMountedAmong(paths), must.Sprint("still mounted after the allocation stopped"))
			must.SliceEmpty(t, a.WaitVolJournalClear(10*time.Second, id), must.Sprint("journal records left"))
		})
	}
}
