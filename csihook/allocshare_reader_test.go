package csihook

import (
	"context"
	"os"
	"testing"

	"github.com/shoenig/test/must"
)

// Nomad lets a task of the allocation that claims a single-node-writer
// volume mount it read-only beside the writers (volume_mount's read_only):
// the claim, and so the one publish on the node, is read/write; the
// reader's bind of it is read-only. Whichever task publishes, the
// publish is read/write, and each task's view is its own.
func TestClaims_SingleNodeWriter_ReaderBesideAWriterOfItsAllocation(t *testing.T) {
	for _, readerFirst := range []bool{true, false} {
		name := "writer first"
		if readerFirst {
			name = "reader first"
		}
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			ctx := context.Background()
			const writer, reader = "alloc-a/app/11111111", "alloc-a/backup/22222222"
			// No secrets: the repair after the restart needs none.
			w := req("data", "vol1", "/data")
			w.Secrets = nil
			r := w
			r.ReadOnly = true
			order := []struct {
				id  string
				req VolumeRequest
			}{{writer, w}, {reader, r}}
			if readerFirst {
				order[0], order[1] = order[1], order[0]
			}
			pubs := map[string]Published{}
			for i, o := range order {
				got, err := h.m.Setup(ctx, o.id, []VolumeRequest{o.req})
				must.NoError(t, err)
				pubs[o.id] = got[0]
				if i == 0 {
					// The plugin makes target_path (CSI spec); the fake
					// does not.
					must.NoError(t, os.MkdirAll(got[0].HostPath, 0o750))
				}
			}
			np := h.callsOf(MethodNodePublishVolume)
			must.Len(t, 1, np)
			must.False(t, np[0].Readonly, must.Sprint("the allocation's one publish is read/write"))
			must.Eq(t, pubs[writer].HostPath, pubs[reader].HostPath)
			must.False(t, pubs[writer].ReadOnly)
			must.True(t, pubs[reader].ReadOnly, must.Sprint("the reader binds the publish read-only"))

			// After a restart that lost the publish, the reader alone
			// is left: made again read/write, the reader's view still
			// read-only; so for a repair of a stale publish.
			target := pubs[reader].HostPath
			h.restart()
			must.NoError(t, h.mnt.Unmount(target))
			h.fake.ResetCalls()
			must.NoError(t, h.m.Recover(func(id string) bool { return id == reader }))
			h.waitIdle()
			np = h.callsOf(MethodNodePublishVolume)
			must.Len(t, 1, np)
			must.False(t, np[0].Readonly, must.Sprint("re-published for the reader"))
			must.Eq(t, target, np[0].TargetPath)
			again, err := h.m.Setup(ctx, reader, []VolumeRequest{r})
			must.NoError(t, err)
			must.True(t, again[0].ReadOnly)

			// A writer of the allocation that starts now shares it.
			h.fake.ResetCalls()
			w2, err := h.m.Setup(ctx, "alloc-a/app/33333333", []VolumeRequest{w})
			must.NoError(t, err)
			must.Len(t, 0, h.callsOf(MethodNodePublishVolume))
			must.False(t, w2[0].ReadOnly)
			must.Eq(t, target, w2[0].HostPath)

			h.mnt.SetStale(target, true)
			h.fake.ResetCalls()
			rep, err := h.m.RepairStale(ctx, "p")
			must.NoError(t, err)
			np = h.callsOf(MethodNodePublishVolume)
			must.Len(t, 1, np)
			must.False(t, np[0].Readonly, must.Sprint("repaired read/write"))
			must.Len(t, 2, rep)
			for _, x := range rep {
				must.Eq(t, x.TaskID == reader, x.ReadOnly, must.Sprintf("repaired view of %s", x.TaskID))
			}

			h.fake.ResetCalls()
			h.teardownAll(ctx, reader, "alloc-a/app/33333333")
			must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
		})
	}
}
