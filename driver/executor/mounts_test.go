package executor

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// sharedSelfBind bind-mounts dir onto itself and makes it shared, as the
// driver does for bidirectional sources. Cleanup unmounts it (and anything
// left on it).
func sharedSelfBind(t *testing.T, dir string) {
	t.Helper()
	m := mounter.New()
	t.Cleanup(func() { detachAll(dir) })
	must.NoError(t, m.BindMount(dir, dir, false, false))
	must.NoError(t, m.SetPropagation(dir, mounter.PropagationShared, false))
}

// detachAll lazily unmounts everything at or below dir in this namespace.
func detachAll(dir string) {
	table, err := mounter.New().List()
	if err != nil {
		return
	}
	for i := len(table) - 1; i >= 0; i-- {
		if mounter.PathWithin(table[i].Path, dir) {
			_ = unix.Unmount(table[i].Path, unix.MNT_DETACH)
		}
	}
}

func isMountPoint(t *testing.T, path string) bool {
	t.Helper()
	ok, err := mounter.New().IsMountPoint(path)
	if err != nil {
		return false
	}
	return ok
}

// propagationFixture makes a base directory that is itself a shared mount
// (as "/" is on a systemd host, so that step 1 of setupMounts matters), a
// shared source inside it, and a target path inside it.
func propagationFixture(t *testing.T) (base, source, target string) {
	t.Helper()
	base, err := filepath.EvalSymlinks(t.TempDir())
	must.NoError(t, err)
	sharedSelfBind(t, base)
	source = filepath.Join(base, "source")
	must.NoError(t, os.Mkdir(source, 0o755))
	must.NoError(t, os.Mkdir(filepath.Join(source, "sub"), 0o755))
	sharedSelfBind(t, source)
	target = filepath.Join(base, "target")
	return base, source, target
}

func TestMounts_Bidirectional_Root(t *testing.T) {
	requireTaskRoot(t)
	_, source, target := propagationFixture(t)

	tt := newTestSpec(t, "/bin/sh", "-c",
		`mount -t tmpfs task-tmpfs "$T/sub" && echo hello > "$T/sub/marker" && echo mounted && exec sleep 100`)
	tt.spec.Privileged = true
	tt.spec.Env = append(tt.spec.Env, "T="+target)
	tt.spec.Mounts = []Mount{{Source: source, Target: target, Propagation: PropagationBidirectional}}
	p := startTest(t, tt)

	waitFor(t, "the task to mount", func() bool { return readFile(t, tt.stdout) == "mounted\n" })
	// The task's mount reached the host through the shared source...
	must.True(t, isMountPoint(t, filepath.Join(source, "sub")))
	must.Eq(t, "hello\n", readFile(t, filepath.Join(source, "sub", "marker")))
	// ...but the task's bind of the source onto the target did not.
	must.False(t, isMountPoint(t, target))

	must.NoError(t, p.Kill())
	waitExit(t, p)
}

// A host mount already inside a bidirectional source when the task starts
// (a CSI staging or publish mount under the driver's mount root, when a
// plugin task starts) stays mounted on the host: detaching the host's root
// from the task's namespace, where the source's copy is still a shared
// peer of the host's, must not unmount it on the host too.
func TestMounts_BidirectionalKeepsHostMounts_Root(t *testing.T) {
	requireTaskRoot(t)
	_, source, target := propagationFixture(t)
	staged := filepath.Join(source, "sub")
	must.NoError(t, mounter.New().Mount("host-staging", staged, "tmpfs", 0, "size=1m"))
	must.NoError(t, os.WriteFile(filepath.Join(staged, "marker"), []byte("staged\n"), 0o644))

	tt := newTestSpec(t, "/bin/sh", "-c", `cat "$T/sub/marker"; echo started; exec sleep 100`)
	tt.spec.Privileged = true
	tt.spec.Env = append(tt.spec.Env, "T="+target)
	tt.spec.Mounts = []Mount{{Source: source, Target: target, Propagation: PropagationBidirectional}}
	p := startTest(t, tt)

	waitFor(t, "the task to start", func() bool { return strings.HasSuffix(readFile(t, tt.stdout), "started\n") })
	must.True(t, isMountPoint(t, staged), must.Sprint("the task's start unmounted a host mount inside the bidirectional source"))
	must.Eq(t, "staged\n", readFile(t, filepath.Join(staged, "marker")))
	must.Eq(t, "staged\nstarted\n", readFile(t, tt.stdout), must.Sprintf("the task does not see the host's mount; stderr: %s", readFile(t, tt.stderr)))

	must.NoError(t, p.Kill())
	waitExit(t, p)
}

func TestMounts_HostToTask_Root(t *testing.T) {
	requireTaskRoot(t)
	_, source, target := propagationFixture(t)

	tt := newTestSpec(t, "/bin/sh", "-c", `
while [ ! -e "$T/sub/host-marker" ]; do sleep 0.05; done
mkdir -p "$T/own" && mount -t tmpfs task-tmpfs "$T/own" && echo mounted
exec sleep 100`)
	tt.spec.Privileged = true // to be allowed to mount in the task
	tt.spec.Env = append(tt.spec.Env, "T="+target)
	tt.spec.Mounts = []Mount{{Source: source, Target: target, Propagation: PropagationHostToTask}}
	p := startTest(t, tt)

	// A host mount made after the start reaches the task.
	sub := filepath.Join(source, "sub")
	must.NoError(t, mounter.New().Mount("host-tmpfs", sub, "tmpfs", 0, "size=1m"))
	must.NoError(t, os.WriteFile(filepath.Join(sub, "host-marker"), nil, 0o644))
	waitFor(t, "the task to see the host mount and mount", func() bool {
		return readFile(t, tt.stdout) == "mounted\n"
	})
	// The task's own mount stays in the task.
	must.False(t, isMountPoint(t, filepath.Join(source, "own")))
	must.False(t, isMountPoint(t, filepath.Join(target, "own")))
	must.False(t, isMountPoint(t, target))

	must.NoError(t, p.Kill())
	waitExit(t, p)
}

func TestMounts_PrivateReadOnly_Root(t *testing.T) {
	requireTaskRoot(t)
	_, source, target := propagationFixture(t)
	must.NoError(t, os.WriteFile(filepath.Join(source, "f"), []byte("data\n"), 0o644))

	tt := newTestSpec(t, "/bin/sh", "-c", `cat "$T/f"; if touch "$T/new" 2>/dev/null; then echo writable; else echo readonly; fi; grep " $T " /proc/self/mountinfo`)
	tt.spec.Env = append(tt.spec.Env, "T="+target)
	tt.spec.Mounts = []Mount{{Source: source, Target: target, ReadOnly: true}}
	p := startTest(t, tt)
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))

	out := readFile(t, tt.stdout)
	lines := strings.SplitN(out, "\n", 3)
	must.Eq(t, "data", lines[0])
	must.Eq(t, "readonly", lines[1])
	mps, err := mounter.ParseMountInfo(strings.NewReader(lines[2]))
	must.NoError(t, err)
	must.Len(t, 1, mps)
	must.Eq(t, "private", mps[0].Propagation())
	must.False(t, isMountPoint(t, target))
}

// A task has a root of its own: the host's files and later host mounts are
// there, a missing top-level mount target is made on the task's root (not
// on the host's disk), and nothing can be written at the top level.
func TestMounts_TaskRoot_Root(t *testing.T) {
	requireTaskRoot(t)
	source := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(source, "f"), []byte("from-host\n"), 0o644))
	top := fmt.Sprintf("/ncsi-test-target-%d", os.Getpid())
	t.Cleanup(func() { _ = os.Remove(top) })
	// Later host mounts reach the task through a shared host mount (this
	// host's "/" may be private).
	base := t.TempDir()
	sharedSelfBind(t, base)
	later := filepath.Join(base, "later")
	must.NoError(t, os.Mkdir(later, 0o755))

	tt := newTestSpec(t, "/bin/sh", "-c", `
cat "$TOP/f"
cat /etc/hostname
if touch /top-level-file 2>/dev/null; then echo root-writable; else echo root-read-only; fi
while ! [ -e "$LATER/marker" ]; do sleep 0.05; done
grep -c ' later-mount ' /proc/self/mountinfo
cat "$LATER/marker"`)
	tt.spec.Env = append(tt.spec.Env, "TOP="+top, "LATER="+later)
	tt.spec.Mounts = []Mount{{Source: source, Target: top}}
	p := startTest(t, tt)

	must.NoError(t, mounter.New().Mount("later-mount", later, "tmpfs", 0, "size=1m"))
	t.Cleanup(func() { _ = mounter.New().Unmount(later) })
	must.NoError(t, os.WriteFile(filepath.Join(later, "marker"), []byte("later\n"), 0o644))

	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	host, err := os.ReadFile("/etc/hostname")
	must.NoError(t, err)
	// The marker is written after the mount, on the tmpfs alone: the task
	// waits for the file, which only the later mount holds.
	must.Eq(t, "from-host\n"+string(host)+"root-read-only\n1\nlater\n", readFile(t, tt.stdout))

	// The target never existed on the host.
	_, err = os.Stat(top)
	must.True(t, os.IsNotExist(err), must.Sprintf("%s exists on the host: %v", top, err))
	_, err = os.Stat("/top-level-file")
	must.True(t, os.IsNotExist(err))
}

// A late mount inside /tmp (a volume at /tmp/data) is the task's even when
// its /tmp is a tmpfs of its own (tmp_size): the tmpfs is mounted first,
// and the volume on it, never the tmpfs over the volume.
func TestMounts_LateMountInsideTmpfsTmp_Root(t *testing.T) {
	requireTaskRoot(t)
	vol := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(vol, "marker"), []byte("from-volume\n"), 0o644))
	tt := isolatedSpec(t, `cat /tmp/data/marker; echo written > /tmp/data/out; grep -c ' /tmp ' /proc/self/mountinfo`)
	tt.spec.Isolation.TmpSize = 1 << 20
	p, err := startWithLateMount(tt, vol, "/tmp/data")
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "from-volume\n1\n", readFile(t, tt.stdout))
	b, err := os.ReadFile(filepath.Join(vol, "out"))
	must.NoError(t, err, must.Sprint("the task wrote into its volume, not into its /tmp"))
	must.Eq(t, "written\n", string(b))
}

// Mounts of the spec itself (a host volume, Nomad's directories: trees
// taken before the root is entered) inside /tmp are on the task's tmpfs
// /tmp too, nested ones as well, with a late mount between them: /tmp/a
// (early), /tmp/a/b (late), /tmp/a/b/c (early). The root stays sealed
// while /tmp is writable.
func TestMounts_NestedMountsInsideTmpfsTmp_Root(t *testing.T) {
	requireTaskRoot(t)
	a, b, c := t.TempDir(), t.TempDir(), t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(a, "m"), []byte("a\n"), 0o644))
	must.NoError(t, os.MkdirAll(filepath.Join(a, "b"), 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(b, "m"), []byte("b\n"), 0o644))
	must.NoError(t, os.MkdirAll(filepath.Join(b, "c"), 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(c, "m"), []byte("c\n"), 0o644))
	tt := isolatedSpec(t, `cat /tmp/a/m /tmp/a/b/m /tmp/a/b/c/m
echo x > /tmp/own && echo tmp-writable
touch /top-level 2>/dev/null || echo root-sealed
grep -c ' /tmp ' /proc/self/mountinfo`)
	tt.spec.Isolation.TmpSize = 1 << 20
	tt.spec.Mounts = []Mount{
		{Source: c, Target: "/tmp/a/b/c", Propagation: PropagationPrivate},
		{Source: a, Target: "/tmp/a", Propagation: PropagationPrivate},
	}
	p, err := startWithLateMount(tt, b, "/tmp/a/b")
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "a\nb\nc\ntmp-writable\nroot-sealed\n1\n", readFile(t, tt.stdout))
	_, err = os.Stat(filepath.Join(a, "own"))
	must.True(t, os.IsNotExist(err), must.Sprint("the task's own /tmp file landed in a mount"))
}

// A mount exactly at /tmp is the task's /tmp: no tmpfs goes over or under
// it, with tmp_size set or not.
func TestMounts_MountAtTmp_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, size := range []int64{0, 1 << 20} {
		vol := t.TempDir()
		must.NoError(t, os.WriteFile(filepath.Join(vol, "marker"), []byte("from-volume\n"), 0o644))
		tt := isolatedSpec(t, `cat /tmp/marker; echo w > /tmp/out; grep -c ' /tmp ' /proc/self/mountinfo`)
		tt.spec.Isolation.TmpSize = size
		p, err := startWithLateMount(tt, vol, "/tmp")
		must.NoError(t, err)
		t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
		must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
		// One mount at /tmp: the volume, with no tmpfs under it.
		must.Eq(t, "from-volume\n1\n", readFile(t, tt.stdout), must.Sprintf("tmp_size=%d", size))
		b, err := os.ReadFile(filepath.Join(vol, "out"))
		must.NoError(t, err)
		must.Eq(t, "w\n", string(b))
	}
}

// An isolated task's host-to-task mount (attached as a tree, its
// propagation set on the tree before the attach) still receives a mount
// the host makes under its source after the start; a private one does not.
func TestMounts_IsolatedHostToTask_Root(t *testing.T) {
	requireTaskRoot(t)
	_, source, _ := propagationFixture(t)
	tt := isolatedSpec(t, `
while [ ! -e /feed/sub/host-marker ]; do sleep 0.05; done
echo feed=seen
if [ -e /still/sub/host-marker ]; then echo private=seen; else echo private=unseen; fi`)
	tt.spec.Mounts = []Mount{
		{Source: source, Target: "/feed", Propagation: PropagationHostToTask},
		{Source: source, Target: "/still", Propagation: PropagationPrivate},
	}
	p := startTest(t, tt)
	sub := filepath.Join(source, "sub")
	must.NoError(t, mounter.New().Mount("host-tmpfs", sub, "tmpfs", 0, "size=1m"))
	must.NoError(t, os.WriteFile(filepath.Join(sub, "host-marker"), nil, 0o644))
	got := exitLines(t, tt, p)
	must.Eq(t, "seen", got["feed"])
	must.Eq(t, "unseen", got["private"])
}

// An isolated task's host-to-task mount receives what the host mounts
// later below its source whatever kind of mount the source is: a shared
// mount with a shared submount (the propagation is set on every mount of
// the tree, not only its top), and a slave of the host's shared mount
// (the task's copy is a slave of the same master).
func TestMounts_IsolatedHostToTaskSourceKinds_Root(t *testing.T) {
	requireTaskRoot(t)
	base, source, _ := propagationFixture(t)
	m := mounter.New()
	// The source's submount, shared, with a directory for the host's
	// later mount.
	sub := filepath.Join(source, "sub")
	sharedSelfBind(t, sub)
	must.NoError(t, os.Mkdir(filepath.Join(sub, "deep"), 0o755))
	// A slave of a shared master.
	master, slave := filepath.Join(base, "master"), filepath.Join(base, "slave")
	must.NoError(t, os.MkdirAll(filepath.Join(master, "in"), 0o755))
	must.NoError(t, os.Mkdir(slave, 0o755))
	sharedSelfBind(t, master)
	t.Cleanup(func() { detachAll(slave) })
	must.NoError(t, m.BindMount(master, slave, false, false))
	must.NoError(t, m.SetPropagation(slave, mounter.PropagationSlave, false))

	tt := isolatedSpec(t, `
while [ ! -e /feed/sub/deep/host-marker ] || [ ! -e /slave/in/host-marker ]; do sleep 0.05; done
echo feed=seen
echo slave=seen`)
	tt.spec.Mounts = []Mount{
		{Source: source, Target: "/feed", Propagation: PropagationHostToTask},
		{Source: slave, Target: "/slave", Propagation: PropagationHostToTask},
	}
	p := startTest(t, tt)
	for _, dir := range []string{filepath.Join(sub, "deep"), filepath.Join(master, "in")} {
		must.NoError(t, m.Mount("host-tmpfs", dir, "tmpfs", 0, "size=1m"))
		must.NoError(t, os.WriteFile(filepath.Join(dir, "host-marker"), nil, 0o644))
	}
	got := exitLines(t, tt, p)
	must.Eq(t, "seen", got["feed"])
	must.Eq(t, "seen", got["slave"])
}

// A privileged task's late volume inside its bidirectional mount keeps the
// propagation it asked for in the task: attached in a shared mount it
// would otherwise become shared too, a peer of the copy the attach leaves
// on the host, so that a mount the task makes inside a private volume
// would reach the host. The driver refuses such a destination before it
// comes here (insideBidirectional: the attach's copy on the host would
// outlive the task); the executor keeps the propagation all the same.
func TestMounts_LateVolumeInsideBidirectional_Root(t *testing.T) {
	requireTaskRoot(t)
	_, source, target := propagationFixture(t)
	priv, feed := t.TempDir(), t.TempDir()
	tt := newTestSpec(t, "/bin/sh", "-c", `grep -E " $T/(priv|feed) " /proc/self/mountinfo`)
	tt.spec.Privileged = true
	tt.spec.Env = append(tt.spec.Env, "T="+target)
	tt.spec.Mounts = []Mount{{Source: source, Target: target, Propagation: PropagationBidirectional}}
	tt.spec.LateMounts = []Mount{{Target: target + "/priv"}, {Target: target + "/feed"}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{
			{Source: priv, Target: target + "/priv", Propagation: PropagationPrivate},
			{Source: feed, Target: target + "/feed", Propagation: PropagationHostToTask},
		}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	out := readFile(t, tt.stdout)
	t.Log(out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	must.SliceLen(t, 2, lines)
	for _, line := range lines {
		must.StrNotContains(t, line, " shared:", must.Sprintf("a late volume in the task became shared: %s", line))
	}
}
