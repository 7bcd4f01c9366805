package csihook

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// A reader of a single-node-writer volume beside a writer of its
// allocation, with the fixture plugin's real mounts: the one publish is
// read/write, which the writer's view writes, and the reader's view of it,
// bound read-only as the driver binds a Published with ReadOnly, fails a
// write with EROFS, whichever task published. Needs root.
func TestClaims_SingleNodeWriter_ReaderCannotWrite_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the fixture plugin mounts")
	}
	src, err := filepath.Abs(filepath.Join("..", "e2e", "csiplugin"))
	must.NoError(t, err)
	base, err := os.MkdirTemp("", "csir")
	must.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(base) })
	root, state, views := filepath.Join(base, "root"), filepath.Join(base, "state"), filepath.Join(base, "views")
	t.Cleanup(func() { cleanupHost(t, state, views, root, state) })
	bin := filepath.Join(base, "csi-fixture")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the fixture plugin: %v\n%s", err, out)
	}
	fx := &fixturePlugin{t: t, bin: bin, sock: filepath.Join(base, "csi.sock"), state: state, out: &syncBuffer{}}
	fx.start()
	t.Cleanup(func() {
		fx.stop(false)
		if t.Failed() {
			t.Logf("plugin output:\n%s", fx.out.String())
		}
	})
	m, err := New(Config{
		Root: root,
		Lookup: func(id string) (PluginInfo, error) {
			if id != "fixture" {
				return PluginInfo{}, errors.New("unknown")
			}
			return PluginInfo{ID: id, Socket: fx.sock, NodeID: "n1", Healthy: true, StageUnstage: true,
				ControllerPublish: true, CreateDelete: true}, nil
		},
		Dial:          DialUnix,
		Mounter:       mounter.New(),
		Logger:        hclog.NewNullLogger(),
		RPCTimeout:    20 * time.Second,
		RetryAttempts: 1,
	})
	must.NoError(t, err)
	t.Cleanup(func() { m.Close() })
	ctx := context.Background()
	host := mounter.New()

	for _, readerFirst := range []bool{true, false} {
		const writer, reader = "alloc-a/app/11111111", "alloc-a/backup/22222222"
		w := VolumeRequest{Name: "data", PluginID: "fixture", VolumeID: "ro-beside-rw", Destination: "/data",
			AccessMode: AccessSingleNodeWriter, Create: &CreateRequest{Parameters: map[string]string{"type": "dir"}}}
		r := w
		r.ReadOnly = true
		ids, reqs := []string{writer, reader}, []VolumeRequest{w, r}
		if readerFirst {
			ids[0], ids[1], reqs[0], reqs[1] = ids[1], ids[0], reqs[1], reqs[0]
		}
		view := map[string]string{}
		for i, id := range ids {
			pubs, err := m.Setup(ctx, id, []VolumeRequest{reqs[i]})
			must.NoError(t, err)
			v := filepath.Join(views, filepath.Base(filepath.Dir(id)))
			must.NoError(t, os.MkdirAll(v, 0o755))
			// The task's bind, as the driver makes it.
			must.NoError(t, host.BindMount(pubs[0].HostPath, v, pubs[0].ReadOnly, true))
			view[id] = v
		}
		file := filepath.Join(view[writer], "written")
		must.NoError(t, os.WriteFile(file, []byte("by the writer"), 0o644), must.Sprintf("reader first: %v", readerFirst))
		got, err := os.ReadFile(filepath.Join(view[reader], "written"))
		must.NoError(t, err)
		must.Eq(t, "by the writer", string(got))
		err = os.WriteFile(filepath.Join(view[reader], "x"), []byte("no"), 0o644)
		must.True(t, errors.Is(err, syscall.EROFS), must.Sprintf("reader first: %v: the reader wrote: %v", readerFirst, err))
		err = os.Remove(filepath.Join(view[reader], "written"))
		must.True(t, errors.Is(err, syscall.EROFS), must.Sprintf("reader first: %v: the reader removed: %v", readerFirst, err))

		for _, id := range ids {
			must.NoError(t, unix.Unmount(view[id], 0))
			must.NoError(t, m.Teardown(ctx, id))
		}
		mps, err := host.List()
		must.NoError(t, err)
		for _, mp := range mps {
			must.False(t, mounter.PathWithin(mp.Path, base), must.Sprintf("left mounted: %s", mp.Path))
		}
	}
}
