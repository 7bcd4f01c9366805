package mounter

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
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

// privateDir returns a temporary directory made a private mount of its
// own, so that what a test mounts under it propagates nowhere, whatever
// the host's / is.
func privateDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	cleanupMount(t, dir)
	must.NoError(t, unix.Mount(dir, dir, "", unix.MS_BIND, ""))
	must.NoError(t, unix.Mount("", dir, "", unix.MS_PRIVATE, ""))
	return dir
}

// mountTmpfs mounts a small tmpfs at path (made first) until the test ends.
func mountTmpfs(t *testing.T, path string) {
	t.Helper()
	must.NoError(t, os.MkdirAll(path, 0o755))
	cleanupMount(t, path)
	must.NoError(t, unix.Mount("tmpfs", path, "tmpfs", 0, "size=1m"))
}

// mountAt returns the mountinfo entry whose mount point is path.
func mountAt(t *testing.T, m Interface, path string) (MountPoint, bool) {
	t.Helper()
	mounts, err := m.List()
	must.NoError(t, err)
	for i := len(mounts) - 1; i >= 0; i-- {
		if mounts[i].Path == path {
			return mounts[i], true
		}
	}
	return MountPoint{}, false
}

// writable reports whether a file can be made in dir; it fails the test
// on any error but EROFS.
func writable(t *testing.T, dir string) bool {
	t.Helper()
	err := os.WriteFile(filepath.Join(dir, "probe"), nil, 0o644)
	if errors.Is(err, unix.EROFS) {
		return false
	}
	must.NoError(t, err)
	must.NoError(t, os.Remove(filepath.Join(dir, "probe")))
	return true
}

// The source has a submount (a tmpfs at sub): a recursive bind brings it
// along and, read-only, makes it read-only too (ro in its own mountinfo
// line, EROFS on write); a non-recursive bind leaves it out. The source
// and its submount stay writable.
func TestMounter_BindMount_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	dir := privateDir(t)
	src := filepath.Join(dir, "src")
	must.NoError(t, os.Mkdir(src, 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(src, "f"), []byte("x"), 0o644))
	mountTmpfs(t, filepath.Join(src, "sub"))
	must.NoError(t, os.WriteFile(filepath.Join(src, "sub", "f"), []byte("in sub"), 0o644))

	cases := []struct {
		name      string
		readOnly  bool
		recursive bool
	}{
		{"read-write", false, false},
		{"read-only", true, false},
		{"read-write recursive", false, true},
		{"read-only recursive", true, true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			target := filepath.Join(dir, fmt.Sprint("dst", i), "a", "b")
			must.NoError(t, m.EnsureTarget(target, true))
			cleanupMount(t, target)
			must.NoError(t, m.BindMount(src, target, tc.readOnly, tc.recursive))

			ok, err := m.IsMountPoint(target)
			must.NoError(t, err)
			must.True(t, ok)
			b, err := os.ReadFile(filepath.Join(target, "f"))
			must.NoError(t, err)
			must.Eq(t, "x", string(b))
			mp, ok := mountAt(t, m, target)
			must.True(t, ok)
			must.Eq(t, tc.readOnly, slices.Contains(mp.Options, "ro"), must.Sprintf("options %v", mp.Options))
			must.Eq(t, !tc.readOnly, writable(t, target))

			sub := filepath.Join(target, "sub")
			smp, ok := mountAt(t, m, sub)
			must.Eq(t, tc.recursive, ok, must.Sprint("is the submount there"))
			if tc.recursive {
				must.Eq(t, "tmpfs", smp.FSType)
				must.Eq(t, tc.readOnly, slices.Contains(smp.Options, "ro"), must.Sprintf("submount options %v", smp.Options))
				must.Eq(t, !tc.readOnly, writable(t, sub))
				b, err := os.ReadFile(filepath.Join(sub, "f"))
				must.NoError(t, err)
				must.Eq(t, "in sub", string(b))
			} else {
				// The source's own directory, not its tmpfs.
				_, err := os.Stat(filepath.Join(sub, "f"))
				must.ErrorIs(t, err, fs.ErrNotExist)
			}

			// The source and its submount stay writable.
			must.True(t, writable(t, src))
			must.True(t, writable(t, filepath.Join(src, "sub")))
			smp, ok = mountAt(t, m, filepath.Join(src, "sub"))
			must.True(t, ok)
			must.SliceContains(t, smp.Options, "rw")

			if tc.recursive {
				must.NoError(t, m.Unmount(sub))
			}
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

// RemountReadOnly of a tree: recursive reaches the submount, non-recursive
// does not.
func TestMounter_RemountReadOnly_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	for _, recursive := range []bool{false, true} {
		t.Run(fmt.Sprint("recursive=", recursive), func(t *testing.T) {
			dir := privateDir(t)
			top := filepath.Join(dir, "top")
			mountTmpfs(t, top)
			sub := filepath.Join(top, "sub")
			mountTmpfs(t, sub)

			must.NoError(t, m.RemountReadOnly(top, recursive))
			for _, path := range []string{top, sub} {
				mp, ok := mountAt(t, m, path)
				must.True(t, ok)
				wantRO := path == top || recursive
				must.Eq(t, wantRO, slices.Contains(mp.Options, "ro"), must.Sprintf("%s options %v", path, mp.Options))
				must.Eq(t, !wantRO, writable(t, path))
			}
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
	dir := privateDir(t)
	target := filepath.Join(dir, "t")
	mountTmpfs(t, target)

	for _, mode := range []string{PropagationShared, PropagationPrivate, PropagationUnbindable} {
		t.Run(mode, func(t *testing.T) {
			must.NoError(t, m.SetPropagation(target, mode, false))
			mp, ok := mountAt(t, m, target)
			must.True(t, ok)
			want := mode
			if mode == PropagationUnbindable {
				want = "unbindable"
			}
			must.Eq(t, want, mp.Propagation())
			if mode == PropagationShared {
				must.Positive(t, mp.PeerGroup)
			}
		})
	}
	must.ErrorContains(t, m.SetPropagation(target, "bogus", false), "unknown propagation mode")
}

// A bind of a shared mount (with a shared submount) is in the source's
// peer groups; made a slave it shows master:<the source's group> and no
// shared:, receives the source's new mounts and sends none back. A
// recursive change reaches the submount too; a non-recursive one leaves
// it shared.
func TestMounter_SetPropagationSlave_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	for _, recursive := range []bool{false, true} {
		t.Run(fmt.Sprint("recursive=", recursive), func(t *testing.T) {
			dir := privateDir(t)
			master := filepath.Join(dir, "master")
			mountTmpfs(t, master)
			must.NoError(t, m.SetPropagation(master, PropagationShared, false))
			mountTmpfs(t, filepath.Join(master, "sub"))
			must.NoError(t, m.SetPropagation(filepath.Join(master, "sub"), PropagationShared, false))
			for _, d := range []string{"fromMaster", "fromSlave", "sub/fromMaster"} {
				must.NoError(t, os.Mkdir(filepath.Join(master, d), 0o755))
			}
			mmp, ok := mountAt(t, m, master)
			must.True(t, ok)
			msub, ok := mountAt(t, m, filepath.Join(master, "sub"))
			must.True(t, ok)
			must.True(t, mmp.Shared && msub.Shared)

			slave := filepath.Join(dir, "slave")
			must.NoError(t, os.Mkdir(slave, 0o755))
			cleanupMount(t, slave)
			must.NoError(t, m.BindMount(master, slave, false, true))
			smp, ok := mountAt(t, m, slave)
			must.True(t, ok)
			must.Eq(t, mmp.PeerGroup, smp.PeerGroup, must.Sprint("the bind joins the source's peer group"))

			must.NoError(t, m.SetPropagation(slave, PropagationSlave, recursive))

			smp, ok = mountAt(t, m, slave)
			must.True(t, ok)
			must.Eq(t, PropagationSlave, smp.Propagation())
			must.False(t, smp.Shared, must.Sprint("a slave has no shared: tag"))
			must.Eq(t, mmp.PeerGroup, smp.Master, must.Sprint("master: names the source's peer group"))
			ssub, ok := mountAt(t, m, filepath.Join(slave, "sub"))
			must.True(t, ok)
			if recursive {
				must.Eq(t, PropagationSlave, ssub.Propagation())
				must.Eq(t, msub.PeerGroup, ssub.Master)
			} else {
				must.Eq(t, PropagationShared, ssub.Propagation())
				must.Eq(t, msub.PeerGroup, ssub.PeerGroup)
			}
			// The source stays shared.
			mmp2, ok := mountAt(t, m, master)
			must.True(t, ok)
			must.Eq(t, PropagationShared, mmp2.Propagation())

			// Mounts go from the master to the slave, not back.
			mountTmpfs(t, filepath.Join(master, "fromMaster"))
			_, ok = mountAt(t, m, filepath.Join(slave, "fromMaster"))
			must.True(t, ok, must.Sprint("a mount on the master reaches the slave"))
			mountTmpfs(t, filepath.Join(slave, "fromSlave"))
			_, ok = mountAt(t, m, filepath.Join(master, "fromSlave"))
			must.False(t, ok, must.Sprint("a mount on the slave reaches the master"))
			mountTmpfs(t, filepath.Join(master, "sub", "fromMaster"))
			_, ok = mountAt(t, m, filepath.Join(slave, "sub", "fromMaster"))
			must.True(t, ok, must.Sprint("a mount on the master's submount reaches the slave's"))
		})
	}
}

// A recursive clone of a tree with a submount, locked read-only, nosuid
// and nodev, shows those flags on every mount of the copy once attached;
// the source keeps its own. A non-recursive clone leaves the submount out.
func TestMounter_CloneLockTree_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	for _, recursive := range []bool{false, true} {
		t.Run(fmt.Sprint("recursive=", recursive), func(t *testing.T) {
			dir := privateDir(t)
			src := filepath.Join(dir, "src")
			mountTmpfs(t, src)
			sub := filepath.Join(src, "sub")
			mountTmpfs(t, sub)

			tree, err := m.CloneTree(src, recursive)
			must.NoError(t, err)
			defer tree.Close()
			must.NoError(t, m.LockTree(tree, true, true, true))
			target := filepath.Join(dir, "dst")
			must.NoError(t, os.Mkdir(target, 0o755))
			cleanupMount(t, target)
			must.NoError(t, m.AttachTree(tree, target))

			paths := []string{target}
			if recursive {
				paths = append(paths, filepath.Join(target, "sub"))
			} else {
				_, ok := mountAt(t, m, filepath.Join(target, "sub"))
				must.False(t, ok, must.Sprint("a non-recursive clone brought the submount"))
			}
			for _, path := range paths {
				mp, ok := mountAt(t, m, path)
				must.True(t, ok, must.Sprintf("%s is not mounted", path))
				for _, opt := range []string{"ro", "nosuid", "nodev"} {
					must.SliceContains(t, mp.Options, opt, must.Sprintf("%s options", path))
				}
				must.False(t, writable(t, path))
			}
			for _, path := range []string{src, sub} {
				mp, ok := mountAt(t, m, path)
				must.True(t, ok)
				must.SliceContains(t, mp.Options, "rw", must.Sprintf("%s options", path))
				must.SliceNotContains(t, mp.Options, "nosuid", must.Sprintf("%s options", path))
				must.True(t, writable(t, path))
			}
		})
	}
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

// UnmountExact unmounts only the mount it was given, at its path below
// root: never through a symlink put on the way, never another mount that
// took the path, never a path outside root.
func TestMounter_UnmountExact_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	dir := privateDir(t)
	root := filepath.Join(dir, "root")
	outside := filepath.Join(dir, "outside")

	mounted := func(path string) bool {
		ok, err := m.IsMountPoint(path)
		must.NoError(t, err)
		return ok
	}

	t.Run("the mount with that ID", func(t *testing.T) {
		target := filepath.Join(root, "a", "vol")
		mountTmpfs(t, target)
		mp, ok := mountAt(t, m, target)
		must.True(t, ok)
		must.NoError(t, m.UnmountExact(root, target, mp.ID))
		must.False(t, mounted(target))
	})

	t.Run("another mount at the path", func(t *testing.T) {
		target := filepath.Join(root, "b", "vol")
		mountTmpfs(t, target)
		mp, ok := mountAt(t, m, target)
		must.True(t, ok)
		err := m.UnmountExact(root, target, mp.ID+100000)
		must.ErrorContains(t, err, "no longer the mount point")
		must.True(t, mounted(target))
	})

	t.Run("a directory inside a mount, not its root", func(t *testing.T) {
		target := filepath.Join(root, "c", "vol")
		mountTmpfs(t, target)
		mp, ok := mountAt(t, m, target)
		must.True(t, ok)
		sub := filepath.Join(target, "sub")
		must.NoError(t, os.Mkdir(sub, 0o755))
		must.ErrorContains(t, m.UnmountExact(root, sub, mp.ID), "no longer the mount point")
		must.True(t, mounted(target))
	})

	t.Run("a symlink put on the way", func(t *testing.T) {
		// A mount outside root, and a path under root that a symlink
		// now leads to it through.
		victim := filepath.Join(outside, "d", "x", "vol")
		mountTmpfs(t, victim)
		mp, ok := mountAt(t, m, victim)
		must.True(t, ok)
		must.NoError(t, os.MkdirAll(filepath.Join(root, "d"), 0o755))
		link := filepath.Join(root, "d", "link")
		must.NoError(t, os.Symlink(filepath.Join(outside, "d"), link))
		err := m.UnmountExact(root, filepath.Join(link, "x", "vol"), mp.ID)
		must.ErrorContains(t, err, "without following symlinks")
		must.True(t, mounted(victim))
	})

	t.Run("a path outside root", func(t *testing.T) {
		victim := filepath.Join(outside, "e", "vol")
		mountTmpfs(t, victim)
		mp, ok := mountAt(t, m, victim)
		must.True(t, ok)
		for _, p := range []string{victim, root, filepath.Join(root, "..", "outside", "e", "vol")} {
			must.ErrorContains(t, m.UnmountExact(root, p, mp.ID), "is not below")
		}
		must.True(t, mounted(victim))
	})
}

// IsMountPoint answers as the mount table does, for a tmpfs, a bind of a
// directory inside one, a bind of a file, a directory inside a mount, a
// path mounted twice, a symlink to a mount point, and a plain directory.
func TestMounter_IsMountPoint_AgreesWithTable_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	dir := privateDir(t)
	tmp := filepath.Join(dir, "tmp")
	mountTmpfs(t, tmp)
	must.NoError(t, os.MkdirAll(filepath.Join(tmp, "inner"), 0o755))
	sub := filepath.Join(dir, "sub")
	must.NoError(t, os.MkdirAll(sub, 0o755))
	cleanupMount(t, sub)
	must.NoError(t, unix.Mount(filepath.Join(tmp, "inner"), sub, "", unix.MS_BIND, ""))
	file, fileTarget := filepath.Join(dir, "file"), filepath.Join(dir, "file-target")
	must.NoError(t, os.WriteFile(file, nil, 0o644))
	must.NoError(t, os.WriteFile(fileTarget, nil, 0o644))
	cleanupMount(t, fileTarget)
	must.NoError(t, unix.Mount(file, fileTarget, "", unix.MS_BIND, ""))
	twice := filepath.Join(dir, "twice")
	mountTmpfs(t, twice)
	mountTmpfs(t, twice)
	link := filepath.Join(dir, "link")
	must.NoError(t, os.Symlink(tmp, link))
	plain := filepath.Join(dir, "plain")
	must.NoError(t, os.MkdirAll(plain, 0o755))

	table, err := m.List()
	must.NoError(t, err)
	for path, want := range map[string]bool{
		tmp: true, sub: true, fileTarget: true, twice: true, link: true, dir: true,
		filepath.Join(tmp, "inner"): false, plain: false, file: false,
	} {
		ok, err := m.IsMountPoint(path)
		must.NoError(t, err)
		must.Eq(t, want, ok, must.Sprintf("IsMountPoint(%s)", path))
		real, err := filepath.EvalSymlinks(path)
		must.NoError(t, err)
		must.Eq(t, isMountPoint(table, real), ok, must.Sprintf("%s: the table says otherwise", path))
	}
}

// BenchmarkIsMountPoint checks one mount point on a node with n more mounts
// (tmpfs mounts under a private directory, as many CSI volumes leave
// under root_dir/mnt), with statx and by reading the mount table, which
// IsMountPoint did before: the table's cost grows with the node's mounts.
//
//	go test -run '^$' -bench IsMountPoint ./mounter/ (root)
func BenchmarkIsMountPoint(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: it mounts")
	}
	m := New().(*mounter)
	for _, n := range []int{10, 100, 1000} {
		b.Run(fmt.Sprintf("mounts=%d", n), func(b *testing.B) {
			dir := b.TempDir()
			must.NoError(b, unix.Mount(dir, dir, "", unix.MS_BIND, ""))
			must.NoError(b, unix.Mount("", dir, "", unix.MS_PRIVATE, ""))
			b.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
			for i := range n {
				p := filepath.Join(dir, strconv.Itoa(i))
				must.NoError(b, os.Mkdir(p, 0o755))
				must.NoError(b, unix.Mount("tmpfs", p, "tmpfs", 0, "size=64k"))
			}
			target := filepath.Join(dir, "0")
			b.Run("statx", func(b *testing.B) {
				for b.Loop() {
					if ok, err := m.IsMountPoint(target); err != nil || !ok {
						b.Fatalf("IsMountPoint(%s) = %v, %v", target, ok, err)
					}
				}
			})
			b.Run("table", func(b *testing.B) {
				for b.Loop() {
					table, err := m.List()
					if err != nil || !isMountPoint(table, target) {
						b.Fatalf("%s not in the table: %v", target, err)
					}
				}
			})
		})
	}
}
