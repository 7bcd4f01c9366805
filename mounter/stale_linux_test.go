package mounter

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// MountDeadFUSE mounts a FUSE file system at target whose daemon is gone
// at once (its /dev/fuse descriptor is closed before it ever answers), the
// state a FUSE-backed CSI plugin leaves behind when it is killed: every
// access to target fails with ENOTCONN while the mount stays in the table.
func mountDeadFUSE(t *testing.T, target string) {
	t.Helper()
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("test needs /dev/fuse: %v", err)
	}
	cleanupMount(t, target)
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", fd)
	err = unix.Mount("deadfuse", target, "fuse.deadfuse", unix.MS_NOSUID|unix.MS_NODEV, opts)
	_ = unix.Close(fd)
	must.NoError(t, err)
}

func TestMounter_Stale_Root(t *testing.T) {
	requireRoot(t)
	dir := privateDir(t)
	m := New()

	dead := filepath.Join(dir, "dead")
	must.NoError(t, os.Mkdir(dead, 0o755))
	mountDeadFUSE(t, dead)
	alive := filepath.Join(dir, "alive")
	mountTmpfs(t, alive)
	plain := filepath.Join(dir, "plain")
	must.NoError(t, os.Mkdir(plain, 0o755))

	var st unix.Stat_t
	must.ErrorIs(t, unix.Stat(dead, &st), unix.ENOTCONN)
	for _, tc := range []struct {
		path string
		want bool
	}{
		{dead, true},
		{alive, false},
		{plain, false},
		{filepath.Join(dir, "missing"), false},
	} {
		got, err := m.Stale(tc.path)
		must.NoError(t, err)
		must.Eq(t, tc.want, got, must.Sprintf("Stale(%q)", tc.path))
	}

	// A dead mount is detached lazily; then it is neither mounted nor stale.
	must.NoError(t, m.DetachLazy(dead))
	_, ok := mountAt(t, m, dead)
	must.False(t, ok)
	got, err := m.Stale(dead)
	must.NoError(t, err)
	must.False(t, got)
	// Detaching what is not mounted any more is success.
	must.NoError(t, m.DetachLazy(dead))
}

// DetachAt takes the dead mount away by its name inside an opened
// directory and never follows a symlink in its place.
func TestMounter_DetachAt_Root(t *testing.T) {
	requireRoot(t)
	dir := privateDir(t)
	m := New()
	dead := filepath.Join(dir, "dead")
	must.NoError(t, os.Mkdir(dead, 0o755))
	mountDeadFUSE(t, dead)
	// A symlink to the dead mount: detaching it must leave the mount.
	must.NoError(t, os.Symlink(dead, filepath.Join(dir, "link")))

	parent, err := m.OpenTarget(dir, "/", true)
	must.NoError(t, err)
	defer parent.Close()
	onThread := func(name string) error {
		errc := make(chan error, 1)
		go func() {
			// Never unlocked: the thread's working directory changes.
			runtime.LockOSThread()
			errc <- m.DetachAt(parent, name)
		}()
		return <-errc
	}
	must.Error(t, onThread("../dead"))
	must.NoError(t, onThread("link"))
	_, ok := mountAt(t, m, dead)
	must.True(t, ok, must.Sprint("a symlink was followed"))
	must.NoError(t, onThread("dead"))
	_, ok = mountAt(t, m, dead)
	must.False(t, ok)
}
