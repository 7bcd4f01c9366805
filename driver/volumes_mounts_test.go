package driver

import (
	"os"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// A non-privileged task's volumes are nosuid and nodev whatever the job's
// mount_flags asked the plugin for (a block-device volume keeps dev: it is
// the device node the task opens); a privileged task's keep what the
// plugin made. A "block-device" volume the plugin published as something
// else than a block device node is nodev too.
func TestVolumeMounts_Flags(t *testing.T) {
	pubs := []csihook.Published{
		{Name: "dir", HostPath: "/h/dir", Destination: "/data", ReadOnly: true},
		{Name: "blk", HostPath: "/h/blk", Destination: "/dev/xvdb", Block: true},
		{Name: "notblk", HostPath: "/h/notblk", Destination: "/nb", Block: true},
	}
	isBlock := func(path string) bool { return path == "/h/blk" }
	for _, tc := range []struct {
		name     string
		isolated bool
		want     []executor.Mount
	}{
		{"isolated", true, []executor.Mount{
			{Source: "/h/dir", Target: "/data", ReadOnly: true, Propagation: executor.PropagationPrivate, NoSuid: true, NoDev: true},
			{Source: "/h/blk", Target: "/dev/xvdb", Propagation: executor.PropagationPrivate, NoSuid: true},
			{Source: "/h/notblk", Target: "/nb", Propagation: executor.PropagationPrivate, NoSuid: true, NoDev: true},
		}},
		{"privileged", false, []executor.Mount{
			{Source: "/h/dir", Target: "/data", ReadOnly: true, Propagation: executor.PropagationPrivate},
			{Source: "/h/blk", Target: "/dev/xvdb", Propagation: executor.PropagationPrivate},
			{Source: "/h/notblk", Target: "/nb", Propagation: executor.PropagationPrivate},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			must.Eq(t, tc.want, volumeMounts(pubs, tc.isolated, isBlock))
		})
	}
}

// isBlockDevice tells a block device node from a directory, a file and a
// symlink to a block device (root-free: /dev/loop0 or any block node the
// host has is only looked at).
func TestIsBlockDevice(t *testing.T) {
	dir := t.TempDir()
	must.False(t, isBlockDevice(dir))
	must.False(t, isBlockDevice(dir+"/missing"))
	blk := ""
	for _, p := range []string{"/dev/loop0", "/dev/sda", "/dev/vda", "/dev/nvme0n1"} {
		var st unix.Stat_t
		if unix.Lstat(p, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK {
			blk = p
			break
		}
	}
	if blk == "" {
		return // the host has none of these; the fake above covers volumeMounts
	}
	must.True(t, isBlockDevice(blk))
	link := dir + "/link"
	must.NoError(t, os.Symlink(blk, link))
	must.False(t, isBlockDevice(link))
}
