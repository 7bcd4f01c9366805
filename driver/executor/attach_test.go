package executor

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// mountFUSE serves backing at target through a FUSE loopback file system
// run by this process, as a FUSE CSI plugin does, and returns kill, which
// aborts the FUSE connection as the death of such a plugin does: from then
// on every access to target fails with ENOTCONN while it stays mounted.
func mountFUSE(t *testing.T, backing, target string) (kill func()) {
	t.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("test needs /dev/fuse: %v", err)
	}
	root, err := fusefs.NewLoopbackRoot(backing)
	must.NoError(t, err)
	srv, err := fusefs.Mount(target, root, &fusefs.Options{MountOptions: fuse.MountOptions{
		DirectMountStrict: true, FsName: "fixture-fuse", Name: "fixture"}})
	must.NoError(t, err)
	var st unix.Stat_t
	must.NoError(t, unix.Stat(target, &st))
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
	return func() {
		ctl := t.TempDir()
		must.NoError(t, unix.Mount("fusectl", ctl, "fusectl", 0, ""))
		defer unix.Unmount(ctl, unix.MNT_DETACH)
		// fusectl names a connection by the kernel's dev_t of its
		// superblock (major << 20 | minor), which st_dev encodes
		// otherwise once the minor is past 255.
		conn := uint64(unix.Major(st.Dev))<<20 | uint64(unix.Minor(st.Dev))
		must.NoError(t, os.WriteFile(filepath.Join(ctl, fmt.Sprint(conn), "abort"), []byte("1"), 0))
		srv.Wait()
	}
}

// A task whose volume mount died gets the fresh host mount in its running
// mount namespace, read-only as its mount was, and sees its data again
// without a restart.
func TestReplaceMount_DeadVolume_Root(t *testing.T) {
	requireTaskRoot(t)
	base, err := filepath.EvalSymlinks(t.TempDir())
	must.NoError(t, err)
	t.Cleanup(func() { detachAll(base) })
	must.NoError(t, unix.Mount(base, base, "", unix.MS_BIND, ""))
	must.NoError(t, unix.Mount("", base, "", unix.MS_PRIVATE, ""))
	vol := filepath.Join(base, "vol")
	must.NoError(t, os.Mkdir(vol, 0o755))
	backing := t.TempDir()
	kill := mountFUSE(t, backing, vol)

	tt := newTestSpec(t, "/bin/sh", "-c", `
echo up
while ls /vol >/dev/null 2>&1; do sleep 0.05; done
echo dead
while ! cat /vol/data 2>/dev/null; do sleep 0.05; done
if touch /vol/new 2>/dev/null; then echo writable; else echo readonly; fi
echo $$
exec sleep 100`)
	tt.spec.Mounts = []Mount{{Source: vol, Target: "/vol", ReadOnly: true}}
	p := startTest(t, tt)
	waitFor(t, "the task to start", func() bool { return readFile(t, tt.stdout) == "up\n" })
	kill()
	waitFor(t, "the task to see its dead mount", func() bool { return readFile(t, tt.stdout) == "up\ndead\n" })
	stale, err := mounter.New().Stale(vol)
	must.NoError(t, err)
	must.True(t, stale)

	// The host side of a repair: the dead mount detached, a fresh one made.
	m := mounter.New()
	must.NoError(t, m.DetachLazy(vol))
	must.NoError(t, m.Mount("fresh", vol, "tmpfs", 0, "size=1m"))
	must.NoError(t, os.WriteFile(filepath.Join(vol, "data"), []byte("back\n"), 0o644))

	target, err := p.ReplaceMount(vol, "/vol", false)
	must.NoError(t, err)
	must.Eq(t, "/vol", target)
	waitFor(t, "the task to read its data again", func() bool {
		return strings.HasPrefix(readFile(t, tt.stdout), "up\ndead\nback\nreadonly\n")
	})
	// Same process: the task was never restarted.
	lines := strings.Split(strings.TrimSpace(readFile(t, tt.stdout)), "\n")
	must.Eq(t, fmt.Sprint(p.state.TaskPID), lines[len(lines)-1])
	must.Eq(t, 0, len(readFile(t, tt.stderr)), must.Sprint(readFile(t, tt.stderr)))

	// A mount the task does not have is refused.
	_, err = p.ReplaceMount(vol, "/other", false)
	must.ErrorContains(t, err, "the task has no mount there")
}

// A task that swaps a directory on the way to its volume's target for a
// symlink (to get a mount made outside its root, or on a path of its
// choosing) gets nothing: the symlink is refused and nothing is detached
// or mounted anywhere else.
func TestReplaceMount_SymlinkSwap_Root(t *testing.T) {
	requireTaskRoot(t)
	base, err := filepath.EvalSymlinks(t.TempDir())
	must.NoError(t, err)
	t.Cleanup(func() { detachAll(base) })
	must.NoError(t, unix.Mount(base, base, "", unix.MS_BIND, ""))
	must.NoError(t, unix.Mount("", base, "", unix.MS_PRIVATE, ""))
	work := filepath.Join(base, "work")
	must.NoError(t, os.MkdirAll(filepath.Join(work, "sub", "vol"), 0o755))
	vol := filepath.Join(base, "vol")
	must.NoError(t, os.Mkdir(vol, 0o755))
	must.NoError(t, unix.Mount("old", vol, "tmpfs", 0, "size=1m"))
	escape := filepath.Join(base, "escape")
	must.NoError(t, os.MkdirAll(filepath.Join(escape, "vol"), 0o755))

	tt := newTestSpec(t, "/bin/sh", "-c", `mv /work/sub /work/moved && ln -s "$ESCAPE" /work/sub && echo swapped && exec sleep 100`)
	tt.spec.Env = append(tt.spec.Env, "ESCAPE="+escape)
	tt.spec.Mounts = []Mount{
		{Source: work, Target: "/work"},
		{Source: vol, Target: "/work/sub/vol"},
	}
	p := startTest(t, tt)
	waitFor(t, "the task to swap its path", func() bool { return readFile(t, tt.stdout) == "swapped\n" })

	before, err := mounter.New().List()
	must.NoError(t, err)
	_, err = p.ReplaceMount(vol, "/work/sub/vol", false)
	must.ErrorIs(t, err, mounter.ErrSymlinkTarget)
	after, err := mounter.New().List()
	must.NoError(t, err)
	// Only the test's own tree is compared: other programs on the host
	// (Nomad agents of other tests) mount and unmount meanwhile.
	must.SliceNotEmpty(t, mountsWithin(before, vol), must.Sprint("the volume is not in the host's table"))
	must.Eq(t, mountsWithin(before, base), mountsWithin(after, base), must.Sprint("the host's mounts under the test's tree changed"))
	ok, err := mounter.New().IsMountPoint(filepath.Join(escape, "vol"))
	must.NoError(t, err)
	must.False(t, ok)
}

// A task that moved itself into a mount namespace of its own user
// namespace (unshare -Urm) would get a moved-in mount without the locks on
// read-only, nosuid and nodev that a copied namespace has, and could make
// its read-only volume writable: the replacement is refused there, and
// nothing is mounted in that namespace.
func TestReplaceMount_TaskInItsOwnUserNamespace_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/usr/bin/unshare"); err != nil {
		t.Skipf("test needs /usr/bin/unshare: %v", err)
	}
	base, err := filepath.EvalSymlinks(t.TempDir())
	must.NoError(t, err)
	t.Cleanup(func() { detachAll(base) })
	must.NoError(t, unix.Mount(base, base, "", unix.MS_BIND, ""))
	must.NoError(t, unix.Mount("", base, "", unix.MS_PRIVATE, ""))
	vol := filepath.Join(base, "vol")
	must.NoError(t, os.Mkdir(vol, 0o755))
	must.NoError(t, unix.Mount("old", vol, "tmpfs", 0, "size=1m"))

	tt := newTestSpec(t, "/bin/sh", "-c", `exec /usr/bin/unshare -Urm /bin/sh -c 'echo moved; exec sleep 100'`)
	tt.spec.Mounts = []Mount{{Source: vol, Target: "/vol", ReadOnly: true}}
	p := startTest(t, tt)
	waitFor(t, "the task to move into its own namespaces", func() bool { return readFile(t, tt.stdout) == "moved\n" })
	nsBefore, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", p.state.TaskPID))
	must.NoError(t, err)
	mountsBefore, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", p.state.TaskPID))
	must.NoError(t, err)

	must.NoError(t, unix.Unmount(vol, unix.MNT_DETACH))
	must.NoError(t, unix.Mount("fresh", vol, "tmpfs", 0, "size=1m"))
	_, err = p.ReplaceMount(vol, "/vol", true)
	must.ErrorContains(t, err, "user namespace of its own")

	nsAfter, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", p.state.TaskPID))
	must.NoError(t, err)
	must.Eq(t, nsBefore, nsAfter)
	mountsAfter, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", p.state.TaskPID))
	must.NoError(t, err)
	// The task's table also shows the host's mounts (slaves), which other
	// programs change meanwhile: compare what is at and below /vol.
	must.SliceNotEmpty(t, mountinfoWithin(string(mountsBefore), "/vol"), must.Sprintf("no mount at /vol in the task's table:\n%s", mountsBefore))
	must.Eq(t, mountinfoWithin(string(mountsBefore), "/vol"), mountinfoWithin(string(mountsAfter), "/vol"), must.Sprint("the task's mounts at /vol changed"))
}

// mountsWithin lists the mount points of table at or below dir, with
// their IDs and sources, in the table's order.
func mountsWithin(table []mounter.MountPoint, dir string) []string {
	var out []string
	for _, m := range table {
		if mounter.PathWithin(m.Path, dir) {
			out = append(out, fmt.Sprintf("%d %s %s", m.ID, m.Path, m.Source))
		}
	}
	return out
}

// mountinfoWithin keeps the lines of a mountinfo text whose mount point
// (the fifth field) is dir or below it.
func mountinfoWithin(mountinfo, dir string) []string {
	var out []string
	for _, line := range strings.Split(mountinfo, "\n") {
		if f := strings.Fields(line); len(f) > 4 && mounter.PathWithin(f[4], dir) {
			out = append(out, line)
		}
	}
	return out
}
