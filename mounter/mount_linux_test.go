package mounter

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("test needs root: it makes real mounts")
	}
}

// cleanupMount unmounts target (and anything stacked there) at test end,
// whether the test passed or not.
func cleanupMount(t *testing.T, target string) {
	t.Cleanup(func() {
		for i := 0; i < 8; i++ {
			if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
				return
			}
		}
	})
}

func TestMounter_BindMount_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	src := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(src, "f"), []byte("x"), 0o644))

	cases := []struct {
		name      string
		readOnly  bool
		recursive bool
	}{
		{"read-write", false, false},
		{"read-only", true, false},
		{"read-only recursive", true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			target := filepath.Join(t.TempDir(), "a", "b")
			must.NoError(t, m.EnsureTarget(target, true))
			cleanupMount(t, target)
			must.NoError(t, m.BindMount(src, target, tc.readOnly, tc.recursive))

			ok, err := m.IsMountPoint(target)
			must.NoError(t, err)
			must.True(t, ok)
			b, err := os.ReadFile(filepath.Join(target, "f"))
			must.NoError(t, err)
			must.Eq(t, "x", string(b))

			err = os.WriteFile(filepath.Join(target, "g"), nil, 0o644)
			if tc.readOnly {
				must.ErrorIs(t, err, unix.EROFS)
			} else {
				must.NoError(t, err)
			}
			// The source itself stays writable.
			must.NoError(t, os.WriteFile(filepath.Join(src, "h"), nil, 0o644))

			must.NoError(t, m.Unmount(target))
			ok, err = m.IsMountPoint(target)
			must.NoError(t, err)
			must.False(t, ok)
			// Unmounting again, or a missing path, is success.
			must.NoError(t, m.Unmount(target))
			must.NoError(t, m.Unmount(filepath.Join(target, "missing")))
		})
	}
}

func TestMounter_ReadOnlyKeepsFlags_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	must.NoError(t, os.Mkdir(src, 0o755))
	cleanupMount(t, src)
	must.NoError(t, m.Mount("tmpfs", src, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=1m"))

	target := filepath.Join(dir, "dst")
	must.NoError(t, m.EnsureTarget(target, true))
	cleanupMount(t, target)
	must.NoError(t, m.BindMount(src, target, true, false))

	mounts, err := m.List()
	must.NoError(t, err)
	mp, ok := FindMount(mounts, target)
	must.True(t, ok)
	must.Eq(t, target, mp.Path)
	for _, opt := range []string{"ro", "nosuid", "nodev", "noexec"} {
		must.SliceContains(t, mp.Options, opt)
	}
	must.Eq(t, "tmpfs", mp.FSType)
}

func TestMounter_SetPropagation_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	dir := t.TempDir()
	cleanupMount(t, dir)
	must.NoError(t, m.BindMount(dir, dir, false, false))

	for _, mode := range []string{PropagationShared, PropagationSlave, PropagationPrivate} {
		t.Run(mode, func(t *testing.T) {
			if mode == PropagationSlave {
				// Slave of a shared mount needs a master: make it shared
				// first, then demote it.
				must.NoError(t, m.SetPropagation(dir, PropagationShared, false))
			}
			must.NoError(t, m.SetPropagation(dir, mode, false))
			mounts, err := m.List()
			must.NoError(t, err)
			mp, ok := FindMount(mounts, dir)
			must.True(t, ok)
			if mode == PropagationSlave {
				// Without other peers a demoted shared mount has no master
				// left and reads as private.
				must.False(t, mp.Shared)
				return
			}
			must.Eq(t, mode, mp.Propagation())
		})
	}
	must.ErrorContains(t, m.SetPropagation(dir, "bogus", false), "unknown propagation mode")
}

func TestMounter_SensitiveErrorsAreMasked_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	target := filepath.Join(t.TempDir(), "missing")
	err := m.MountSensitive("tmpfs", target, "tmpfs", 0, []string{"size=1m"}, []string{"secret=hunter2"})
	must.Error(t, err)
	must.StrNotContains(t, err.Error(), "hunter2")
	must.StrContains(t, err.Error(), "<masked>")

	err = m.Mount("tmpfs", target, "tmpfs", 0, "secret=hunter2")
	must.Error(t, err)
	must.StrNotContains(t, err.Error(), "hunter2")
}

func TestMounter_EnsureTarget(t *testing.T) {
	m := New()
	dir := t.TempDir()

	file := filepath.Join(dir, "x", "y", "file")
	must.NoError(t, m.EnsureTarget(file, false))
	fi, err := os.Stat(file)
	must.NoError(t, err)
	must.True(t, fi.Mode().IsRegular())
	must.NoError(t, m.EnsureTarget(file, false)) // idempotent

	sub := filepath.Join(dir, "d", "e")
	must.NoError(t, m.EnsureTarget(sub, true))
	fi, err = os.Stat(sub)
	must.NoError(t, err)
	must.True(t, fi.IsDir())

	must.ErrorContains(t, m.EnsureTarget(file, true), "not a directory")
	must.ErrorContains(t, m.EnsureTarget(sub, false), "is a directory")
}

func TestMounter_IsMountPoint(t *testing.T) {
	m := New()
	ok, err := m.IsMountPoint("/")
	must.NoError(t, err)
	must.True(t, ok)

	dir := t.TempDir()
	ok, err = m.IsMountPoint(dir)
	must.NoError(t, err)
	must.False(t, ok)

	_, err = m.IsMountPoint(filepath.Join(dir, "missing"))
	must.True(t, errors.Is(err, fs.ErrNotExist))
}
