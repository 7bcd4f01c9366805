package executor

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
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

// A read-only block-device volume is read-only for the device itself, not
// only for the mount that holds its node (a read-only mount does not stop
// writes to a device node): the device filter allows the volume's device
// for reading alone, so a root task with exec's default capabilities
// cannot open it for writing, nor make a node of it elsewhere and write
// through that. A writable one is written.
func TestStart_ReadOnlyBlockVolume_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := exec.LookPath("losetup"); err != nil {
		t.Skip("test needs losetup to make a block device")
	}
	backing := filepath.Join(t.TempDir(), "disk")
	must.NoError(t, os.WriteFile(backing, make([]byte, 1<<20), 0o600))
	out, err := exec.Command("losetup", "--find", "--show", backing).Output()
	must.NoError(t, err)
	loop := strings.TrimSpace(string(out))
	t.Cleanup(func() { _ = exec.Command("losetup", "-d", loop).Run() })
	var st unix.Stat_t
	must.NoError(t, unix.Stat(loop, &st))

	for _, readOnly := range []bool{true, false} {
		t.Run(fmt.Sprintf("read_only=%v", readOnly), func(t *testing.T) {
			tt := isolatedSpec(t, fmt.Sprintf(`
if dd if=/dev/xvdb of=/dev/null bs=512 count=1 2>/dev/null; then echo read=ok; else echo read=failed; fi
if printf x | dd of=/dev/xvdb bs=1 count=1 conv=notrunc 2>/dev/null; then echo write=ok; else echo write=failed; fi
if mknod /tmp/blk b %d %d 2>/dev/null; then echo mknod=ok; else echo mknod=failed; fi`, unix.Major(st.Rdev), unix.Minor(st.Rdev)))
			tt.spec.Credential = &Credential{}
			tt.spec.Limits.Devices = cgroups.DefaultDevices
			tt.spec.LateMounts = []Mount{{Target: "/dev/xvdb"}}
			p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
				return []Mount{{Source: loop, Target: "/dev/xvdb", ReadOnly: readOnly, NoSuid: true}}, nil
			})
			must.NoError(t, err)
			t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
			got := exitLines(t, tt, p)
			must.Eq(t, "ok", got["read"])
			must.Eq(t, "failed", got["mknod"])
			if readOnly {
				must.Eq(t, "failed", got["write"], must.Sprint("a read-only block-device volume was written"))
			} else {
				must.Eq(t, "ok", got["write"])
			}
		})
	}
	data, err := os.ReadFile(backing)
	must.NoError(t, err)
	must.Eq(t, byte('x'), data[0], must.Sprint("the writable volume's write did not reach the device"))
}

// devProbe tries what a task could do to its /dev if it were left
// writable: make a file, a directory and a symlink there, and replace
// /dev/null.
const devProbe = `
if touch /dev/new 2>/dev/null; then echo file=made; else echo file=refused; fi
if mkdir /dev/newdir 2>/dev/null; then echo dir=made; else echo dir=refused; fi
if ln -s /proc/self/root /dev/link 2>/dev/null; then echo link=made; else echo link=refused; fi
if rm -f /dev/null 2>/dev/null && [ ! -e /dev/null ]; then echo null=removed; else echo null=kept; fi
echo hi > /dev/null && echo nullwrite=ok`

// An isolated task's /dev is sealed whatever way the task comes to start:
// with no mounts at all, with early mounts only, from an image, in a root
// a spare supervisor prepared ahead, with a device node handed in late, and
// with a volume over its /dev/shm.
func TestStart_DevSealedOnEveryPath_Root(t *testing.T) {
	requireTaskRoot(t)
	node := filepath.Join(t.TempDir(), "node")
	must.NoError(t, unix.Mknod(node, unix.S_IFBLK|0o600, int(unix.Mkdev(7, 202))))
	lateDev := func(spec *Spec) func() ([]Mount, error) {
		spec.LateMounts = []Mount{{Target: "/dev/xvdb"}}
		return func() ([]Mount, error) {
			return []Mount{{Source: node, Target: "/dev/xvdb", ReadOnly: true, NoSuid: true}}, nil
		}
	}
	cases := []struct {
		name  string
		image bool
		spare bool
		setup func(t *testing.T, spec *Spec) func() ([]Mount, error)
	}{
		{name: "no mounts", setup: func(*testing.T, *Spec) func() ([]Mount, error) { return nil }},
		{name: "early mounts only", setup: func(t *testing.T, spec *Spec) func() ([]Mount, error) {
			spec.Mounts = []Mount{{Source: t.TempDir(), Target: "/data"}}
			return nil
		}},
		{name: "late device", setup: func(_ *testing.T, spec *Spec) func() ([]Mount, error) { return lateDev(spec) }},
		{name: "volume over /dev/shm", setup: func(t *testing.T, spec *Spec) func() ([]Mount, error) {
			vol := t.TempDir()
			spec.LateMounts = []Mount{{Target: "/dev/shm"}}
			return func() ([]Mount, error) { return []Mount{{Source: vol, Target: "/dev/shm"}}, nil }
		}},
		{name: "image", image: true, setup: func(*testing.T, *Spec) func() ([]Mount, error) { return nil }},
		{name: "image late device", image: true, setup: func(_ *testing.T, spec *Spec) func() ([]Mount, error) { return lateDev(spec) }},
		{name: "spare late device", spare: true, setup: func(_ *testing.T, spec *Spec) func() ([]Mount, error) { return lateDev(spec) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var tt *testTask
			if tc.image {
				tt = imageSpec(t, devProbe, false)
			} else {
				tt = isolatedSpec(t, devProbe)
			}
			late := tc.setup(t, tt.spec)
			start := Start
			if tc.spare {
				s := &Spares{}
				s.SetDir(t.TempDir(), tt.spec.Isolation)
				t.Cleanup(s.Close)
				s.Fill("", hclog.NewNullLogger())
				waitSpare(t, s, "")
				start = s.Start
			}
			p, err := start(hclog.NewNullLogger(), tt.spec, late)
			must.NoError(t, err)
			t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
			got := exitLines(t, tt, p)
			must.Eq(t, "refused", got["file"])
			must.Eq(t, "refused", got["dir"])
			must.Eq(t, "refused", got["link"])
			must.Eq(t, "kept", got["null"])
			must.Eq(t, "ok", got["nullwrite"])
			if tc.spare {
				must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+wire.SupervisorLogFile), "root_prepared_ahead=true")
			}
		})
	}
}
