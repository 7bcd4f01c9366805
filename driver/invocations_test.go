package driver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// invocationCase is a node with a plugin task and a workload holding a
// single-node-writer volume, whose driver process then goes away without
// tearing anything down, as a driver killed by the kernel does.
type invocationCase struct {
	root string
	// mnt is the host's mount table, which outlives the driver.
	mnt          *mounter.Fake
	plugin, work *drivers.TaskConfig
	pluginHandle *drivers.TaskHandle
	workHandle   *drivers.TaskHandle
	// plugins, when set, readies the next driver process's fake plugins
	// before it starts.
	plugins func(*fakePlugins)
}

func volumeWorkload(t *testing.T, alloc, id string) *drivers.TaskConfig {
	cfg := jobTask(t, TaskConfig{Command: "/bin/sleep", Volumes: map[string]VolumeConfig{"data": {
		PluginID: "hp", VolumeID: "v1", Destination: "/data", AccessMode: "single-node-writer", AttachmentMode: "file-system",
	}}}, alloc, "default", "web")
	cfg.ID = alloc + "/t/" + id
	return cfg
}

func startVolumeNode(t *testing.T) *invocationCase {
	t.Helper()
	c := &invocationCase{root: shortTempDir(t)}
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll, RootDir: c.root})
	c.mnt = d.mounter.(*mounter.Fake)
	fp := withFakePlugins(t, d)
	c.plugin = jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p", "default", "plugin")
	var err error
	c.pluginHandle, _, err = d.StartTask(c.plugin)
	must.NoError(t, err)
	waitHealthy(t, d, "hp")
	c.work = volumeWorkload(t, "alloc-w", "first")
	c.workHandle, _, err = d.StartTask(c.work)
	must.NoError(t, err)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))
	// The driver process goes; its tasks and the journal stay.
	d.Shutdown()
	return c
}

// restart starts a new driver process on the node's root_dir, its plugins
// answering from fakes, and takes the plugin task back as Nomad does.
func (c *invocationCase) restart(t *testing.T, before ...func(*Driver)) (*testDriver, *fakePlugins) {
	t.Helper()
	fp := &fakePlugins{fakes: map[string]*fingerprint.Fake{}, vols: csihook.NewFakeClient(c.mnt)}
	if c.plugins != nil {
		c.plugins(fp)
	}
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll, RootDir: c.root}, append(before, func(d *Driver) {
		d.mounter = c.mnt
		d.dialVolume = fp.vols.Dial
		d.prober = fingerprint.NewProber(fingerprint.Config{
			Interval: time.Hour, ScanInterval: time.Hour, Dial: fp.dial,
			StatSocket: func(string) error { return nil }, OnHealthChange: d.onPluginHealth,
		})
	})...)
	must.NoError(t, d.RecoverTask(persisted(t, c.pluginHandle)))
	waitHealthy(t, d, "hp")
	return d, fp
}

func (c *invocationCase) forgetHanded(t *testing.T) {
	t.Helper()
	conf := Config{RootDir: c.root}
	must.NoError(t, os.Remove(filepath.Join(conf.taskStateDir(c.work.ID), handedFile)))
}

func journalTasks(t *testing.T, d *testDriver) int {
	t.Helper()
	m, err := d.volumes()
	must.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	must.NoError(t, m.WaitIdle(ctx))
	return m.Users("hp", "v1")
}

// Nomad starts a task anew, under a new task ID, when the agent restarted
// and it held no handle for the last start. That start's volume must not
// stay held: a single-node-writer volume would refuse the new start for
// good.
func TestInvocations_newStartOfTheSameTaskEndsTheOneNomadForgot(t *testing.T) {
	for _, tc := range []struct {
		name string
		// handed: the earlier start returned its handle, but Nomad lost it
		// (an agent killed before it stored the handle).
		handed bool
	}{
		{"start cut short", false},
		{"handle lost by the agent", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startVolumeNode(t)
			if !tc.handed {
				c.forgetHanded(t)
			}
			d, fp := c.restart(t)
			again := volumeWorkload(t, "alloc-w", "second")
			_, _, err := d.StartTask(again)
			must.NoError(t, err)
			must.Eq(t, 1, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
			must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))
			_, err = os.Stat(d.currentConfig().taskStateDir(c.work.ID))
			must.True(t, os.IsNotExist(err), must.Sprint("the earlier start's state directory is left"))
			must.Eq(t, 1, journalTasks(t, d))

			must.NoError(t, d.DestroyTask(again.ID, true))
			must.Eq(t, 0, journalTasks(t, d))
		})
	}
}

// Another driver process (Nomad's plugin loader runs one briefly when the
// agent starts) ended the earlier start and removed its state directory,
// but could not tear its volume down; this process's first attempt failed
// too and waits for its retry. The new start of the same task releases the
// volume itself instead of failing on its own single-node-writer volume.
func TestInvocations_newStartReleasesVolumesOfAnEndedEarlierStart(t *testing.T) {
	c := startVolumeNode(t)
	conf := Config{RootDir: c.root}
	must.NoError(t, os.RemoveAll(conf.taskStateDir(c.work.ID)))
	c.plugins = func(fp *fakePlugins) {
		fp.vols.SetNextError(csihook.MethodNodeUnpublishVolume, status.Error(codes.Internal, "plugin busy"))
	}
	d, fp := c.restart(t)
	// The driver's own attempt failed; its retry is seconds away.
	must.Wait(t, wait.InitialSuccess(
		wait.BoolFunc(func() bool { return fp.vols.Count(csihook.MethodNodeUnpublishVolume) == 1 }),
		wait.Timeout(20*time.Second), wait.Gap(10*time.Millisecond)))
	m, err := d.volumes()
	must.NoError(t, err)
	must.Eq(t, []string{c.work.ID}, m.Tasks())

	again := volumeWorkload(t, "alloc-w", "second")
	_, _, err = d.StartTask(again)
	must.NoError(t, err)
	must.Eq(t, 2, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))
	must.Eq(t, []string{again.ID}, m.Tasks())

	must.NoError(t, d.DestroyTask(again.ID, true))
	must.Eq(t, 0, journalTasks(t, d))
}

// A start Nomad never got a handle for is ended by the next driver process
// even when Nomad never starts that task again (its allocation was
// stopped meanwhile).
func TestInvocations_startCutShortIsEndedAtDriverStart(t *testing.T) {
	c := startVolumeNode(t)
	c.forgetHanded(t)
	d, fp := c.restart(t)
	must.Wait(t, wait.InitialSuccess(
		wait.BoolFunc(func() bool { return fp.vols.Count(csihook.MethodNodeUnpublishVolume) == 1 }),
		wait.Timeout(20*time.Second), wait.Gap(10*time.Millisecond)))
	must.Eq(t, 0, journalTasks(t, d))
	_, err := os.Stat(d.currentConfig().taskStateDir(c.work.ID))
	must.True(t, os.IsNotExist(err))
}

// Nomad retries a start with the same task ID when the driver died during
// it: the earlier attempt's process and volume go first, then the task
// starts once. The driver may have died before or after it recorded the
// hand-over; only in the first case can its start-up sweep get there first.
func TestInvocations_sameIDRetryStartsOnce(t *testing.T) {
	for _, tc := range []struct {
		name   string
		handed bool
	}{
		{"before the hand-over", false},
		{"after the hand-over", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startVolumeNode(t)
			if !tc.handed {
				c.forgetHanded(t)
			}
			var (
				mu        sync.Mutex
				discarded []string
				started   bool
			)
			d, fp := c.restart(t, func(d *Driver) {
				d.discard = func(l hclog.Logger, stateDir string) error {
					mu.Lock()
					defer mu.Unlock()
					// The earlier attempt is ended before this one starts
					// anything.
					must.False(t, started)
					discarded = append(discarded, stateDir)
					return executor.Discard(l, stateDir)
				}
			})
			dir := d.currentConfig().taskStateDir(c.work.ID)
			start := d.start
			d.start = func(l hclog.Logger, s *executor.Spec, late func() ([]executor.Mount, error)) (taskProcess, error) {
				mu.Lock()
				started = true
				mu.Unlock()
				return start(l, s, late)
			}
			_, _, err := d.StartTask(c.work)
			must.NoError(t, err)
			mu.Lock()
			must.Eq(t, []string{dir}, discarded)
			mu.Unlock()
			// The new start holds the volume once, published: it took
			// over the earlier attempt's records of the same task ID (or
			// set them up anew after recovery dropped them).
			must.Eq(t, 1, journalTasks(t, d))
			m, err := d.volumes()
			must.NoError(t, err)
			mounted, err := c.mnt.IsMountPoint(m.TargetPath(c.work.ID, "data"))
			must.NoError(t, err)
			must.True(t, mounted)
			// Published at most once more: after recovery unpublished it
			// (1, 1), taken over as it was (0, 0), or published again
			// over a record recovery had marked unpublishing but could
			// not act on yet, the plugin not being back (1, 0; publishing
			// is idempotent).
			pub, unpub := fp.vols.Count(csihook.MethodNodePublishVolume), fp.vols.Count(csihook.MethodNodeUnpublishVolume)
			must.True(t, pub <= 1 && unpub <= pub, must.Sprintf("%d NodePublishVolume and %d NodeUnpublishVolume calls", pub, unpub))
			must.True(t, exists(filepath.Join(dir, handedFile)))
			must.NoError(t, d.DestroyTask(c.work.ID, true))
			must.Eq(t, 0, journalTasks(t, d))
		})
	}
}

// A task handed to Nomad keeps its volume across a driver restart until
// Nomad says what became of it: recovered, it keeps it.
func TestInvocations_handedTaskKeepsItsVolume(t *testing.T) {
	c := startVolumeNode(t)
	d, fp := c.restart(t)
	must.Eq(t, 1, journalTasks(t, d))
	must.NoError(t, d.RecoverTask(persisted(t, c.workHandle)))
	must.Eq(t, 1, journalTasks(t, d))
	must.Eq(t, 0, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	must.False(t, d.invocations.alive(c.work.ID), must.Sprint("a recovered task is still waited for"))
}

func TestInvocations_scanTaskDirs(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	conf := d.currentConfig()
	mk := func(id string, files ...string) string {
		dir := conf.taskStateDir(id)
		must.NoError(t, os.MkdirAll(dir, 0o700))
		for _, f := range files {
			var b []byte
			switch f {
			case invocationFile:
				b = []byte(`{"task_id":"` + id + `","alloc_id":"a","task_name":"t"}`)
			case "spec.json":
				b = []byte(`{"task_id":"` + id + `"}`)
			}
			must.NoError(t, os.WriteFile(filepath.Join(dir, f), b, 0o600))
		}
		return dir
	}
	mk("a/t/handed", invocationFile, "spec.json", handedFile)
	mk("a/t/cut", invocationFile, "spec.json")
	mk("a/t/legacy", "spec.json")
	mk("a/t/empty")
	// An invocation file in another task's directory is not believed.
	must.NoError(t, os.WriteFile(filepath.Join(mk("a/t/moved"), invocationFile), []byte(`{"task_id":"a/t/other"}`), 0o600))

	iv := newInvocations()
	orphans := iv.scanTaskDirs(d.logger, conf.tasksDir(), JournalDir(conf.RootDir))
	must.Eq(t, []string{"a/t/cut"}, orphans)
	must.True(t, iv.alive("a/t/handed"))
	must.True(t, iv.alive("a/t/legacy"))
	must.False(t, iv.alive("a/t/cut"))
	must.False(t, iv.alive("a/t/other"))
	// A new start of the task supersedes the handed one and the one cut
	// short, never the legacy one, whose allocation is unknown.
	must.Eq(t, []string{"a/t/cut", "a/t/handed"}, iv.superseded(&drivers.TaskConfig{ID: "a/t/new", AllocID: "a", Name: "t"}))
	must.False(t, iv.alive("a/t/handed"))
	must.True(t, iv.alive("a/t/legacy"))
}

// A start that fails lets go of everything it took, the task's event
// target among them, once its volumes are torn down.
func TestStartTask_failureKeepsNoEventTarget(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	fp := withFakePlugins(t, d)
	_, _, err := d.StartTask(jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true,
		CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p", "default", "plugin"))
	must.NoError(t, err)
	waitHealthy(t, d, "hp")
	start := d.start
	d.start = func(l hclog.Logger, s *executor.Spec, late func() ([]executor.Mount, error)) (taskProcess, error) {
		if late != nil {
			if _, err := late(); err != nil {
				return nil, err
			}
		}
		return nil, errors.New("exec failed")
	}
	for _, cfg := range []*drivers.TaskConfig{
		volumeWorkload(t, "alloc-v", "one"),
		jobTask(t, TaskConfig{Command: "/bin/sleep"}, "alloc-n", "default", "web"),
	} {
		_, _, err := d.StartTask(cfg)
		must.ErrorContains(t, err, "exec failed")
		_, kept := d.eventTargets.Load(cfg.ID)
		must.False(t, kept, must.Sprintf("task %s", cfg.ID))
	}
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	d.start = start
}

func TestSameTask(t *testing.T) {
	cfg := &drivers.TaskConfig{AllocID: "a1", Name: "web"}
	for _, tc := range []struct {
		id   string
		want bool
	}{
		{"a1/web/1234abcd", true},
		{"a1/web/", false},
		{"a1/web", false},
		{"a1/web/x/y", false},
		{"a1/webx/1234abcd", false},
		{"a2/web/1234abcd", false},
		{"a1/we/b/1234abcd", false},
	} {
		must.Eq(t, tc.want, sameTask(tc.id, cfg), must.Sprint(tc.id))
	}
	must.False(t, sameTask("/web/1234abcd", &drivers.TaskConfig{Name: "web"}), must.Sprint("a config without an alloc ID"))
	must.False(t, sameTask("a1//1234abcd", &drivers.TaskConfig{AllocID: "a1"}), must.Sprint("a config without a task name"))
}

// Nomad's plugin loader starts the driver once only to check its config
// (no agent config) and kills it right after: that call validates and
// touches nothing an earlier driver process left.
func TestSetConfig_loaderValidationTouchesNothing(t *testing.T) {
	c := startVolumeNode(t)
	c.forgetHanded(t)
	snapshot := func() []string {
		var out []string
		must.NoError(t, filepath.WalkDir(c.root, func(path string, e os.DirEntry, err error) error {
			if err != nil {
				return err
			}
			fi, err := e.Info()
			if err != nil {
				return err
			}
			out = append(out, fmt.Sprintf("%s %v %d %d", path, fi.Mode(), fi.Size(), fi.ModTime().UnixNano()))
			return nil
		}))
		return out
	}
	before := snapshot()

	d := NewPlugin(hclog.NewNullLogger())
	t.Cleanup(d.Shutdown)
	d.mounter = c.mnt
	d.spares = nil
	var buf []byte
	must.NoError(t, base.MsgPackEncode(&buf, &Config{Enabled: true, AllowPrivileged: true, RootDir: c.root, CgroupParent: DefaultCgroupParent}))
	must.NoError(t, d.SetConfig(&base.Config{PluginConfig: buf}))
	must.Nil(t, d.currentConfig())
	must.Eq(t, before, snapshot())

	// A bad config is still refused, naming the key.
	buf = nil
	must.NoError(t, base.MsgPackEncode(&buf, &Config{Enabled: true, RootDir: "relative/dir", CgroupParent: DefaultCgroupParent}))
	must.ErrorContains(t, d.SetConfig(&base.Config{PluginConfig: buf}), "root_dir")
}

// A plugin task whose process fails to start leaves its plugin id free:
// another task may serve it next.
func TestStartTask_failedPluginStartFreesItsID(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	withFakePlugins(t, d)
	plugin := func(alloc string) *drivers.TaskConfig {
		return jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true,
			CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, alloc, "default", alloc)
	}
	start := d.start
	d.start = func(hclog.Logger, *executor.Spec, func() ([]executor.Mount, error)) (taskProcess, error) {
		return nil, errors.New("exec failed")
	}
	_, _, err := d.StartTask(plugin("alloc-a"))
	must.ErrorContains(t, err, "exec failed")
	d.start = start
	_, _, err = d.StartTask(plugin("alloc-b"))
	must.NoError(t, err)
	must.NoError(t, d.DestroyTask("alloc-b/t/1", true))
}

// The handed mark is a name for the invocation file, made once: a second
// mark of the same start stands, and a directory without an invocation
// file (nothing was started from it) cannot be marked.
func TestMarkHanded(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "task")
	must.NoError(t, writeInvocation(dir, &drivers.TaskConfig{ID: "a/t/1", AllocID: "a", Name: "t"}, "", "", true))
	must.False(t, exists(filepath.Join(dir, handedFile)))
	must.NoError(t, markHanded(dir))
	must.True(t, exists(filepath.Join(dir, handedFile)))
	inv, err := os.Stat(filepath.Join(dir, invocationFile))
	must.NoError(t, err)
	mark, err := os.Stat(filepath.Join(dir, handedFile))
	must.NoError(t, err)
	must.True(t, os.SameFile(inv, mark), must.Sprint("the mark is not a link to the invocation file"))
	must.NoError(t, markHanded(dir))

	empty := t.TempDir()
	must.ErrorContains(t, markHanded(empty), "failed to record the task's start")
	must.False(t, exists(filepath.Join(empty, handedFile)))

	unmarkHanded(dir)
	must.False(t, exists(filepath.Join(dir, handedFile)))
	must.True(t, exists(filepath.Join(dir, invocationFile)))
}

// On a file system that makes no hard links (vfat, some FUSE file
// systems: link(2) answers EPERM) the mark is an empty file of its own.
func TestMarkHanded_NoHardLinks(t *testing.T) {
	old := linkFile
	t.Cleanup(func() { linkFile = old })
	linkFile = func(string, string) error { return &os.LinkError{Op: "link", Err: unix.EPERM} }
	dir := filepath.Join(t.TempDir(), "task")
	must.NoError(t, writeInvocation(dir, &drivers.TaskConfig{ID: "a/t/1", AllocID: "a", Name: "t"}, "", "", true))
	must.NoError(t, markHanded(dir))
	fi, err := os.Lstat(filepath.Join(dir, handedFile))
	must.NoError(t, err)
	must.True(t, fi.Mode().IsRegular())
	must.NoError(t, markHanded(dir))

	// Any other error of link(2) fails the start.
	linkFile = func(string, string) error { return &os.LinkError{Op: "link", Err: unix.EIO} }
	other := filepath.Join(t.TempDir(), "task")
	must.NoError(t, writeInvocation(other, &drivers.TaskConfig{ID: "a/t/2", AllocID: "a", Name: "t"}, "", "", true))
	must.ErrorContains(t, markHanded(other), "failed to record the task's start")
	must.False(t, exists(filepath.Join(other, handedFile)))
}

// A plugin task whose probe fails after the handed mark was written (here
// the driver shuts its prober down while the task starts) gets no handle
// from Nomad, and the start takes the mark back. Its undo here leaves the
// state directory behind, as an undo that fails to end the task does: the
// next driver process finds a start cut short and ends it, rather than
// waiting for Nomad to recover a task Nomad never heard of.
func TestStartTask_pluginProbeFailureTakesTheMarkBack(t *testing.T) {
	root := shortTempDir(t)
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll, RootDir: root})
	withFakePlugins(t, d)
	cfg := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true,
		CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p", "default", "plugin")
	dir := d.currentConfig().taskStateDir(cfg.ID)
	start := d.start
	d.start = func(l hclog.Logger, s *executor.Spec, late func() ([]executor.Mount, error)) (taskProcess, error) {
		p, err := start(l, s, late)
		if err == nil {
			d.currentProber().Close()
		}
		return p, err
	}
	// The mark is written before the probe is asked for: the case is a
	// start that failed after it, not before.
	var marked []string
	link := linkFile
	t.Cleanup(func() { linkFile = link })
	linkFile = func(from, to string) error {
		err := link(from, to)
		if err == nil {
			marked = append(marked, to)
		}
		return err
	}
	_, _, err := d.StartTask(cfg)
	must.ErrorContains(t, err, "the plugin prober is closed")
	must.ErrorContains(t, err, `csi_plugin "hp"`)
	must.Eq(t, []string{filepath.Join(dir, handedFile)}, marked)
	d.start = start

	// The undo left the task's state directory, its invocation file
	// naming the task, but not the mark.
	must.True(t, exists(filepath.Join(dir, invocationFile)), must.Sprint("the fake undo removed the state directory: the case tests nothing"))
	must.False(t, exists(filepath.Join(dir, handedFile)), must.Sprint("the handed mark of a start that failed is left"))
	d.Shutdown()

	var (
		mu        sync.Mutex
		discarded []string
	)
	next := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll, RootDir: root}, func(d *Driver) {
		d.discard = func(l hclog.Logger, stateDir string) error {
			mu.Lock()
			defer mu.Unlock()
			discarded = append(discarded, stateDir)
			return executor.Discard(l, stateDir)
		}
	})
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(discarded) > 0
	}), wait.Timeout(10*time.Second), wait.Gap(10*time.Millisecond)),
		must.Sprint("the next driver process left the failed start to Nomad"))
	mu.Lock()
	must.Eq(t, []string{dir}, discarded)
	mu.Unlock()
	// The sweep holds the task ID while it ends the start: it is let go
	// once the start is ended, and never waited for as Nomad's (alive is
	// held or waiting for Nomad).
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return !next.invocations.alive(cfg.ID) }),
		wait.Timeout(10*time.Second), wait.Gap(10*time.Millisecond)),
		must.Sprint("the next driver process waits for Nomad to recover the failed start"))
}

// resetSparesDir, at a driver's start, removes the empty directories that
// spares of an earlier driver process left, and nothing else: not a file,
// not a symlink (nor what it points to), not a directory with anything in
// it.
func TestResetSparesDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "spares")
	must.NoError(t, os.MkdirAll(filepath.Join(dir, "spare-1-a"), 0o700))
	must.NoError(t, os.MkdirAll(filepath.Join(dir, "spare-2-b", "bin"), 0o700))
	must.NoError(t, os.WriteFile(filepath.Join(dir, "stray"), []byte("x"), 0o600))
	target := t.TempDir()
	must.NoError(t, os.Symlink(target, filepath.Join(dir, "link")))
	must.NoError(t, resetSparesDir(dir))
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	var left []string
	for _, e := range entries {
		left = append(left, e.Name())
	}
	must.Eq(t, []string{"link", "spare-2-b", "stray"}, left)
	_, err = os.Stat(target)
	must.NoError(t, err)
}

// A start that fails after its process ran has its undo destroy the
// process; when that fails (a cgroup the kernel will not remove), the
// driver says so. Nomad sends no DestroyTask for a start that failed, so
// the log is where an operator learns what was left.
func TestStartTask_undoSaysWhatItCouldNotDestroy(t *testing.T) {
	var logs strings.Builder
	var logMu sync.Mutex
	logger := hclog.New(&hclog.LoggerOptions{Level: hclog.Warn, Output: writerFunc(func(b []byte) (int, error) {
		logMu.Lock()
		defer logMu.Unlock()
		return logs.Write(b)
	})})
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll},
		func(d *Driver) { d.logger = logger })
	withFakePlugins(t, d)
	var proc *fakeProcess
	start := d.start
	d.start = func(l hclog.Logger, s *executor.Spec, late func() ([]executor.Mount, error)) (taskProcess, error) {
		p, err := start(l, s, late)
		if err == nil {
			proc = p.(*fakeProcess)
			proc.destroyErr = errors.New("failed to remove cgroup: device or resource busy")
			// The start fails after its process ran: the plugin's
			// probe cannot be had.
			d.currentProber().Close()
		}
		return p, err
	}
	cfg := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true,
		CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p", "default", "plugin")
	_, _, err := d.StartTask(cfg)
	must.ErrorContains(t, err, "the plugin prober is closed")
	must.NotNil(t, proc)
	proc.mu.Lock()
	destroyed := proc.destroyed
	proc.mu.Unlock()
	must.Eq(t, 1, destroyed, must.Sprint("the undo did not destroy the process"))
	logMu.Lock()
	out := logs.String()
	logMu.Unlock()
	must.StrContains(t, out, "failed to clean up after a start that failed")
	must.StrContains(t, out, "device or resource busy")
	must.StrContains(t, out, cfg.ID)
}

// writerFunc is an io.Writer of a function.
type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

// A task with volumes does not sync its invocation file: the first record
// of its volumes' journal, synced before any call for them, names the task
// in its stead. These are the states a crash of the host can leave its
// state directory in (the driver process's death stands for the crash; its
// tasks are left as a crash leaves them, for the next process to settle),
// and what the next driver process makes of each: the journal's record
// names the task, so a start Nomad got no handle for is ended and its
// volume torn down, and a handed one waits for Nomad, as with a whole
// invocation file.
func TestInvocations_lostInvocationFile(t *testing.T) {
	for _, tc := range []struct {
		name string
		// invocation is the file's content after the crash; nil: gone
		// (its rename did not reach the disk).
		invocation func(whole []byte) []byte
		// handed: the mark, a link to the same file, made it to disk.
		handed bool
	}{
		{"gone", nil, false},
		{"empty", func([]byte) []byte { return nil }, false},
		{"cut short", func(b []byte) []byte { return b[:len(b)/2] }, false},
		{"zeros", func(b []byte) []byte { return make([]byte, len(b)) }, false},
		{"empty and handed", func([]byte) []byte { return nil }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startVolumeNode(t)
			dir := (&Config{RootDir: c.root}).taskStateDir(c.work.ID)
			// The executor's spec, which names the task, reached the disk
			// (the worst case: without it the directory names no task
			// at all). Its cgroup is gone, as after a reboot.
			must.NoError(t, os.WriteFile(filepath.Join(dir, "spec.json"),
				[]byte(`{"task_id":"`+c.work.ID+`","cgroup_parent":"nomad-driver-csi-test-gone","cgroup_name":"gone"}`), 0o600))
			whole, err := os.ReadFile(filepath.Join(dir, invocationFile))
			must.NoError(t, err)
			if !tc.handed {
				c.forgetHanded(t)
			}
			if tc.invocation == nil {
				must.NoError(t, os.Remove(filepath.Join(dir, invocationFile)))
			} else {
				// Written in place: the mark is a link to the same file.
				must.NoError(t, os.WriteFile(filepath.Join(dir, invocationFile), tc.invocation(whole), 0o600))
			}
			st, err := csihook.ReadJournal(JournalDir(c.root))
			must.NoError(t, err)
			must.SliceLen(t, 1, st.Tasks)
			must.True(t, st.Tasks[0].Invocation, must.Sprint("the task's journal record does not name it in place of its invocation file"))

			d, fp := c.restart(t)
			if tc.handed {
				// Nomad may recover it: it keeps its volume until Nomad
				// says.
				must.True(t, d.invocations.alive(c.work.ID))
				must.Eq(t, 1, journalTasks(t, d))
				must.Eq(t, 0, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
				must.True(t, exists(dir))
				// A new start of the same task of the same allocation
				// ends it, as one with its invocation file.
				must.Eq(t, []string{c.work.ID}, d.invocations.superseded(volumeWorkload(t, "alloc-w", "second")))
				return
			}
			must.Wait(t, wait.InitialSuccess(
				wait.BoolFunc(func() bool { return fp.vols.Count(csihook.MethodNodeUnpublishVolume) == 1 }),
				wait.Timeout(20*time.Second), wait.Gap(10*time.Millisecond)))
			must.Eq(t, 0, journalTasks(t, d))
			must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return !exists(dir) }),
				wait.Timeout(20*time.Second), wait.Gap(10*time.Millisecond)))
			must.False(t, d.invocations.alive(c.work.ID))
		})
	}
}

// A start whose journal record never reached the disk called nothing for
// its volumes: a state directory whose invocation file a crash lost, with
// no record naming its task, is not waited for and nothing is torn down
// for it. Records of a driver that synced its invocation files (no mark)
// name nothing in their stead: a directory of such a task without the file
// is an older driver's, handed over, as before.
func TestInvocations_scanWithoutJournalRecord(t *testing.T) {
	root := shortTempDir(t)
	conf := &Config{RootDir: root}
	// The golden log holds records of tasks t1 and t2, without the mark.
	golden, err := os.ReadFile(filepath.Join("..", "csihook", "testdata", "journal", "v1-compacted.log"))
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(JournalDir(root), 0o700))
	must.NoError(t, os.WriteFile(filepath.Join(JournalDir(root), "journal.log"), golden, 0o600))
	st, err := csihook.ReadJournal(JournalDir(root))
	must.NoError(t, err)
	var ids []string
	for _, tr := range st.Tasks {
		must.False(t, tr.Invocation)
		ids = append(ids, tr.TaskID)
	}
	must.SliceContains(t, ids, "t1")

	mk := func(id string, invocation []byte) string {
		dir := conf.taskStateDir(id)
		must.NoError(t, os.MkdirAll(dir, 0o700))
		must.NoError(t, os.WriteFile(filepath.Join(dir, "spec.json"), []byte(`{"task_id":"`+id+`"}`), 0o600))
		if invocation != nil {
			must.NoError(t, os.WriteFile(filepath.Join(dir, invocationFile), invocation, 0o600))
		}
		return dir
	}
	// An unsynced invocation file cut by a crash, no record.
	mk("a/t/lost", []byte{})
	// An older driver's task, whose volume the unmarked record holds.
	mk("t1", nil)

	iv := newInvocations()
	orphans := iv.scanTaskDirs(hclog.NewNullLogger(), conf.tasksDir(), JournalDir(root))
	must.SliceEmpty(t, orphans)
	must.False(t, iv.alive("a/t/lost"))
	must.True(t, iv.alive("t1"))
	must.Eq(t, TaskDirs{Handed: []string{"t1"}}, ReadTaskDirs(root))
}

func TestInvocationOf(t *testing.T) {
	for id, want := range map[string]invocation{
		"a/web/1":   {TaskID: "a/web/1", AllocID: "a", TaskName: "web"},
		"a/w/e/b/1": {TaskID: "a/w/e/b/1"},
		"a/web/":    {TaskID: "a/web/"},
		"a//1":      {TaskID: "a//1"},
		"/web/1":    {TaskID: "/web/1"},
		"t1":        {TaskID: "t1"},
		"a/1":       {TaskID: "a/1"},
	} {
		must.Eq(t, want, invocationOf(id), must.Sprint(id))
	}
}

// The invocation file of a task without volumes is synced before anything
// starts: no journal record names such a task. A task with volumes leaves
// its file's flush to its journal's first record.
func TestInvocations_syncedUnlessTheJournalNamesTheTask(t *testing.T) {
	var (
		mu     sync.Mutex
		synced = map[string]bool{}
	)
	write := writeAtomic
	writeAtomic = func(path string, data []byte, perm os.FileMode, sync bool) error {
		mu.Lock()
		synced[filepath.Base(filepath.Dir(path))] = sync
		mu.Unlock()
		return write(path, data, perm, sync)
	}
	t.Cleanup(func() { writeAtomic = write })
	c := startVolumeNode(t)
	mu.Lock()
	defer mu.Unlock()
	must.Eq(t, map[string]bool{csihook.ShortHash(c.plugin.ID): true, csihook.ShortHash(c.work.ID): false}, synced)
}

// A power cut leaves more than the task's own directory cut: the journal's
// last batch torn (a commit after the record that names the task, never
// finished), the invocation's rename lost with its temporary file left
// beside, and the directory of an earlier start of the same task whose
// file was cut too but that no record names (its start called nothing).
// The record still names its task's directory, and only that one: the
// start Nomad got no handle for is ended and its volume torn down, the
// directory no record names is left alone and superseded by nothing, and
// the cleanup CLI's reading (ReadTaskDirs) is the driver's.
func TestInvocations_lostInvocationFileAfterAPowerCut(t *testing.T) {
	c := startVolumeNode(t)
	conf := &Config{RootDir: c.root}
	dir := conf.taskStateDir(c.work.ID)
	must.NoError(t, os.WriteFile(filepath.Join(dir, "spec.json"),
		[]byte(`{"task_id":"`+c.work.ID+`","cgroup_parent":"nomad-driver-csi-test-gone","cgroup_name":"gone"}`), 0o600))
	c.forgetHanded(t)
	must.NoError(t, os.Remove(filepath.Join(dir, invocationFile)))
	must.NoError(t, os.WriteFile(filepath.Join(dir, ".invocation.json.tmp-1234"), make([]byte, 80), 0o600))

	// An earlier start of the same task, named by no record.
	other := c.work.AllocID + "/" + c.work.Name + "/earlier"
	otherDir := conf.taskStateDir(other)
	must.NoError(t, os.MkdirAll(otherDir, 0o700))
	must.NoError(t, os.WriteFile(filepath.Join(otherDir, "spec.json"), []byte(`{"task_id":"`+other+`"}`), 0o600))
	must.NoError(t, os.WriteFile(filepath.Join(otherDir, invocationFile), []byte(`{"task_id":"`+other[:10]), 0o600))

	// The journal's last batch torn: the first bytes of a copy of the log
	// appended, as a commit cut by the crash leaves them.
	logPath := filepath.Join(JournalDir(c.root), "journal.log")
	log, err := os.ReadFile(logPath)
	must.NoError(t, err)
	f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND, 0)
	must.NoError(t, err)
	_, err = f.Write(log[:min(len(log)/2, 40)])
	must.NoError(t, err)
	must.NoError(t, f.Close())
	st, err := csihook.ReadJournal(JournalDir(c.root))
	must.NoError(t, err, must.Sprint("a torn tail is read as the end of the log"))
	must.SliceLen(t, 1, st.Tasks)
	must.True(t, st.Tasks[0].Invocation)

	must.Eq(t, TaskDirs{Handed: []string{c.plugin.ID}, Unfinished: []string{c.work.ID}}, ReadTaskDirs(c.root))

	d, fp := c.restart(t)
	must.False(t, d.invocations.alive(other))
	must.SliceEmpty(t, d.invocations.superseded(volumeWorkload(t, c.work.AllocID, "second")))
	must.Wait(t, wait.InitialSuccess(
		wait.BoolFunc(func() bool { return fp.vols.Count(csihook.MethodNodeUnpublishVolume) == 1 }),
		wait.Timeout(20*time.Second), wait.Gap(10*time.Millisecond)))
	must.Eq(t, 0, journalTasks(t, d))
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return !exists(dir) }),
		wait.Timeout(20*time.Second), wait.Gap(10*time.Millisecond)))
	must.True(t, exists(otherDir), must.Sprint("a directory no record names is not ours to judge"))
	must.False(t, d.invocations.alive(c.work.ID))
}

// The executor's spec and supervisor record are not synced (they matter
// only while the host is up), so a power cut can leave either empty or cut
// in a state directory whose task held volumes. Nothing of such a task runs
// after the reboot, and it must not hold its volumes for good: a new start
// of the same task ends it and takes its single-node-writer volume, as with
// whole files.
func TestInvocations_cutSpecAfterAPowerCut(t *testing.T) {
	for _, tc := range []struct {
		name   string
		handed bool
		// cut is the file the crash cut; the others are whole.
		cut string
	}{
		{"handed", true, "spec.json"},
		{"start cut short", false, "spec.json"},
		{"supervisor record cut, handed", true, "supervisor.json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startVolumeNode(t)
			conf := &Config{RootDir: c.root}
			dir := conf.taskStateDir(c.work.ID)
			// The reboot: the task's processes and cgroups are gone, its
			// directory is back as the disk held it.
			invocation, err := os.ReadFile(filepath.Join(dir, invocationFile))
			must.NoError(t, err)
			must.NoError(t, executor.Discard(hclog.NewNullLogger(), dir))
			must.NoError(t, os.MkdirAll(dir, 0o700))
			must.NoError(t, os.WriteFile(filepath.Join(dir, invocationFile), invocation, 0o600))
			if tc.handed {
				must.NoError(t, os.Link(filepath.Join(dir, invocationFile), filepath.Join(dir, handedFile)))
			}
			must.NoError(t, os.WriteFile(filepath.Join(dir, "spec.json"),
				[]byte(`{"task_id":"`+c.work.ID+`","cgroup_parent":"nomad-driver-csi-test-gone","cgroup_name":"gone"}`), 0o600))
			cut := filepath.Join(dir, tc.cut)
			must.NoError(t, os.WriteFile(cut, []byte(`{"task_id":"al`), 0o600))
			// Written before the host booted.
			for _, f := range []string{"spec.json", tc.cut} {
				must.NoError(t, os.Chtimes(filepath.Join(dir, f), time.Unix(86400, 0), time.Unix(86400, 0)))
			}

			d, fp := c.restart(t)
			again := volumeWorkload(t, "alloc-w", "second")
			_, _, err = d.StartTask(again)
			must.NoError(t, err)
			must.Eq(t, 1, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
			must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))
			must.Eq(t, 1, journalTasks(t, d))
			must.False(t, exists(dir), must.Sprint("the earlier start's state directory is left"))
			must.NoError(t, d.DestroyTask(again.ID, true))
			must.Eq(t, 0, journalTasks(t, d))
		})
	}
}

// The tasks of one allocation share a single-node-writer volume (an app
// and its sidecar), across driver restarts: the sidecar started by a new
// driver process shares the publish the app's start made, and the publish
// goes only with the last of them, destroyed under a third process.
func TestInvocations_tasksOfOneAllocationShareAVolumeAcrossRestarts(t *testing.T) {
	c := startVolumeNode(t)
	d, fp := c.restart(t)
	must.NoError(t, d.RecoverTask(persisted(t, c.workHandle)))
	sidecar := volumeWorkload(t, "alloc-w", "x")
	sidecar.ID, sidecar.Name = "alloc-w/sidecar/1", "sidecar"
	sidecarHandle, _, err := d.StartTask(sidecar)
	must.NoError(t, err)
	must.Eq(t, 0, fp.vols.Count(csihook.MethodNodePublishVolume))
	must.Eq(t, 2, journalTasks(t, d))
	d.Shutdown()

	d, fp = c.restart(t)
	for _, h := range []*drivers.TaskHandle{c.workHandle, sidecarHandle} {
		must.NoError(t, d.RecoverTask(persisted(t, h)))
	}
	must.NoError(t, d.DestroyTask(c.work.ID, true))
	must.Eq(t, 0, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	must.Eq(t, 1, journalTasks(t, d))
	must.NoError(t, d.DestroyTask(sidecar.ID, true))
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	must.Eq(t, 0, journalTasks(t, d))
}

// A start time counts from the boot: after a reboot the agent may well
// have the PID and start time the agent before it had (a host boots the
// same way each time), and the tasks that agent left would be taken for
// the new agent's, never ended. The identity names the boot too.
func TestAgentIdentity_differsAcrossBoots(t *testing.T) {
	old := bootID
	t.Cleanup(func() { bootID = old })
	bootID = func() (string, error) { return "3b1a0d52-0000-4000-8000-000000000001", nil }
	before := agentIdentity()
	bootID = func() (string, error) { return "3b1a0d52-0000-4000-8000-000000000002", nil }
	after := agentIdentity()
	must.NotEq(t, "", before)
	must.NotEq(t, before, after)
	must.Eq(t, after, agentIdentity(), must.Sprint("stable within a boot"))
}
