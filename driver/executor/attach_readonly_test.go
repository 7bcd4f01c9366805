package executor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// A volume's read_only is not in the task's spec (the spec names a late
// mount's target only): a repair of a read-only volume makes the task's
// fresh copy read-only by ReplaceMount's readOnly alone. A task reading a
// single-node-writer volume beside its allocation's writer shares a
// publish that is read/write on the host, and made again read/write by
// the repair: its view of the fresh mount must still be read-only.
func TestReplaceMount_ReadOnlyVolumeOfReadWritePublish_Root(t *testing.T) {
	requireTaskRoot(t)
	base, err := filepath.EvalSymlinks(t.TempDir())
	must.NoError(t, err)
	t.Cleanup(func() { detachAll(base) })
	must.NoError(t, unix.Mount(base, base, "", unix.MS_BIND, ""))
	must.NoError(t, unix.Mount("", base, "", unix.MS_PRIVATE, ""))
	vol := filepath.Join(base, "vol")
	must.NoError(t, os.Mkdir(vol, 0o755))
	must.NoError(t, unix.Mount("old", vol, "tmpfs", 0, "size=1m"))

	tt := newTestSpec(t, "/bin/sh", "-c", `
if touch /vol/before 2>/dev/null; then echo before=writable; else echo before=readonly; fi
while ! cat /vol/data 2>/dev/null; do sleep 0.05; done
if touch /vol/after 2>/dev/null; then echo after=writable; else echo after=readonly; fi
exec sleep 100`)
	tt.spec.LateMounts = []Mount{{Target: "/vol"}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: "/vol", ReadOnly: true, NoSuid: true, NoDev: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	waitFor(t, "the task to try its volume", func() bool { return strings.Contains(readFile(t, tt.stdout), "before=") })
	must.StrContains(t, readFile(t, tt.stdout), "before=readonly\n")

	// The host side of a repair: a fresh read/write publish in place of
	// the old one.
	m := mounter.New()
	must.NoError(t, m.DetachLazy(vol))
	must.NoError(t, m.Mount("fresh", vol, "tmpfs", 0, "size=1m"))
	must.NoError(t, os.WriteFile(filepath.Join(vol, "data"), []byte("back\n"), 0o644))

	_, err = p.ReplaceMount(vol, "/vol", true)
	must.NoError(t, err)
	waitFor(t, "the task to try its fresh volume", func() bool { return strings.Contains(readFile(t, tt.stdout), "after=") })
	must.StrContains(t, readFile(t, tt.stdout), "back\nafter=readonly\n", must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	_, err = os.Stat(filepath.Join(vol, "after"))
	must.True(t, os.IsNotExist(err), must.Sprintf("the task wrote the host's publish: %v", err))
}
