package driver

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
)

// syncBuffer is a log sink tests read while the driver writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// restartDangling starts a new driver process on the node's root_dir with
// the dangling_tasks block dt, its log in the returned buffer; recover
// lists the handles Nomad takes back.
func (c *invocationCase) restartDangling(t *testing.T, dt *DanglingTasks, recoverPlugin bool, before ...func(*Driver)) (*testDriver, *fakePlugins, *syncBuffer) {
	t.Helper()
	fp := &fakePlugins{fakes: map[string]*fingerprint.Fake{}, vols: csihook.NewFakeClient(c.mnt)}
	logs := &syncBuffer{}
	// The agent restarted with the driver (a new agent process), unless
	// a before says otherwise.
	newAgent := func(d *Driver) { d.agent = "agent-after-restart" }
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll, RootDir: c.root, DanglingTasks: dt}, append(append([]func(*Driver){newAgent}, before...), func(d *Driver) {
		d.logger = newCleanLogger(hclog.New(&hclog.LoggerOptions{Output: logs, Level: hclog.Debug}))
		d.mounter = c.mnt
		d.dialVolume = fp.vols.Dial
		d.prober = fingerprint.NewProber(fingerprint.Config{
			Interval: time.Hour, ScanInterval: time.Hour, Dial: fp.dial,
			StatSocket: func(string) error { return nil }, OnHealthChange: d.onPluginHealth,
		})
	})...)
	if recoverPlugin {
		must.NoError(t, d.RecoverTask(persisted(t, c.pluginHandle)))
		waitHealthy(t, d, "hp")
	}
	return d, fp, logs
}

func stateDirGone(conf *Config, id string) error {
	if _, err := os.Lstat(conf.taskStateDir(id)); !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("state directory of %s still there (%v)", id, err)
	}
	return nil
}

func shortDangling() *DanglingTasks {
	return &DanglingTasks{Enabled: true, Grace: "1s", Period: "1s"}
}

// The agent went while it collected the workload's allocation: Nomad
// recovers the plugin task, never the workload. Once the grace is over the
// workload is ended as DestroyTask would end it: its volume is unpublished
// and unstaged through the lifecycle, its state directory is gone, and the
// plugin task Nomad recovered stays. A RecoverTask that comes after fails
// cleanly, saying why.
func TestDangling_unrecoveredTaskIsEndedAfterGrace(t *testing.T) {
	c := startVolumeNode(t)
	d, fp, logs := c.restartDangling(t, shortDangling(), true)
	conf := d.currentConfig()

	must.Wait(t, wait.InitialSuccess(wait.ErrorFunc(func() error {
		if err := stateDirGone(conf, c.work.ID); err != nil {
			return err
		}
		if n := journalTasks(t, d); n != 0 {
			return fmt.Errorf("volume still has %d users", n)
		}
		// Logged once the volumes are torn down, after the above.
		if !strings.Contains(logs.String(), "ended a dangling task") {
			return errors.New("the end is not logged yet")
		}
		return nil
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	must.StrContains(t, logs.String(), "ended a dangling task")
	must.StrContains(t, logs.String(), c.work.ID)

	// The plugin task Nomad took back is this process's: never a candidate.
	_, known := d.tasks.Get(c.plugin.ID)
	must.True(t, known)
	must.Error(t, stateDirGone(conf, c.plugin.ID))
	// Its invocation file names the agent that recovered it, so that a
	// driver started anew under that agent leaves it to Nomad.
	must.Eq(t, "agent-after-restart", readInvocationAgent(t, conf, c.plugin.ID))

	// Nomad recovering the workload after all (a restore slower than the
	// grace) gets an error, and Nomad starts the task anew; nothing is set
	// up or torn down again.
	err := d.RecoverTask(persisted(t, c.workHandle))
	must.ErrorContains(t, err, "dangling")
	_, known = d.tasks.Get(c.work.ID)
	must.False(t, known)
	must.NoError(t, stateDirGone(conf, c.work.ID))
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	must.Eq(t, 0, journalTasks(t, d))
}

// A dangling task whose process tree could not be ended (a supervisor
// stuck in the kernel, a cgroup that will not go) is tried again every
// period, as the log says, and is not taken for ended meanwhile: its
// processes may run on, and a RecoverTask then must not be told the
// driver ended it.
func TestDangling_failedEndIsTriedAgain(t *testing.T) {
	c := startVolumeNode(t)
	var (
		mu    sync.Mutex
		calls []string
	)
	fail := true
	d, fp, logs := c.restartDangling(t, shortDangling(), true, func(d *Driver) {
		d.discard = func(l hclog.Logger, stateDir string) error {
			mu.Lock()
			defer mu.Unlock()
			calls = append(calls, stateDir)
			if fail {
				fail = false
				return errors.New("cgroup busy")
			}
			return executor.Discard(l, stateDir)
		}
	})
	conf := d.currentConfig()
	must.Wait(t, wait.InitialSuccess(wait.ErrorFunc(func() error {
		if err := stateDirGone(conf, c.work.ID); err != nil {
			return err
		}
		if n := journalTasks(t, d); n != 0 {
			return fmt.Errorf("volume still has %d users", n)
		}
		// Logged once the volumes are torn down, after the above.
		if !strings.Contains(logs.String(), "ended a dangling task") {
			return errors.New("the end is not logged yet")
		}
		return nil
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	must.StrContains(t, logs.String(), "failed to end a dangling task")
	must.StrContains(t, logs.String(), "ended a dangling task")
	mu.Lock()
	must.Eq(t, []string{conf.taskStateDir(c.work.ID), conf.taskStateDir(c.work.ID)}, calls)
	mu.Unlock()
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
}

// While a dangling task cannot be ended, Nomad recovering it (a restore
// slower than the grace) takes it back: the driver did not end it, so it
// must not say so, nor leave a running task to a second instance.
func TestDangling_unendedTaskCanBeRecovered(t *testing.T) {
	c := startVolumeNode(t)
	tried := make(chan struct{})
	var once sync.Once
	d, fp, _ := c.restartDangling(t, shortDangling(), true, func(d *Driver) {
		d.discard = func(hclog.Logger, string) error {
			once.Do(func() { close(tried) })
			return errors.New("supervisor did not exit")
		}
	})
	<-tried
	must.NoError(t, d.RecoverTask(persisted(t, c.workHandle)))
	_, known := d.tasks.Get(c.work.ID)
	must.True(t, known)
	must.Error(t, stateDirGone(d.currentConfig(), c.work.ID))
	must.Eq(t, 1, journalTasks(t, d))
	must.Eq(t, 0, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
}

// A driver shutting down stops ending dangling tasks: it goes as soon as
// it is told to, and what is left is the next driver process's to judge.
func TestDangling_shutdownStopsThePass(t *testing.T) {
	root := shortTempDir(t)
	d := newTestDriver(t, Config{Enabled: true, RootDir: root})
	for _, alloc := range []string{"alloc-a", "alloc-b"} {
		_, _, err := d.StartTask(jobTask(t, TaskConfig{Command: "/bin/sleep"}, alloc, "default", "j"))
		must.NoError(t, err)
	}
	d.Shutdown()

	var (
		mu    sync.Mutex
		calls []string
	)
	next := newTestDriver(t, Config{Enabled: true, RootDir: root, DanglingTasks: shortDangling()}, func(d *Driver) {
		d.agent = "agent-after-restart"
		d.discard = func(l hclog.Logger, stateDir string) error {
			mu.Lock()
			calls = append(calls, stateDir)
			mu.Unlock()
			// The driver is told to shut down while it ends the first.
			d.cancel()
			return executor.Discard(l, stateDir)
		}
	})
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(calls) > 0
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	next.Shutdown()
	mu.Lock()
	defer mu.Unlock()
	must.SliceLen(t, 1, calls)
}

// dry_run only says what it would end: the task stays Nomad's to recover.
func TestDangling_dryRunOnlyLogs(t *testing.T) {
	c := startVolumeNode(t)
	dt := shortDangling()
	dt.DryRun = true
	d, fp, logs := c.restartDangling(t, dt, true)
	conf := d.currentConfig()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return strings.Contains(logs.String(), "found a dangling task")
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	must.StrContains(t, logs.String(), c.work.ID)
	must.Error(t, stateDirGone(conf, c.work.ID))
	must.Eq(t, 1, journalTasks(t, d))
	must.Eq(t, 0, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	must.NoError(t, d.RecoverTask(persisted(t, c.workHandle)))
	_, known := d.tasks.Get(c.work.ID)
	must.True(t, known)
}

// Both the plugin task and its workload dangle (a whole node's jobs
// purged): the workload goes first. Its volume cannot be torn down while
// no plugin serves the id, so the plugin task is kept, with a warning,
// and not killed under the volume it would have to unstage.
func TestDangling_pluginKeptWhileItsVolumesAreHeld(t *testing.T) {
	c := startVolumeNode(t)
	d, _, logs := c.restartDangling(t, shortDangling(), false)
	conf := d.currentConfig()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return strings.Contains(logs.String(), "dangling plugin task kept")
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	must.NoError(t, stateDirGone(conf, c.work.ID))
	must.Error(t, stateDirGone(conf, c.plugin.ID))
	m, err := d.volumes()
	must.NoError(t, err)
	must.False(t, m.PluginWork("hp").Empty())

	// The operator runs the plugin job again: the new plugin task serves
	// the id, the volume's teardown goes through it, and the dangling
	// instance, serving nothing now, is ended.
	again := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p2", "default", "plugin")
	_, _, err = d.StartTask(again)
	must.NoError(t, err)
	waitHealthy(t, d, "hp")
	must.Wait(t, wait.InitialSuccess(wait.ErrorFunc(func() error {
		if n := journalTasks(t, d); n != 0 {
			return fmt.Errorf("volume still has %d users", n)
		}
		return stateDirGone(conf, c.plugin.ID)
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	_, known := d.tasks.Get(again.ID)
	must.True(t, known)
	must.Error(t, stateDirGone(conf, again.ID))
}

// As above, but the plugin task was started by a driver that kept no plugin
// id in its invocation file, and its spec cannot be read (damaged in this
// boot): nothing says it is a plugin, and it goes as a workload would. It
// is still never ended under the volume it has to unstage: a spec that
// cannot be read is not guessed at (executor.Discard ends only a task with
// no spec, which started nothing, or with one a crash of the host cut,
// whose processes died with the host), and the task waits, tried again
// every period, as the log says.
func TestDangling_unknownTaskWithUnreadableSpecIsKept(t *testing.T) {
	c := startVolumeNode(t)
	dir := (&Config{RootDir: c.root}).taskStateDir(c.plugin.ID)
	inv := filepath.Join(dir, invocationFile)
	b, err := os.ReadFile(inv)
	must.NoError(t, err)
	var old map[string]any
	must.NoError(t, json.Unmarshal(b, &old))
	must.Eq(t, "hp", old["plugin_id"].(string))
	delete(old, "plugin_id")
	b, err = json.Marshal(old)
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(inv, b, 0o600))
	must.NoError(t, os.WriteFile(filepath.Join(dir, wire.SpecFile), []byte("{damaged"), 0o600))

	d, _, logs := c.restartDangling(t, shortDangling(), false)
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(logs.String())
		}
	})
	conf := d.currentConfig()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return strings.Count(logs.String(), "failed to end a dangling task; trying again: alloc_id=alloc-p") >= 2
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	must.StrContains(t, logs.String(), "spec.json")
	must.NoError(t, stateDirGone(conf, c.work.ID))
	must.Error(t, stateDirGone(conf, c.plugin.ID), must.Sprint("a task whose spec cannot be read was ended"))
	must.True(t, d.invocations.isWaiting(c.plugin.ID))
	must.False(t, d.invocations.wasDangling(c.plugin.ID))
}

// A dangling task that ran from an image lets go of its image lease as it
// is ended, as DestroyTask does: the image's last use is then, and
// image_gc counts from there. (Left to the image GC, the lease went at
// its next pass, up to 10 minutes later.)
func TestDangling_imageLeaseReleased(t *testing.T) {
	d := newImageDriver(t, nil)
	cfg := taskConfig(t, TaskConfig{Command: "/bin/plugin", Image: d.ref})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	must.SliceLen(t, 1, d.uses(t))
	conf := *d.currentConfig()
	d.Shutdown()

	conf.DanglingTasks = shortDangling()
	again := &imageDriver{testDriver: newTestDriver(t, conf, func(d *Driver) { d.agent = "agent-after-restart" })}
	must.Wait(t, wait.InitialSuccess(wait.ErrorFunc(func() error {
		if err := stateDirGone(&conf, cfg.ID); err != nil {
			return err
		}
		if uses := again.uses(t); len(uses) != 0 {
			return fmt.Errorf("image leases still held: %v", uses)
		}
		return nil
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
}

func TestDanglingTasks_validate(t *testing.T) {
	for _, tc := range []struct {
		dt   *DanglingTasks
		want string
	}{
		{nil, ""},
		{&DanglingTasks{Enabled: true, Grace: "10m", Period: "1m"}, ""},
		{&DanglingTasks{Enabled: true, Grace: "100ms"}, `dangling_tasks grace must be a duration of at least "1s"`},
		{&DanglingTasks{Enabled: true, Period: "soon"}, `dangling_tasks period must be a duration`},
	} {
		err := tc.dt.validate()
		if tc.want == "" {
			must.NoError(t, err)
		} else {
			must.ErrorContains(t, err, tc.want)
		}
	}
	s := (*DanglingTasks)(nil).settings()
	must.True(t, s.enabled)
	must.Eq(t, 5*time.Minute, s.grace)
}

// A state directory written before invocation files named the plugin id
// still says it, by the socket directory mounted into the task.
func TestSpecPluginID(t *testing.T) {
	conf := &Config{RootDir: "/r"}
	pc := &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}
	must.Eq(t, "hp", specPluginID(conf, &executor.Spec{Mounts: pluginMounts(conf, pc)}))
	must.Eq(t, "hp", specPluginID(conf, &executor.Spec{LateMounts: pluginMounts(conf, pc)}))
	must.Eq(t, "", specPluginID(conf, &executor.Spec{Mounts: []executor.Mount{{Source: "/r/plugins/hp/x", Target: "/x"}, {Source: "/r/mnt", Target: "/r/mnt"}}}))
}

// Only the driver went: Nomad starts a crashed driver plugin anew under
// the same agent, and recovers a task once its task runner next needs the
// driver, which may be long after the grace (a task whose prestart hook
// waits for a template). A task last handed to the running agent is left
// to Nomad, and recovered when Nomad comes.
func TestDangling_taskOfTheRunningAgentIsLeftToNomad(t *testing.T) {
	c := startVolumeNode(t)
	conf0 := &Config{RootDir: c.root}
	agent := readInvocationAgent(t, conf0, c.work.ID)
	must.NotEq(t, "", agent)
	d, fp, logs := c.restartDangling(t, shortDangling(), false, func(d *Driver) { d.agent = agent })
	conf := d.currentConfig()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return strings.Count(logs.String(), "left to Nomad") >= 2
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	for _, id := range []string{c.work.ID, c.plugin.ID} {
		must.Error(t, stateDirGone(conf, id))
	}
	must.Eq(t, 0, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	must.StrNotContains(t, logs.String(), "ended a dangling task")

	must.NoError(t, d.RecoverTask(persisted(t, c.pluginHandle)))
	must.NoError(t, d.RecoverTask(persisted(t, c.workHandle)))
	_, known := d.tasks.Get(c.work.ID)
	must.True(t, known)
}

// readInvocationAgent is the agent the task's invocation file names.
func readInvocationAgent(t *testing.T, conf *Config, id string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(conf.taskStateDir(id), invocationFile))
	must.NoError(t, err)
	var inv invocation
	must.NoError(t, json.Unmarshal(b, &inv))
	return inv.Agent
}

// The plugin task and its workload dangle, and meanwhile a socket in
// plugin_socket_dirs serves the plugin id. The volume's calls wait for the
// job that set it up (csihook refuses the socket), so the operator runs
// the plugin job again, as the refusal says: its task takes the id back
// from the socket (its job held the id first, its volumes are still
// held), and the volume's teardown goes through it.
func TestDangling_pluginJobTakesItsIDBackFromASocket(t *testing.T) {
	c := startVolumeNode(t)
	d, _, logs := c.restartDangling(t, shortDangling(), false)
	conf := d.currentConfig()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return strings.Contains(logs.String(), "dangling plugin task kept")
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))

	sockets := shortTempDir(t)
	listenUnix(t, filepath.Join(sockets, "hp", "csi.sock"))
	p := d.currentProber()
	p.SetSocketDirs([]string{sockets})
	p.Rescan()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		st, ok := p.Get("hp")
		return ok && st.Source == fingerprint.SourceSocketDir
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	m, err := d.volumes()
	must.NoError(t, err)
	must.False(t, m.PluginWork("hp").Empty(), must.Sprint("the volume was released: the test proves nothing"))

	again := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p2", "default", "plugin")
	_, _, err = d.StartTask(again)
	must.NoError(t, err)
	must.Wait(t, wait.InitialSuccess(wait.ErrorFunc(func() error {
		if n := journalTasks(t, d); n != 0 {
			return fmt.Errorf("volume still has %d users", n)
		}
		return stateDirGone(conf, c.plugin.ID)
	}), wait.Timeout(30*time.Second), wait.Gap(20*time.Millisecond)))
	st, ok := p.Get("hp")
	must.True(t, ok)
	must.Eq(t, again.ID, st.TaskID)
}
