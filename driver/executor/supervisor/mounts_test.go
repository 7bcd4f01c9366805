package supervisor

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

func TestSetupMounts_SlavesAllButBidirectional_Fake(t *testing.T) {
	dir, err := filepath.EvalSymlinks(t.TempDir())
	must.NoError(t, err)
	bidi := filepath.Join(dir, "bidi")
	priv := filepath.Join(dir, "priv")
	h2t := filepath.Join(dir, "h2t")
	for _, d := range []string{bidi, priv, h2t} {
		must.NoError(t, os.Mkdir(d, 0o755))
	}
	file := filepath.Join(dir, "file")
	must.NoError(t, os.WriteFile(file, nil, 0o644))

	f := mounter.NewFake(
		mounter.MountPoint{ID: 1, Path: "/", Shared: true, PeerGroup: 1},
		mounter.MountPoint{ID: 2, Path: "/proc"},
		mounter.MountPoint{ID: 3, Path: bidi, Shared: true, PeerGroup: 3},
		mounter.MountPoint{ID: 4, Path: bidi + "/sub", Shared: true, PeerGroup: 4},
		mounter.MountPoint{ID: 5, Path: priv, Shared: true, PeerGroup: 5},
	)
	mounts := []wire.Mount{
		{Source: priv, Target: "/task/priv", ReadOnly: true},
		{Source: h2t, Target: "/task/h2t", Propagation: wire.PropagationHostToTask},
		{Source: bidi, Target: "/task/bidi", Propagation: wire.PropagationBidirectional},
		{Source: file, Target: "/task/file"},
		{Source: bidi, Target: bidi, Propagation: wire.PropagationBidirectional, ReadOnly: true},
	}
	must.NoError(t, setupMounts(f, mounts, ""))

	var got []string
	for _, a := range f.GetActions() {
		switch a.Kind {
		case mounter.ActionSetPropagation:
			got = append(got, a.Kind+" "+a.Target+" "+a.Mode+" "+boolWord(a.Recursive, "rec"))
		case mounter.ActionBindMount:
			got = append(got, a.Kind+" "+a.Source+" "+a.Target+" "+boolWord(a.ReadOnly, "ro"))
		case mounter.ActionEnsureTarget:
			got = append(got, a.Kind+" "+a.Target+" "+boolWord(a.IsDir, "dir"))
		case mounter.ActionRemountReadOnly:
			got = append(got, a.Kind+" "+a.Target)
		}
	}
	want := []string{
		// Step 1: shared mounts outside the bidirectional source become
		// slaves, one by one (deepest first); /proc is private already.
		"propagation " + priv + " slave -",
		"propagation / slave -",
		// Step 2, parents first.
		"ensure-target /task/priv dir",
		"bind " + priv + " /task/priv ro",
		"propagation /task/priv private rec",
		"ensure-target /task/h2t dir",
		"bind " + h2t + " /task/h2t -",
		"propagation /task/h2t slave rec",
		"ensure-target /task/bidi dir",
		"bind " + bidi + " /task/bidi -",
		"ensure-target /task/file -",
		"bind " + file + " /task/file -",
		"propagation /task/file private rec",
		// A target equal to its source (and a mount point already) only
		// gets its read-only flag.
		"remount-ro " + bidi,
	}
	must.Eq(t, want, got)

	// The bidirectional bind joined the source's peer group.
	table, err := f.List()
	must.NoError(t, err)
	mp, ok := mounter.FindMount(table, "/task/bidi")
	must.True(t, ok)
	must.True(t, mp.Shared)
	must.Eq(t, 3, mp.PeerGroup)
}

func TestSetupMounts_ErrorStops_Fake(t *testing.T) {
	dir := t.TempDir()
	f := mounter.NewFake(mounter.MountPoint{ID: 1, Path: "/"})
	f.MountErrs = map[string]error{"/task/a": unix.EPERM}
	err := setupMounts(f, []wire.Mount{{Source: dir, Target: "/task/a"}, {Source: dir, Target: "/task/b/c"}}, "")
	must.ErrorIs(t, err, unix.EPERM)
	must.StrContains(t, err.Error(), dir)
	for _, a := range f.GetActions() {
		must.NotEq(t, "/task/b/c", a.Target)
	}
}

func boolWord(b bool, word string) string {
	if b {
		return word
	}
	return "-"
}

// setupMounts is what launchTask does for a task without late mounts.
func setupMounts(m mounter.Interface, mounts []wire.Mount, root string) error {
	if err := prepareNamespace(m, mounts, root, nil, nil); err != nil {
		return err
	}
	if err := bindAll(m, mounts, root); err != nil {
		return err
	}
	if root != "" {
		return enterRoot(m, root)
	}
	return nil
}

// A host mount unmounted between the read of the mount table and its turn
// to become a slave (EINVAL: no mount point any more) is passed over, as a
// deleted one is (ENOENT); any other error stops. (Only a task with a
// bidirectional mount makes the mounts slaves one at a time.)
func TestPrepareNamespace_HostMountGoneMeanwhile_Fake(t *testing.T) {
	bidi := t.TempDir()
	f := mounter.NewFake(
		mounter.MountPoint{ID: 1, Path: "/", Shared: true, PeerGroup: 1},
		mounter.MountPoint{ID: 2, Path: "/gone", Shared: true, PeerGroup: 2},
		mounter.MountPoint{ID: 3, Path: "/deleted", Shared: true, PeerGroup: 3},
	)
	mounts := []wire.Mount{{Source: bidi, Target: "/b", Propagation: wire.PropagationBidirectional}}
	f.PropagationErrs = map[string]error{"/gone": unix.EINVAL, "/deleted": unix.ENOENT}
	must.NoError(t, prepareNamespace(f, mounts, "", nil, nil))
	var slaved []string
	for _, a := range f.GetActions() {
		if a.Kind == mounter.ActionSetPropagation {
			slaved = append(slaved, a.Target)
		}
	}
	must.SliceContains(t, slaved, "/")

	f.PropagationErrs = map[string]error{"/gone": unix.EPERM}
	must.ErrorIs(t, prepareNamespace(f, mounts, "", nil, nil), unix.EPERM)
}

// Without a bidirectional mount, every shared mount becomes a slave in one
// call, however many the host has: the mounts of the CSI volumes already
// published on the node are shared, and one mount(2) for each made every
// start slower the more tasks ran. Private and unbindable mounts stay so.
func TestPrepareNamespace_OneCallWithoutBidirectional_Fake(t *testing.T) {
	for _, n := range []int{1, 10, 500} {
		table := []mounter.MountPoint{
			{ID: 1, Path: "/", Shared: true, PeerGroup: 1},
			{ID: 2, Path: "/proc"},
			{ID: 3, Path: "/private"},
			{ID: 4, Path: "/unbindable", Unbindable: true},
		}
		for i := range n {
			table = append(table,
				mounter.MountPoint{ID: 10 + 2*i, Path: fmt.Sprintf("/csi/mnt/staging/v%d", i), Shared: true, PeerGroup: 10 + 2*i},
				mounter.MountPoint{ID: 11 + 2*i, Path: fmt.Sprintf("/csi/mnt/publish/t%d/data", i), Shared: true, PeerGroup: 11 + 2*i})
		}
		f := mounter.NewFake(table...)
		must.NoError(t, prepareNamespace(f, []wire.Mount{{Source: "/csi/mnt/publish/t0/data", Target: "/data"}}, "", nil, nil))
		var calls []string
		for _, a := range f.GetActions() {
			calls = append(calls, a.Kind+" "+a.Target+" "+a.Mode+" "+boolWord(a.Recursive, "rec"))
		}
		must.Eq(t, []string{"propagation / slave rec"}, calls, must.Sprintf("with %d volumes published", n))
		after, err := f.List()
		must.NoError(t, err)
		for _, mp := range after {
			must.False(t, mp.Shared, must.Sprintf("%s is still shared", mp.Path))
			if mp.Path == "/unbindable" {
				must.True(t, mp.Unbindable)
			}
		}
	}
}

// removeAfterTmpfs is a mounter whose build of a root at root is cut, as a
// driver's rmdir(2) of a spare's directory cuts it, just after the root's
// tmpfs is mounted: the directory is removed from the host's side.
type removeAfterTmpfs struct {
	mounter.Interface
	root   string
	remove func() error
	err    error
}

func (m *removeAfterTmpfs) SetPropagation(target, mode string, recursive bool) error {
	err := m.Interface.SetPropagation(target, mode, recursive)
	if err == nil && target == m.root && mode == mounter.PropagationUnbindable {
		m.err = m.remove()
	}
	return err
}

// A spare's root directory removed on the host while the spare builds its
// root there leaves nothing on the host, whether it goes before the build
// or once the tmpfs is mounted (which the removal detaches from the
// spare's namespace too): the build never makes the directory again, so
// nothing it makes afterwards can land in the host's directory. The build
// fails instead, and its namespace ends with its thread, as a killed
// spare's does.
func TestBuildRoot_DirRemovedMeanwhile_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("test needs root: it builds a task's root in a mount namespace")
	}
	for _, after := range []bool{false, true} {
		name := "before the build"
		if after {
			name = "once the tmpfs is mounted"
		}
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			root := filepath.Join(dir, "spare-1")
			must.NoError(t, os.Mkdir(root, 0o700))
			// From a thread of the host's mount namespace: never the
			// build's own, which is in a namespace of its own.
			removeOnHost := func() error {
				done := make(chan error, 1)
				go func() { done <- unix.Rmdir(root) }()
				return <-done
			}
			if !after {
				must.NoError(t, removeOnHost())
			}
			m := &removeAfterTmpfs{Interface: mounter.New(), root: root, remove: removeOnHost}
			if !after {
				m.remove = func() error { return nil }
			}
			built := make(chan error, 1)
			go func() {
				// Never unlocked: the thread, and the namespace with every
				// mount the build made, end with this goroutine.
				runtime.LockOSThread()
				if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
					built <- err
					return
				}
				if err := prepareNamespace(m, nil, "", nil, nil); err != nil {
					built <- err
					return
				}
				built <- buildRoot(m, root)
			}()
			err := <-built
			must.NoError(t, m.err)
			var left []string
			must.NoError(t, filepath.WalkDir(dir, func(path string, _ os.DirEntry, err error) error {
				if path != dir {
					left = append(left, strings.TrimPrefix(path, dir+"/"))
				}
				return err
			}))
			must.SliceEmpty(t, left, must.Sprintf("the build left %q on the host", left))
			must.ErrorIs(t, err, unix.ENOENT)
		})
	}
}
