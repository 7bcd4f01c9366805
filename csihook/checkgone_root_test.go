package csihook

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// hostChecks is the harness's fake mounter, whose fake plugin mounts and
// unmounts in its table, with the teardown's checks of a path (whether it
// is mounted, whether its mount is dead, the lazy detach) asked of the
// host's kernel once real is set: what the plugin left at a path is then
// what is really there.
type hostChecks struct {
	*mounter.Fake
	host mounter.Interface
	real atomic.Bool
}

func (c *hostChecks) IsMountPoint(path string) (bool, error) {
	if c.real.Load() {
		return c.host.IsMountPoint(path)
	}
	return c.Fake.IsMountPoint(path)
}

func (c *hostChecks) Stale(path string) (bool, error) {
	if c.real.Load() {
		return c.host.Stale(path)
	}
	return c.Fake.Stale(path)
}

func (c *hostChecks) DetachLazy(path string) error {
	if c.real.Load() {
		return c.host.DetachLazy(path)
	}
	return c.Fake.DetachLazy(path)
}

// mountDeadFUSE mounts at target a FUSE file system whose daemon is gone
// before it ever answers (its /dev/fuse descriptor closed): every access to
// target fails with ENOTCONN while the mount stays in the table, as a
// killed FUSE-backed plugin leaves it. The mount is detached at the end
// whatever happens.
func mountDeadFUSE(t *testing.T, target string) {
	t.Helper()
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("needs /dev/fuse: %v", err)
	}
	must.NoError(t, os.MkdirAll(target, 0o755))
	err = unix.Mount("deadfuse", target, "fuse.deadfuse", unix.MS_NOSUID|unix.MS_NODEV,
		fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", fd))
	_ = unix.Close(fd)
	must.NoError(t, err)
	t.Cleanup(func() {
		for hostMounted(t, target) {
			if err := unix.Unmount(target, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil {
				t.Errorf("cleanup: detach %s: %v", target, err)
				return
			}
		}
	})
}

// hostMounted reports whether the host's mount table has a mount at path
// (by name, never following it).
func hostMounted(t *testing.T, path string) bool {
	t.Helper()
	table, err := mounter.New().List()
	must.NoError(t, err)
	return slices.ContainsFunc(table, func(mp mounter.MountPoint) bool { return mp.Path == filepath.Clean(path) })
}

func hostChecksHarness(t *testing.T) (*harness, *hostChecks) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: a real FUSE mount")
	}
	var checks *hostChecks
	h := newHarness(t, func(cfg *Config) {
		checks = &hostChecks{Fake: cfg.Mounter.(*mounter.Fake), host: mounter.New()}
		cfg.Mounter = checks
	})
	return h, checks
}

// A plugin that says it unpublished (or unstaged) and leaves a dead FUSE
// mount at the path: the real mounter's check of the path fails with
// ENOTCONN, the mount is found dead, detached from the host for real, and
// the teardown ends with the volume's records dropped.
func TestCheckGone_realDeadFUSEDetached_Root(t *testing.T) {
	for _, method := range []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume} {
		t.Run(method, func(t *testing.T) {
			h, checks := hostChecksHarness(t)
			ctx := context.Background()
			_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
			must.NoError(t, err)
			path := h.m.TargetPath("task-a", "data")
			if method == MethodNodeUnstageVolume {
				path = h.m.StagingPath("p", "vol1")
			}
			mountDeadFUSE(t, path)
			_, err = mounter.New().IsMountPoint(path)
			must.ErrorIs(t, err, unix.ENOTCONN, must.Sprint("the real check of a dead FUSE mount fails with ENOTCONN"))

			checks.real.Store(true)
			must.NoError(t, h.m.Teardown(ctx, "task-a"))
			must.SliceEmpty(t, h.journalRecords())
			must.False(t, hostMounted(t, path), must.Sprintf("the dead mount at %s is still on the host", path))
		})
	}
}

// What a plugin leaves at the target path after it says it unpublished,
// when that is a symbolic link, is not a mount: the link is removed and the
// teardown ends, wherever the link points. The check must not follow it:
// a link into a dead mount elsewhere, a loop, or a link to "/" kept the
// task's records, and retried the teardown for good.
func TestCheckGone_symlinkLeftAtTargetIsGone_Root(t *testing.T) {
	for _, tc := range []struct {
		name string
		dest func(t *testing.T, dir, link string) string
	}{
		{"loop", func(t *testing.T, dir, link string) string { return link }},
		{"root", func(t *testing.T, dir, link string) string { return "/" }},
		{"dead mount", func(t *testing.T, dir, link string) string {
			dead := filepath.Join(dir, "elsewhere")
			mountDeadFUSE(t, dead)
			return dead
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, checks := hostChecksHarness(t)
			ctx := context.Background()
			_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
			must.NoError(t, err)
			path := h.m.TargetPath("task-a", "data")
			must.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
			if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Fatal(err)
			}
			must.NoError(t, os.Symlink(tc.dest(t, t.TempDir(), path), path))

			checks.real.Store(true)
			must.NoError(t, h.m.Teardown(ctx, "task-a"))
			must.SliceEmpty(t, h.journalRecords())
			_, err = os.Lstat(path)
			must.ErrorIs(t, err, os.ErrNotExist, must.Sprint("the link the plugin left is removed"))
		})
	}
}
