package supervisor

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// fakeImageRoot is a task's state directory whose root directory stands
// for the mounted overlay (the fake mounts nothing): /lib a symlink to
// usr/lib, as merged-/usr images have it.
func fakeImageRoot(t *testing.T) (root string, img *wire.ImageRoot) {
	t.Helper()
	state := t.TempDir()
	root = filepath.Join(state, "root")
	must.NoError(t, os.MkdirAll(filepath.Join(root, "usr/lib"), 0o755))
	must.NoError(t, os.Symlink("usr/lib", filepath.Join(root, "lib")))
	return root, &wire.ImageRoot{Layers: []string{"/store/l0", "/store/l1"}, Ref: "example/csi:1"}
}

// A privileged image root: the overlay keeps the image's setuid bits and
// device nodes, and the host's /dev, /sys and /proc are bound in whole,
// and /lib/modules read-only at the path the image resolves it to.
func TestBuildImageRoot_Privileged_Fake(t *testing.T) {
	root, img := fakeImageRoot(t)
	modules := t.TempDir()
	old := hostModules
	hostModules = modules
	t.Cleanup(func() { hostModules = old })
	f := mounter.NewFake()
	must.NoError(t, buildImageRoot(f, root, img, nil))

	var got []string
	for _, a := range f.GetActions() {
		switch a.Kind {
		case mounter.ActionMountOverlay:
			got = append(got, a.Kind+" "+a.Source+" "+a.Target+" "+boolWord(a.Flags&unix.MS_NOSUID != 0, "nosuid"))
		case mounter.ActionBindMount:
			got = append(got, a.Kind+" "+a.Source+" "+a.Target+" "+boolWord(a.Recursive, "rec"))
		case mounter.ActionCloneTree, mounter.ActionAttachTree:
			got = append(got, a.Kind+" "+a.Source+" "+a.Target)
		case mounter.ActionLockTree:
			got = append(got, a.Kind+" "+boolWord(a.ReadOnly, "ro"))
		}
	}
	state := filepath.Dir(root)
	want := []string{
		"overlay /store/l0:/store/l1 " + root + " -",
		"bind /dev " + root + "/dev rec",
		"bind /sys " + root + "/sys rec",
		"bind /proc " + root + "/proc rec",
		"clone-tree " + modules + " ",
		"lock-tree ro",
		"attach-tree " + modules + " " + root + "/usr/lib/modules",
	}
	must.Eq(t, want, got)
	for _, a := range f.GetActions() {
		if a.Kind == mounter.ActionMountOverlay {
			must.Eq(t, filepath.Join(state, "upper")+":"+filepath.Join(state, "work"), a.Data)
		}
	}
	_, err := os.Lstat(filepath.Join(modules, "..", filepath.Base(root)))
	must.True(t, os.IsNotExist(err))
}

// An isolated image root is nosuid and nodev, and gets the task's own
// /dev, /proc and /sys, never the host's.
func TestBuildImageRoot_Isolated_Fake(t *testing.T) {
	root, img := fakeImageRoot(t)
	f := mounter.NewFake()
	must.NoError(t, buildImageRoot(f, root, img, &wire.Isolation{PrivatePID: true, PrivateIPC: true}))
	var kinds []string
	for _, a := range f.GetActions() {
		switch a.Kind {
		case mounter.ActionMountOverlay:
			must.Eq(t, uintptr(unix.MS_NOSUID|unix.MS_NODEV), a.Flags)
		case mounter.ActionMount:
			kinds = append(kinds, a.FSType+" "+strings.TrimPrefix(a.Target, root))
		case mounter.ActionBindMount:
			must.False(t, slices.Contains([]string{"/dev", "/sys", "/proc"}, a.Source), must.Sprintf("host's %s bound into an isolated task", a.Source))
		}
	}
	for _, want := range []string{"tmpfs /dev", "devpts /dev/pts", "proc /proc", "sysfs /sys"} {
		must.SliceContains(t, kinds, want)
	}
}

// A read-only image root writes nothing to disk: its writable layer is a
// small tmpfs in the task's namespace.
func TestBuildImageRoot_ReadOnly_Fake(t *testing.T) {
	root, img := fakeImageRoot(t)
	img.ReadOnly = true
	f := mounter.NewFake()
	must.NoError(t, buildImageRoot(f, root, img, &wire.Isolation{}))
	scratch := filepath.Join(filepath.Dir(root), imageScratchDir)
	acts := f.GetActions()
	must.Eq(t, mounter.ActionMount, acts[0].Kind)
	must.Eq(t, "tmpfs", acts[0].FSType)
	must.Eq(t, scratch, acts[0].Target)
	must.Eq(t, mounter.ActionMountOverlay, acts[1].Kind)
	must.Eq(t, filepath.Join(scratch, "upper")+":"+filepath.Join(scratch, "work"), acts[1].Data)
}

// An image whose /dev (or /proc, /sys) is a symlink is refused: the task's
// /dev would be mounted wherever it leads.
func TestBuildImageRoot_SymlinkedDev_Fake(t *testing.T) {
	root, img := fakeImageRoot(t)
	must.NoError(t, os.Symlink("/", filepath.Join(root, "dev")))
	err := buildImageRoot(mounter.NewFake(), root, img, &wire.Isolation{})
	must.ErrorContains(t, err, "the image's /dev cannot be the task's")
}

// The targets of an image task's mounts follow the image's own symlinks
// inside the root, but not inside another mount of the task (Nomad's
// /alloc, which other tasks can write).
func TestImageTargets_Fake(t *testing.T) {
	root, _ := fakeImageRoot(t)
	must.NoError(t, os.MkdirAll(filepath.Join(root, "run"), 0o755))
	must.NoError(t, os.MkdirAll(filepath.Join(root, "var"), 0o755))
	must.NoError(t, os.Symlink("/run", filepath.Join(root, "var/run")))
	must.NoError(t, os.MkdirAll(filepath.Join(root, "alloc"), 0o755))
	must.NoError(t, os.Symlink("/etc", filepath.Join(root, "alloc/x")))
	spec := &wire.Spec{Mounts: []wire.Mount{{Target: "/alloc"}}, LateMounts: []wire.Mount{{Target: "/var/run/csi"}}}
	it := newImageTargets(mounter.New(), root, spec)
	f, err := it.OpenTarget(root, "/var/run/csi", true)
	must.NoError(t, err)
	must.Eq(t, filepath.Join(root, "run/csi"), f.Name())
	_ = f.Close()
	_, err = it.OpenTarget(root, "/alloc/x/y", true)
	must.ErrorIs(t, err, mounter.ErrSymlinkTarget)
	f, err = it.OpenTarget(root, "/lib/modules", true)
	must.NoError(t, err)
	must.Eq(t, filepath.Join(root, "usr/lib/modules"), f.Name())
	_ = f.Close()

	// An image's symlink never leads a mount into another of the task's
	// mounts or its /proc: refused, whatever the image points it at.
	must.NoError(t, os.MkdirAll(filepath.Join(root, "proc/sys/kernel"), 0o755))
	must.NoError(t, os.MkdirAll(filepath.Join(root, "etc"), 0o755))
	must.NoError(t, os.Symlink("/proc/sys/kernel/core_pattern", filepath.Join(root, "etc/resolv.conf")))
	must.NoError(t, os.Symlink("../alloc", filepath.Join(root, "etc/hosts")))
	_, err = it.OpenTarget(root, "/etc/resolv.conf", false)
	must.ErrorIs(t, err, mounter.ErrSymlinkTarget)
	must.ErrorContains(t, err, "inside the task's /proc")
	_, err = it.OpenTarget(root, "/etc/hosts", false)
	must.ErrorIs(t, err, mounter.ErrSymlinkTarget)
	must.ErrorContains(t, err, "inside the task's /alloc")
}
