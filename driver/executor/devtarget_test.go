package executor

import (
	"path/filepath"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// A device node handed to an isolated task at a path in its /dev that the
// minimal /dev lacks (Nomad's devices, a block-device volume at /dev/xvdb,
// where the kubelet puts them too) lands there, early or late, and the
// task's /dev is still read-only when the task runs (the targets are made
// before the /dev tmpfs is sealed), while the mounts inside it keep their
// own flags.
func TestStart_DeviceTargetsInDev_Root(t *testing.T) {
	requireTaskRoot(t)
	dir := t.TempDir()
	early, late := filepath.Join(dir, "early"), filepath.Join(dir, "late")
	// Nodes of the loop driver, which the task never opens.
	must.NoError(t, unix.Mknod(early, unix.S_IFBLK|0o600, int(unix.Mkdev(7, 200))))
	must.NoError(t, unix.Mknod(late, unix.S_IFBLK|0o600, int(unix.Mkdev(7, 201))))

	tt := isolatedSpec(t, `
test -b /dev/nomad-dev && echo early=block
test -b /dev/disk/by-id/vol && echo late=block
if touch /dev/new 2>/dev/null; then echo dev=writable; else echo dev=read-only; fi
if touch /dev/disk/new 2>/dev/null; then echo disk=writable; else echo disk=read-only; fi
echo hi > /dev/null && echo null=ok`)
	tt.spec.Mounts = []Mount{{Source: early, Target: "/dev/nomad-dev", ReadOnly: true}}
	tt.spec.LateMounts = []Mount{{Target: "/dev/disk/by-id/vol"}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: late, Target: "/dev/disk/by-id/vol", ReadOnly: true, NoSuid: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	got := exitLines(t, tt, p)
	must.Eq(t, "block", got["early"])
	must.Eq(t, "block", got["late"])
	must.Eq(t, "read-only", got["dev"])
	must.Eq(t, "read-only", got["disk"])
	must.Eq(t, "ok", got["null"])
}
