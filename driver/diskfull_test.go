package driver

import (
	"io/fs"
	"testing"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

var (
	roomy      = unix.Statfs_t{Bsize: 4096, Blocks: 1 << 20, Bfree: 1 << 19, Files: 1 << 16, Ffree: 1 << 15}
	noInodes   = unix.Statfs_t{Bsize: 4096, Blocks: 1 << 20, Bfree: 1 << 19, Files: 1 << 16, Ffree: 3}
	noBlocks   = unix.Statfs_t{Bsize: 4096, Blocks: 1 << 20, Bfree: 10, Files: 1 << 16, Ffree: 1 << 15}
	noInodeFS  = unix.Statfs_t{Bsize: 4096, Blocks: 1 << 20, Bfree: 1 << 19} // btrfs: no inode count
	enospc     = &fs.PathError{Op: "open", Path: "/r/tasks/.probe-1", Err: unix.ENOSPC}
	edquot     = &fs.PathError{Op: "open", Path: "/r/tasks/.probe-1", Err: unix.EDQUOT}
	erofs      = &fs.PathError{Op: "open", Path: "/r/tasks/.probe-1", Err: unix.EROFS}
	statfsOf   = func(st unix.Statfs_t) *unix.Statfs_t { return &st }
	fullHealth = drivers.HealthStateHealthy
)

// A full root_dir (no inode, no block, over quota) leaves the driver
// healthy, saying what is full, where, and the fix, with an attribute a
// job can keep off the node by; a root_dir that cannot be written for
// another reason is unhealthy.
func TestBuildFingerprint_fullIsNotBroken(t *testing.T) {
	cases := []struct {
		name   string
		host   fakeHost
		health drivers.HealthState
		desc   string
		attr   string
	}{
		{"roomy", fakeHost{root: true, statfs: statfsOf(roomy)}, drivers.HealthStateHealthy, drivers.DriverHealthy, ""},
		{"no inodes, the write failed", fakeHost{root: true, writeErr: enospc, statfs: statfsOf(noInodes)}, fullHealth, "has no free inodes left", "inodes"},
		{"few inodes, the write passed", fakeHost{root: true, statfs: statfsOf(noInodes)}, fullHealth, "has no free inodes left", "inodes"},
		{"no blocks", fakeHost{root: true, writeErr: enospc, statfs: statfsOf(noBlocks)}, fullHealth, "has no free space left", "space"},
		{"ENOSPC with room by statfs", fakeHost{root: true, writeErr: enospc, statfs: statfsOf(roomy)}, fullHealth, "has no free space left", "space"},
		{"no inode count, roomy", fakeHost{root: true, statfs: statfsOf(noInodeFS)}, drivers.HealthStateHealthy, drivers.DriverHealthy, ""},
		{"quota", fakeHost{root: true, writeErr: edquot, statfs: statfsOf(roomy)}, fullHealth, "is over its disk quota", "quota"},
		{"read-only", fakeHost{root: true, writeErr: erofs, statfs: statfsOf(roomy)}, drivers.HealthStateUnhealthy, "is not writable", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDriver(t, Config{Enabled: true})
			d.host = c.host
			fp := d.buildFingerprint()
			must.Eq(t, c.health, fp.Health)
			must.StrContains(t, fp.HealthDescription, c.desc)
			attr, ok := fp.Attributes["driver.csi.root_dir_full"]
			must.Eq(t, c.attr != "", ok)
			if ok {
				got, _ := attr.GetString()
				must.Eq(t, c.attr, got)
			}
			if c.attr != "" {
				conf := d.currentConfig()
				must.StrContains(t, fp.HealthDescription, `root_dir "`+conf.RootDir+`"`)
				must.StrContains(t, fp.HealthDescription, "mounted at /")
				must.StrContains(t, fp.HealthDescription, "keep root_dir on a file system of its own")
				must.True(t, d.rootFull)
			}
		})
	}

	// Once there is room again, the attribute goes (sent empty).
	d := newTestDriver(t, Config{Enabled: true})
	d.host = fakeHost{root: true, statfs: statfsOf(noInodes)}
	fp := d.buildFingerprint()
	d.clearDropped(fp)
	d.host = fakeHost{root: true, statfs: statfsOf(roomy)}
	fp = d.buildFingerprint()
	d.clearDropped(fp)
	got, ok := fp.Attributes["driver.csi.root_dir_full"].GetString()
	must.True(t, ok)
	must.Eq(t, "", got)
	must.False(t, d.rootFull)
}

// A task is refused on a full root_dir at once, saying why and what to do,
// before its volumes are touched; with room again it starts.
func TestStartTask_refusedOnFullRootDir(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	fp := withFakePlugins(t, d)
	plugin := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p", "default", "plugin")
	_, _, err := d.StartTask(plugin)
	must.NoError(t, err)
	waitHealthy(t, d, "hp")

	d.host = fakeHost{root: true, statfs: statfsOf(noInodes)}
	work := volumeWorkload(t, "alloc-w", "first")
	_, _, err = d.StartTask(work)
	must.ErrorContains(t, err, "failed to start task: the file system of root_dir")
	must.ErrorContains(t, err, "has no free inodes left")
	must.ErrorContains(t, err, "no new task can start on this node until files are removed there")
	must.ErrorIs(t, err, unix.ENOSPC)
	must.SliceLen(t, 1, d.started, must.Sprint("only the plugin task started"))
	must.Eq(t, 0, fp.vols.Count(csihook.MethodNodePublishVolume))

	d.host = fakeHost{root: true, statfs: statfsOf(roomy)}
	_, _, err = d.StartTask(work)
	must.NoError(t, err)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))
}
