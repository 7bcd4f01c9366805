package driver

import (
	"os"
	"testing"

	"github.com/hashicorp/nomad/plugins/drivers"
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

// A mount the driver makes inside a bidirectional mount is made in a peer
// of the host's source: the kernel copies it to the host, where it stays
// after the task. Such a destination is refused, for Nomad's mounts and for
// the driver's own volumes, before any plugin call; one beside the
// bidirectional mount, or the plugin's own mount_dir, is not.
func TestStartTask_mountInsideBidirectionalRefused(t *testing.T) {
	d, fp, vol := grantsDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	bidi := &drivers.MountConfig{TaskPath: "/shared", HostPath: t.TempDir(), PropagationMode: "bidirectional"}

	nomad := jobTask(t, TaskConfig{Command: "/bin/sleep", Privileged: true}, "alloc-n", "default", "web")
	nomad.Mounts = []*drivers.MountConfig{bidi, {TaskPath: "/shared/conf", HostPath: "/srv/conf"}}
	_, _, err := d.StartTask(nomad)
	must.ErrorContains(t, err, `mount "/shared/conf" lies inside the bidirectional mount "/shared"`)

	inside := vol("v-1")
	inside.Privileged = true
	inside.Volumes["data"] = VolumeConfig{PluginID: "hp", VolumeID: "v-1", Destination: "/shared/data",
		AccessMode: "multi-node-multi-writer", AttachmentMode: "file-system"}
	task := jobTask(t, inside, "alloc-v", "default", "web")
	task.Mounts = []*drivers.MountConfig{bidi}
	_, _, err = d.StartTask(task)
	must.ErrorContains(t, err, `volume "data": destination "/shared/data" lies inside the bidirectional mount "/shared"`)
	must.Eq(t, 0, len(fp.vols.Calls()))

	// The plugin's mount_dir inside it is refused too (the driver binds
	// it); beside it, the volume starts.
	plugin := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true,
		CSIPlugin: &PluginTaskConfig{ID: "hp2", Type: "monolith", MountDir: "/shared/csi"}}, "alloc-p2", "default", "plugin2")
	plugin.Mounts = []*drivers.MountConfig{bidi}
	_, _, err = d.StartTask(plugin)
	must.ErrorContains(t, err, `mount "/shared/csi" lies inside the bidirectional mount "/shared"`)

	beside := vol("v-1")
	beside.Privileged = true
	task = jobTask(t, beside, "alloc-b", "default", "web")
	task.Mounts = []*drivers.MountConfig{bidi}
	_, _, err = d.StartTask(task)
	must.NoError(t, err)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))
}

// A work_dir the kernel cannot take (a NUL byte in it) is refused with the
// task's other NUL checks, before its volumes are staged and published:
// the start would fail at chdir only after the plugin's calls.
func TestStartTask_nulWorkDirRefusedBeforeAnyCall(t *testing.T) {
	d, fp, vol := grantsDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	tc := vol("v-1")
	tc.WorkDir = "/da\x00ta"
	_, _, err := d.StartTask(jobTask(t, tc, "alloc-w", "default", "web"))
	must.ErrorContains(t, err, "work_dir holds a NUL byte")
	must.Eq(t, 0, len(fp.vols.Calls()))
}
