package csihook

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// fixturePlugin runs e2e/csiplugin as a child process.
type fixturePlugin struct {
	t     *testing.T
	bin   string
	sock  string
	state string
	mu    sync.Mutex
	cmd   *exec.Cmd
	out   *syncBuffer
}

func (f *fixturePlugin) start() {
	f.t.Helper()
	os.Remove(f.sock)
	cmd := exec.Command(f.bin, "--endpoint", "unix://"+f.sock, "--state-dir", f.state, "--node-id", "n1", "--controller-publish")
	cmd.Stdout, cmd.Stderr = f.out, f.out
	must.NoError(f.t, cmd.Start())
	f.mu.Lock()
	f.cmd = cmd
	f.mu.Unlock()
	must.Wait(f.t, waitFor(func() bool {
		_, err := os.Stat(f.sock)
		return err == nil
	}))
}

// stop ends the plugin: with SIGKILL to emulate a crash, else SIGTERM.
func (f *fixturePlugin) stop(crash bool) {
	f.mu.Lock()
	cmd := f.cmd
	f.cmd = nil
	f.mu.Unlock()
	if cmd == nil {
		return
	}
	sig := syscall.SIGTERM
	if crash {
		sig = syscall.SIGKILL
	}
	_ = cmd.Process.Signal(sig)
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

func mountTable(t *testing.T) map[string]mounter.MountPoint {
	t.Helper()
	mps, err := mounter.New().List()
	must.NoError(t, err)
	out := map[string]mounter.MountPoint{}
	for _, mp := range mps {
		out[mp.Path] = mp
	}
	return out
}

// loopsBackedBy lists loop devices whose backing file is under dir.
func loopsBackedBy(t *testing.T, dir string) []string {
	out, err := exec.Command("losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE").Output()
	if err != nil {
		t.Logf("losetup --list: %v", err)
		return nil
	}
	var devs []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && strings.HasPrefix(f[1], dir+"/") {
			devs = append(devs, f[0])
		}
	}
	return devs
}

// cleanupHost unmounts whatever is left under dirs (deepest first) and
// detaches loop devices backed by files under state.
func cleanupHost(t *testing.T, state string, dirs ...string) {
	mps, err := mounter.New().List()
	if err == nil {
		sort.Slice(mps, func(i, j int) bool { return len(mps[i].Path) > len(mps[j].Path) })
		for _, mp := range mps {
			for _, dir := range dirs {
				if mounter.PathWithin(mp.Path, dir) {
					t.Logf("cleanup: unmounting leftover %s", mp.Path)
					_ = unix.Unmount(mp.Path, unix.MNT_DETACH)
				}
			}
		}
	}
	for _, dev := range loopsBackedBy(t, state) {
		t.Logf("cleanup: detaching leftover %s", dev)
		_ = exec.Command("losetup", "-d", dev).Run()
	}
}

// TestIntegration_FixturePlugin runs Setup and Teardown against the real
// fixture plugin (e2e/csiplugin) doing bind mounts, loop devices and ext4.
// It needs root.
func TestIntegration_FixturePlugin(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts, loop devices and mkfs.ext4")
	}
	src, err := filepath.Abs(filepath.Join("..", "e2e", "csiplugin"))
	must.NoError(t, err)
	if _, err := os.Stat(filepath.Join(src, "main.go")); err != nil {
		t.Skip("the fixture plugin e2e/csiplugin is not in the tree")
	}
	for _, tool := range []string{"mkfs.ext4", "losetup"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s", tool)
		}
	}

	base, err := os.MkdirTemp("", "csih")
	must.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(base) })
	root, state := filepath.Join(base, "root"), filepath.Join(base, "state")
	t.Cleanup(func() { cleanupHost(t, state, root, state) })

	bin := filepath.Join(base, "csi-fixture")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the fixture plugin: %v\n%s", err, out)
	}
	fx := &fixturePlugin{t: t, bin: bin, sock: filepath.Join(base, "csi.sock"), state: state, out: &syncBuffer{}}
	fx.start()
	t.Cleanup(func() {
		fx.stop(false)
		if t.Failed() {
			t.Logf("plugin output:\n%s", fx.out.String())
		}
	})

	logs := &syncBuffer{}
	var evMu sync.Mutex
	var events []string
	cfg := Config{
		Root: root,
		Lookup: func(id string) (PluginInfo, error) {
			if id != "fixture" {
				return PluginInfo{}, errors.New("unknown")
			}
			return PluginInfo{ID: id, Socket: fx.sock, NodeID: "n1", Healthy: true, StageUnstage: true,
				ControllerPublish: true, CreateDelete: true, Block: true}, nil
		},
		Dial:                DialUnix,
		Mounter:             mounter.New(),
		Logger:              hclog.New(&hclog.LoggerOptions{Level: hclog.Trace, Output: logs}),
		Events:              func(_, msg string, _ map[string]string) { evMu.Lock(); events = append(events, msg); evMu.Unlock() },
		RPCTimeout:          20 * time.Second,
		RetryAttempts:       2,
		RetryBase:           50 * time.Millisecond,
		RetryMax:            200 * time.Millisecond,
		BackgroundRetryBase: 50 * time.Millisecond,
		BackgroundRetryMax:  300 * time.Millisecond,
	}
	m, err := New(cfg)
	must.NoError(t, err)
	t.Cleanup(func() { m.Close() })
	ctx := context.Background()

	vol := func(name, typ, attach string) VolumeRequest {
		r := VolumeRequest{Name: name, PluginID: "fixture", VolumeID: "it-" + name, Destination: "/" + name,
			AccessMode: AccessSingleNodeWriter, AttachmentMode: attach,
			Secrets: map[string]string{"token": canary}, Create: &CreateRequest{Parameters: map[string]string{"type": typ}}}
		return r
	}
	reqs := []VolumeRequest{
		vol("dir", "dir", AttachmentFileSystem),
		vol("ext", "ext4", AttachmentFileSystem),
		vol("blk", "ext4", AttachmentBlockDevice),
	}
	reqs[1].FSType = "ext4"

	start := time.Now()
	pubs, err := m.Setup(ctx, "task-1", reqs)
	must.NoError(t, err)
	t.Logf("Setup of dir + ext4 + block volumes (create, attach, stage, publish): %s", time.Since(start))
	must.Len(t, 3, pubs)

	mt := mountTable(t)
	var staged []string
	for _, p := range pubs {
		_, ok := mt[p.HostPath]
		must.True(t, ok, must.Sprintf("%s not mounted at %s", p.Name, p.HostPath))
	}
	m.mu.Lock()
	for _, v := range m.vols {
		if v.AttachmentMode == AttachmentFileSystem {
			staged = append(staged, v.StagingPath)
		}
	}
	m.mu.Unlock()
	must.Len(t, 2, staged)
	for _, s := range staged {
		_, ok := mt[s]
		must.True(t, ok, must.Sprintf("staging %s not mounted", s))
	}
	must.Eq(t, "ext4", mt[pubs[1].HostPath].FSType)
	fi, err := os.Stat(pubs[2].HostPath)
	must.NoError(t, err)
	must.True(t, fi.Mode()&os.ModeDevice != 0, must.Sprint("block target is a device node"))
	must.True(t, pubs[2].Block)
	must.NoError(t, os.WriteFile(filepath.Join(pubs[1].HostPath, "keep"), []byte("data"), 0o644))
	must.NoError(t, os.WriteFile(filepath.Join(pubs[0].HostPath, "keep"), []byte("dir data"), 0o644))

	start = time.Now()
	must.NoError(t, m.Teardown(ctx, "task-1"))
	t.Logf("Teardown of the three volumes: %s", time.Since(start))
	assertGone(t, append(staged, pubs[0].HostPath, pubs[1].HostPath, pubs[2].HostPath)...)
	must.SliceEmpty(t, loopsBackedBy(t, state))
	must.SliceEmpty(t, journalEntries(t, root))

	t.Run("data survives and one dir volume shares staging", func(t *testing.T) {
		r := vol("ext", "ext4", AttachmentFileSystem)
		r.FSType, r.AccessMode = "ext4", AccessMultiNodeMultiWriter
		a, err := m.Setup(ctx, "task-2", []VolumeRequest{r})
		must.NoError(t, err)
		b, err := m.Setup(ctx, "task-3", []VolumeRequest{r})
		must.NoError(t, err)
		data, err := os.ReadFile(filepath.Join(b[0].HostPath, "keep"))
		must.NoError(t, err)
		must.Eq(t, "data", string(data))
		must.Eq(t, 2, m.Users("fixture", m.taskRecs("task-2")[0].VolumeID))
		must.NoError(t, m.Teardown(ctx, "task-2"))
		assertGone(t, a[0].HostPath)
		_, err = os.ReadFile(filepath.Join(b[0].HostPath, "keep"))
		must.NoError(t, err)
		must.NoError(t, m.Teardown(ctx, "task-3"))
		assertGone(t, b[0].HostPath)
		must.SliceEmpty(t, loopsBackedBy(t, state))
	})

	t.Run("driver restart tears down orphans", func(t *testing.T) {
		pubs, err := m.Setup(ctx, "task-4", []VolumeRequest{vol("dir", "dir", AttachmentFileSystem)})
		must.NoError(t, err)
		m.Close()
		m, err = New(cfg)
		must.NoError(t, err)
		must.NoError(t, m.Recover(func(string) bool { return false }))
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		must.NoError(t, m.WaitIdle(wctx))
		assertGone(t, pubs[0].HostPath)
		must.SliceEmpty(t, journalEntries(t, root))
	})

	t.Run("plugin crash during teardown is retried until it is back", func(t *testing.T) {
		r := vol("ext", "ext4", AttachmentFileSystem)
		r.FSType = "ext4"
		pubs, err := m.Setup(ctx, "task-5", []VolumeRequest{r})
		must.NoError(t, err)
		fx.stop(true)
		err = m.Teardown(ctx, "task-5")
		must.ErrorContains(t, err, "retrying in the background")
		must.Eq(t, 2, len(journalEntries(t, root)))
		_, stillMounted := mountTable(t)[pubs[0].HostPath]
		must.True(t, stillMounted)
		fx.start()
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		must.NoError(t, m.WaitIdle(wctx))
		assertGone(t, pubs[0].HostPath)
		must.SliceEmpty(t, loopsBackedBy(t, state))
		must.SliceEmpty(t, journalEntries(t, root))
		evMu.Lock()
		must.True(t, containsEvent(events, "Unpublishing volume \"ext\" failed (Unavailable"), must.Sprint(events))
		evMu.Unlock()
	})

	t.Run("publish timing", func(t *testing.T) {
		r := vol("dir", "dir", AttachmentFileSystem)
		const n = 10
		var setup, teardown time.Duration
		for i := 0; i < n; i++ {
			s := time.Now()
			_, err := m.Setup(ctx, "task-timing", []VolumeRequest{r})
			must.NoError(t, err)
			setup += time.Since(s)
			s = time.Now()
			must.NoError(t, m.Teardown(ctx, "task-timing"))
			teardown += time.Since(s)
		}
		t.Logf("dir volume, mean of %d: Setup (attach+stage+publish, 4 synced journal batches) %s, Teardown %s", n, setup/n, teardown/n)
	})

	must.StrNotContains(t, logs.String(), canary)
	must.StrNotContains(t, fx.out.String(), canary)
	evMu.Lock()
	for _, e := range events {
		must.StrNotContains(t, e, canary)
	}
	evMu.Unlock()
}

func assertGone(t *testing.T, paths ...string) {
	t.Helper()
	mt := mountTable(t)
	for _, p := range paths {
		_, ok := mt[p]
		must.False(t, ok, must.Sprintf("%s still mounted", p))
		_, err := os.Stat(p)
		must.True(t, errors.Is(err, os.ErrNotExist), must.Sprintf("%s still exists (%v)", p, err))
	}
}

func journalEntries(t *testing.T, root string) []string {
	t.Helper()
	return journalRecords(t, filepath.Join(root, "journal"))
}
