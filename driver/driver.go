// Package driver is the Nomad task driver `csi`: it speaks Nomad's
// DriverPlugin RPCs and runs each task through the executor so that tasks
// outlive the driver process.
package driver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/drivers/shared/eventer"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// fingerprintPeriod is how often the driver re-checks the host when nothing
// else prompts it.
const fingerprintPeriod = 30 * time.Second

// destroyWait bounds how long a forced DestroyTask waits for the task's
// processes to be gone.
const destroyWait = 30 * time.Second

var (
	_ drivers.DriverPlugin            = (*Driver)(nil)
	_ drivers.ExecTaskStreamingDriver = (*Driver)(nil)
)

// Driver is the `csi` task driver.
type Driver struct {
	logger  hclog.Logger
	eventer *eventer.Eventer
	tasks   *taskStore
	// stats samples every TaskStats stream (stats.go).
	stats *statsSchedule
	// churn follows task starts and ends for idleLoop (idle.go).
	churn taskChurn

	ctx    context.Context
	cancel context.CancelFunc

	mu         sync.RWMutex
	config     *Config
	mhzPerCore float64
	// sentAttrs are the attribute keys of the last fingerprint sent.
	sentAttrs map[string]bool
	// rootFull is set while root_dir's file system is full (diskfull.go).
	rootFull bool
	// shim is the supervisor binary tasks start with ("" = this binary).
	shim string
	// agent names the Nomad agent process that runs this driver (see
	// agentIdentity); each task's invocation file records the agent it
	// was last handed to, and the dangling-task reconciler leaves the
	// tasks of the running agent to it (dangling.go).
	agent string

	// spares are supervisors started ahead of need (nil: none).
	spares *executor.Spares
	// start and recover run a task's process; they are the executor's in
	// production and fakes in unit tests.
	start   func(hclog.Logger, *executor.Spec, func() ([]executor.Mount, error)) (taskProcess, error)
	recover func(hclog.Logger, executor.State) (taskProcess, error)
	// discard ends what a start cut short left in a state directory
	// (executor.Discard; tests record it).
	discard func(hclog.Logger, string) error
	// host answers the fingerprint's questions about this machine.
	host hostProbe
	// cpuRoot is the tree the CPU speed is read from ("/"; tests set a
	// fake one).
	cpuRoot fs.FS
	// mounter makes the host side of bidirectional mounts; shared tracks
	// them (created by SetConfig, once root_dir is known).
	mounter mounter.Interface
	shared  *sharedSources

	// prober fingerprints CSI plugins (made by SetConfig); plugins knows
	// which task serves which plugin id.
	prober  *fingerprint.Prober
	plugins *pluginTasks

	// invocations says which task state directories are alive (see
	// invocations.go).
	invocations *invocations
	// vols is the volume lifecycle; eventTargets maps a task ID to its
	// config so the lifecycle's events reach the right task.
	vols         volumeManager
	eventTargets sync.Map
	// repairMu serialises repairs of dead volume mounts (repair.go).
	repairMu sync.Mutex
	// dialVolume connects the volume lifecycle to a plugin socket
	// (csihook.DialUnix when nil; tests set a fake).
	dialVolume func(socket string) (csihook.Client, error)
	// pluginWait is how long a volume setup waits for its plugin
	// (csihook's default when zero; tests shorten it).
	pluginWait  time.Duration
	recoverOnce sync.Once
	// background counts goroutines that Shutdown waits for.
	background sync.WaitGroup
	// telemetry is the metrics and their endpoint (telemetry.go).
	telemetry telemetry
	// images is the image store (images.go; nil with imagesErr saying
	// why when it cannot be opened); imageGCOnce starts its GC loop.
	images      *image.Store
	imagesErr   error
	imageGCOnce sync.Once
	// mountLayersFull says once that the store keeps no more mount-point
	// layers (addMountLayer).
	mountLayersFull sync.Once
	// imageRoot makes an image the task's root (applyImageRoot; tests
	// record it).
	imageRoot func(*Config, *drivers.TaskConfig, *TaskConfig, *executor.Spec, *image.Image) error
}

// NewPlugin returns the driver, ready for Nomad's SetConfig. Nomad is
// served its Boundary, which cleans the text of what it returns; the
// driver's log is cleaned the same way from here.
func NewPlugin(logger hclog.Logger) *Driver {
	logger = newCleanLogger(logger.Named(PluginName))
	ctx, cancel := context.WithCancel(context.Background())
	d := &Driver{
		logger:  logger,
		eventer: eventer.NewEventer(ctx, logger),
		tasks:   newTaskStore(),
		stats:   newStatsSchedule(),
		ctx:     ctx,
		cancel:  cancel,
		spares:  &executor.Spares{},
		recover: recoverExecutor,
		discard: executor.Discard,
		host:    realHost{},
		cpuRoot: os.DirFS("/"),
		mounter: mounter.NewWithLogger(logger),
		plugins: newPluginTasks(),

		invocations: newInvocations(),
		agent:       agentIdentity(),
	}
	d.start = d.startExecutor
	d.imageRoot = d.applyImageRoot
	return d
}

func (d *Driver) startExecutor(l hclog.Logger, s *executor.Spec, late func() ([]executor.Mount, error)) (taskProcess, error) {
	p, err := d.spares.Start(l, s, late)
	if err != nil {
		return nil, err
	}
	return p, nil
}

func recoverExecutor(l hclog.Logger, st executor.State) (taskProcess, error) {
	p, err := executor.Recover(l, st)
	if err != nil {
		return nil, err
	}
	return p, nil
}

// PluginInfo describes the plugin to Nomad.
func (d *Driver) PluginInfo() (*base.PluginInfoResponse, error) { return pluginInfo, nil }

// ConfigSchema is the schema of the plugin's agent-side `config` block.
func (d *Driver) ConfigSchema() (*hclspec.Spec, error) { return configSpec, nil }

// SetConfig takes the agent's configuration for the plugin.
//
// Nomad's plugin loader first starts the plugin once only to check its
// configuration, with no agent configuration, and kills it right after;
// the driver manager then starts the plugin that serves, always with one.
// That first call only decodes and validates: it must not settle what an
// earlier driver process left (ending tasks, tearing down volumes, opening
// the journal) in a process killed at any moment.
func (d *Driver) SetConfig(c *base.Config) error {
	cfg, err := decodeConfig(c)
	if err != nil || (c != nil && c.AgentConfig == nil) {
		return err
	}
	return d.setConfig(c, cfg)
}

// setConfig makes cfg the driver's configuration and settles what an
// earlier driver process left, once.
func (d *Driver) setConfig(c *base.Config, cfg Config) error {
	var shim string
	if cfg.Enabled {
		if err := os.MkdirAll(cfg.tasksDir(), 0o700); err != nil {
			return fmt.Errorf("invalid csi plugin config: root_dir %q is not usable: %w", cfg.RootDir, err)
		}
		var err error
		if shim, err = installShim(shimSource, cfg.RootDir); err != nil {
			// Tasks still start, from the driver's own binary.
			d.logger.Warn("running task supervisors from the driver binary", "error", err)
		}
	}

	mhz := d.cpuMHzPerCore(cfg)

	d.mu.Lock()
	d.config = &cfg
	d.mhzPerCore = mhz
	d.shim = shim
	if d.shared == nil || d.shared.stateFile != cfg.sharedMountsFile() {
		d.shared = newSharedSources(d.logger, d.mounter, cfg.sharedMountsFile())
	}
	if d.prober == nil {
		d.prober = fingerprint.NewProber(fingerprint.Config{
			Logger:         d.logger,
			OnHealthChange: d.onPluginHealth,
			Dial: func(socket string, rpcTimeout time.Duration) (fingerprint.Client, error) {
				return fingerprint.NewClientPeer(socket, rpcTimeout, d.socketPeer(socket))
			},
		})
	}
	prober := d.prober
	d.mu.Unlock()
	if cfg.Enabled {
		d.openImages(&cfg)
		if err := resetSparesDir(cfg.sparesDir()); err != nil {
			d.logger.Warn("spare supervisors will not prepare task roots ahead", "error", err)
		} else {
			d.spares.SetDir(cfg.sparesDir(), cfg.defaultIsolation())
			// The limits every isolated task has (see buildSpec), until
			// an isolated task starts: later spares take its limits. A
			// task's own are written as it claims the group.
			d.spares.SetGroup(cfg.CgroupParent, cgroups.Limits{
				Devices: cgroups.DefaultDevices,
				PidsMax: int64(cfg.PidsLimit),
			}, d.logger)
		}
		// The first task need not wait for its supervisor to start.
		d.spares.Fill(shim, d.logger)
	}
	prober.SetSocketDirs(cfg.PluginSocketDirs)
	if err := d.configureMetrics(cfg); err != nil {
		return err
	}
	if cfg.Enabled {
		d.checkRootPropagation(&cfg)
		// Settle what an earlier driver process left: starts it never
		// finished are ended, tasks that are gone lose their volumes,
		// interrupted steps are finished. The scan comes first, before
		// Nomad can start or recover a task.
		conf := &cfg
		d.recoverOnce.Do(func() {
			orphans := d.invocations.scanTaskDirs(d.logger, conf.tasksDir(), JournalDir(conf.RootDir))
			d.goBackground(func() {
				d.discardOrphans(conf, orphans)
				d.recoverVolumes()
			})
			d.goBackground(d.repairLoop)
			d.goBackground(d.idleLoop)
			d.goBackground(func() { d.danglingLoop(conf) })
		})
	}
	warnGrants(d.logger, &cfg)
	d.logger.Debug("configured", "root_dir", cfg.RootDir, "allow_privileged", cfg.AllowPrivileged,
		"privileged_plugins_only", cfg.PrivilegedPluginsOnly, "allow_cross_namespace_volumes", cfg.AllowCrossNamespaceVolumes,
		"enabled", cfg.Enabled)
	return nil
}

// cpuMHzPerCore is the speed of one core that task CPU stats are counted
// in: the operator's cpu_total_compute over the node's cores, or what the
// kernel says (cpuspeed.go). 0 when neither is known.
func (d *Driver) cpuMHzPerCore(cfg Config) float64 {
	speed, err := measureCPU(d.cpuRoot)
	if speed.Cores <= 0 {
		speed.Cores = runtime.NumCPU()
	}
	mhz := speed.mhzPerCore(cfg.CPUTotalCompute)
	switch {
	case cfg.CPUTotalCompute > 0:
		d.logger.Debug("cpu speed from cpu_total_compute", "cpu_total_compute", cfg.CPUTotalCompute, "cores", speed.Cores, "mhz_per_core", mhz)
	case err != nil:
		d.logger.Warn("cpu usage of tasks will show 0 MHz: set cpu_total_compute to the node's total MHz", "error", err)
	default:
		d.logger.Debug("cpu speed measured", "source", speed.Source, "cores", speed.Cores, "mhz_per_core", mhz)
	}
	return mhz
}

func (d *Driver) shimPath() string {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.shim
}

func (d *Driver) currentProber() *fingerprint.Prober {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.prober
}

func (d *Driver) currentConfig() *Config {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.config
}

func (c *Config) tasksDir() string { return filepath.Join(c.RootDir, "tasks") }

// sparesDir holds a directory per spare supervisor, where it prepares a
// task's root ahead of its task.
func (c *Config) sparesDir() string { return filepath.Join(c.RootDir, "spares") }

// sharedMountsFile records the self-bind mounts the driver made.
func (c *Config) sharedMountsFile() string { return filepath.Join(c.RootDir, "shared-mounts.json") }

func (d *Driver) sharedSources() *sharedSources {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.shared
}

// taskStateDir is the directory private to one task. Nomad's task IDs hold
// slashes, so the directory is named by a hash of the ID.
func (c *Config) taskStateDir(taskID string) string {
	return filepath.Join(c.tasksDir(), csihook.ShortHash(taskID))
}

// TaskConfigSchema is the schema of a task's `config` block.
func (d *Driver) TaskConfigSchema() (*hclspec.Spec, error) { return taskConfigSpec, nil }

// Capabilities tells Nomad what the driver can do.
func (d *Driver) Capabilities() (*drivers.Capabilities, error) { return capabilities, nil }

// Fingerprint sends the driver's health at once, then periodically.
func (d *Driver) Fingerprint(ctx context.Context) (<-chan *drivers.Fingerprint, error) {
	ch := make(chan *drivers.Fingerprint)
	go d.fingerprintLoop(ctx, ch)
	return ch, nil
}

func (d *Driver) fingerprintLoop(ctx context.Context, ch chan<- *drivers.Fingerprint) {
	defer close(ch)
	timer := time.NewTimer(0)
	defer timer.Stop()
	var updates <-chan struct{}
	for {
		if updates == nil {
			if p := d.currentProber(); p != nil {
				updates = p.Updates()
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-d.ctx.Done():
			return
		case <-timer.C:
			timer.Reset(fingerprintPeriod)
		case <-updates:
			// A plugin appeared, went or changed health: tell Nomad now.
		}
		fp := d.buildFingerprint()
		d.clearDropped(fp)
		select {
		case ch <- fp:
		case <-ctx.Done():
			return
		case <-d.ctx.Done():
			return
		}
	}
}

// StartTask starts a task and returns the handle Nomad stores for recovery.
// A start that failed for a passing reason (a registry down, a plugin
// restarting) says it is recoverable, so that Nomad's restart policy
// starts the task again (recoverable.go); nothing else changes the error.
func (d *Driver) StartTask(cfg *drivers.TaskConfig) (*drivers.TaskHandle, *drivers.DriverNetwork, error) {
	h, n, err := d.startTask(cfg)
	if err != nil {
		return nil, nil, startError(err)
	}
	return h, n, nil
}

// startTask is StartTask; on error it leaves nothing behind but what a
// later start of the task, with this task ID or another of the same
// allocation's task, ends first (endEarlierInvocations).
func (d *Driver) startTask(cfg *drivers.TaskConfig) (*drivers.TaskHandle, *drivers.DriverNetwork, error) {
	defer d.churn.begin()()
	called := time.Now()
	if _, ok := d.tasks.Get(cfg.ID); ok {
		return nil, nil, fmt.Errorf("task with ID %q is already started", cfg.ID)
	}
	conf := d.currentConfig()
	if conf == nil || !conf.Enabled {
		return nil, nil, errors.New("the csi driver is disabled on this node: set enabled = true in the agent's config for this driver (plugin \"nomad-driver-csi\")")
	}
	// Never half-work: on a kernel without a call the tasks need, no task
	// starts (the fingerprint says the same, so Nomad places none here).
	if err := d.host.Kernel(); err != nil {
		return nil, nil, err
	}

	tc, err := decodeTaskConfig(cfg, conf)
	if err != nil {
		return nil, nil, err
	}
	// The operator's volume grants, before anything is pulled or set up
	// for the task (volumegrant.go).
	if err := checkVolumeGrants(conf.VolumeGrants, jobOf(cfg), tc.Volumes); err != nil {
		return nil, nil, fmt.Errorf("invalid task config: %w%s", err, childHint(childOf(cfg)))
	}
	// A full root_dir cannot hold the task's state: refused now, before a
	// volume is staged for it (diskfull.go).
	if err := d.rootRoom(conf, nil); err != nil {
		var full *fullError
		if errors.As(err, &full) {
			return nil, nil, fmt.Errorf("failed to start task: %w", err)
		}
		d.logger.Debug("failed to check the room left in root_dir", "error", err)
	}

	logger := d.logger.With("alloc_id", cfg.AllocID, "task_name", cfg.Name, "task_id", cfg.ID)

	// One StartTask per task ID at a time, and none while a clean-up of an
	// earlier start with this ID runs.
	release, err := d.invocations.claim(d.ctx, cfg.ID)
	if err != nil {
		return nil, nil, errors.New("the csi driver is shutting down")
	}
	defer release()
	if _, ok := d.tasks.Get(cfg.ID); ok {
		return nil, nil, fmt.Errorf("task with ID %q is already started", cfg.ID)
	}
	if err := d.endEarlierInvocations(logger, conf, cfg, len(tc.Volumes) > 0); err != nil {
		return nil, nil, err
	}

	// What the steps below set up goes again, last first, unless the task
	// is handed to Nomad.
	var u undo
	defer u.run()

	// The image is pulled (and leased) before the task's root is made.
	var img *image.Image
	if tc.Image != "" {
		if img, err = d.pullImage(logger, cfg, tc); err != nil {
			return nil, nil, err
		}
		u.push(func() { d.releaseImage(logger, cfg.ID) })
	}
	spec, err := d.buildSpec(conf, cfg, tc)
	if err != nil {
		return nil, nil, err
	}
	// A task that runs from an image passes its reference and the digest
	// its manifest resolved to (pulled above); a task that runs a host
	// binary passes none. The check sees the job's environment only: the
	// image's comes in with its root, next.
	var ti taskImage
	if img != nil {
		ti = newTaskImage(img)
	}
	grant, err := authorize(conf, cfg, tc, spec, ti)
	if err != nil {
		return nil, nil, fmt.Errorf("invalid task config: %w", err)
	}
	if grant != nil {
		logger.Info("privileged task granted", "grant", grant.String())
	}
	if shares := grantedPluginShares(conf, cfg, tc, grant); shares > spec.Limits.CPUShares {
		logger.Debug("granted plugin task weighs plugin_cpu_shares", "cpu_shares", shares, "task_cpu_shares", spec.Limits.CPUShares)
		spec.Limits.CPUShares = shares
	}
	if img != nil {
		if err := d.imageRoot(conf, cfg, tc, spec, img); err != nil {
			return nil, nil, err
		}
	}
	// Arguments and an environment the kernel would not exec are refused
	// by name, before a volume is staged for the task.
	if err := executor.CheckArgv(spec); err != nil {
		return nil, nil, fmt.Errorf("invalid task config: %w", err)
	}
	reqs, err := d.checkVolumes(cfg, tc, spec)
	if err != nil {
		return nil, nil, fmt.Errorf("invalid task config: %w", err)
	}

	pc := tc.CSIPlugin
	var reclaim bool
	if pc != nil {
		if reclaim, err = d.claimPlugin(cfg, pc); err != nil {
			return nil, nil, err
		}
		u.push(func() { d.plugins.drop(cfg.ID, pc.ID) })
		if err := preparePluginDirs(conf, pc); err != nil {
			return nil, nil, err
		}
	}
	d.eventTargets.Store(cfg.ID, cfg)
	// The task's process is set up while its volumes are staged and
	// published: they reach it last, as late mounts. Nomad's mounts go the
	// same way, unless one is bidirectional: then a spare supervisor's
	// namespace, prepared before they existed, can serve the task.
	var (
		late        func() ([]executor.Mount, error)
		volumesUp   bool
		nomadMounts []executor.Mount
	)
	if len(bidirectionalSources(spec.Mounts)) == 0 {
		nomadMounts, spec.Mounts = spec.Mounts, nil
		spec.LateMounts = append(spec.LateMounts, nomadMounts...)
	}
	if len(reqs) == 0 && len(nomadMounts) > 0 {
		late = func() ([]executor.Mount, error) { return nomadMounts, nil }
	}
	if len(reqs) > 0 {
		for _, r := range reqs {
			spec.LateMounts = append(spec.LateMounts, executor.Mount{Target: r.Destination})
		}
		type setup struct {
			mounts []executor.Mount
			err    error
		}
		ready := make(chan setup, 1)
		var writer *volumeWriter
		if !tc.Privileged {
			writer = &volumeWriter{user: spec.User, cred: spec.Credential, caps: slices.Clone(spec.Capabilities), ambient: slices.Clone(spec.AmbientCapabilities)}
		}
		go func() {
			mounts, err := d.setupVolumes(cfg, reqs, writer)
			ready <- setup{mounts, err}
		}()
		late = sync.OnceValues(func() ([]executor.Mount, error) {
			r := <-ready
			if r.err != nil {
				return nil, r.err
			}
			volumesUp = true
			return inOrderOf(spec.LateMounts, append(nomadMounts, r.mounts...))
		})
	}
	// The volumes go with what the task got; the task's event target goes
	// with them, or once the lifecycle's background retry is done (see
	// volumesReleased).
	u.push(func() {
		if volumesUp {
			if err := d.teardownVolumes(cfg.ID); err != nil {
				logger.Warn("failed to tear down volumes of a task that did not start; retrying in the background", "error", err)
				return
			}
		}
		d.eventTargets.Delete(cfg.ID)
	})
	if late != nil {
		// The process may fail before it asks for them: their set-up is
		// waited for before they are torn down.
		u.push(func() { _, _ = late() })
	}

	var pluginID string
	if pc != nil {
		pluginID = pc.ID
	}
	started, p, shared, err := d.startProcess(logger, cfg, spec, pluginID, late, len(reqs) == 0)
	if err != nil {
		return nil, nil, err
	}
	u.push(func() {
		// Kill errs on a task already gone; what Destroy leaves (a
		// cgroup, the state directory naming the task) is said: no
		// DestroyTask comes for a start that failed, and only a later
		// driver process ends the start it finds cut short.
		_ = p.Kill()
		_, _ = p.Wait(context.Background())
		if err := p.Destroy(); err != nil {
			logger.Warn("failed to clean up after a start that failed", "error", err)
		}
		d.sharedSources().release(shared)
	})

	handle := drivers.NewTaskHandle(taskHandleVersion)
	handle.Config = cfg
	handle.State = drivers.TaskStateRunning
	state := &TaskState{Process: p.State(), StartedAt: started, Plugin: pc, Volumes: len(reqs) > 0, SharedSources: shared}
	if img != nil {
		state.Image = img.Digest
		state.StopSignal = d.imageStopSignal(logger, cfg, img)
	}
	if grant.pins() {
		state.PinnedBy = grant.String()
	}
	if pc != nil {
		job := jobOf(cfg)
		state.Namespace, state.JobID = job.namespace, job.id
	}
	// The handed mark is linked while the handle's state is encoded (each
	// about 0.15 ms): both come before Nomad gets the handle, and neither
	// needs the other. From the mark on, a driver that dies leaves the
	// task to Nomad; it is taken back when the handle cannot be made.
	marked := make(chan error, 1)
	go func() { marked <- markHanded(spec.StateDir) }()
	err = handle.SetDriverState(state)
	if merr := <-marked; err == nil {
		err = merr
	} else if merr == nil {
		unmarkHanded(spec.StateDir)
	}
	if err == nil && pc != nil {
		if err = d.startPluginProbe(conf, cfg, pc, reclaim, started); err != nil {
			// Nomad gets no handle: a later driver process must not
			// count the task as Nomad's, should the undo below fail
			// to end it.
			unmarkHanded(spec.StateDir)
		}
	}
	if err != nil {
		return nil, nil, err
	}
	u.release()

	h := newTaskHandle(logger, cfg, p, started)
	h.sharedSources = shared
	h.plugin = pc
	h.volumes = len(reqs) > 0
	h.image = state.Image
	h.pinnedBy = state.PinnedBy
	h.stopSignal = state.StopSignal
	d.tasks.Set(cfg.ID, h)
	// duration is the whole StartTask: an image's pull, the volumes'
	// set-up and the process's start.
	logger.Info("task started", "pid", p.Pid(), "duration", time.Since(called).String())
	return handle, nil, nil
}

// startProcess prepares the host side of the task's mounts and starts its
// process, with late for its late mounts; on error nothing is left behind
// (but what late set up, which is the caller's). syncInvocation is unset
// for a task with volumes, whose journal names it (see writeInvocation).
func (d *Driver) startProcess(logger hclog.Logger, cfg *drivers.TaskConfig, spec *executor.Spec, pluginID string, late func() ([]executor.Mount, error), syncInvocation bool) (time.Time, taskProcess, []string, error) {
	shared := bidirectionalSources(spec.Mounts)
	if err := d.sharedSources().acquire(shared); err != nil {
		return time.Time{}, nil, nil, fmt.Errorf("failed to prepare mounts: %w", err)
	}
	if err := writeInvocation(spec.StateDir, cfg, pluginID, d.agent, syncInvocation); err != nil {
		_ = os.RemoveAll(spec.StateDir)
		d.sharedSources().release(shared)
		return time.Time{}, nil, nil, err
	}
	started := time.Now()
	p, err := d.start(logger, spec, late)
	if err != nil {
		_ = os.RemoveAll(spec.StateDir)
		d.sharedSources().release(shared)
		// The executor's errors already say the task failed to start.
		return time.Time{}, nil, nil, err
	}
	return started, p, shared, nil
}

// buildSpec turns Nomad's task config into what the executor runs.
func (d *Driver) buildSpec(conf *Config, cfg *drivers.TaskConfig, tc *TaskConfig) (*executor.Spec, error) {
	env := make([]string, 0, len(cfg.Env)+len(cfg.DeviceEnv))
	for k, v := range cfg.Env {
		env = append(env, k+"="+v)
	}
	for k, v := range cfg.DeviceEnv {
		if _, ok := cfg.Env[k]; !ok {
			env = append(env, k+"="+v)
		}
	}
	sort.Strings(env)

	// Nomad passes no host environment to an image-based driver's task.
	if !hasEnv(env, "PATH") {
		env = append(env, "PATH="+defaultTaskPath)
	}

	// Like exec's, a task starts in its root, where its local/, secrets/
	// and alloc/ directories are.
	dir := tc.WorkDir
	if dir == "" {
		dir = "/"
	}

	isolated := !tc.Privileged
	taskUser := cfg.User
	if taskUser == "" && isolated && !d.isPluginTask(cfg, tc) {
		// As Nomad's exec driver: a task that does not say runs as nobody.
		// Privileged and plugin tasks keep root.
		taskUser = "nobody"
	}
	// An image task's user is the image's, resolved in the image's own
	// /etc/passwd and /etc/group, and its ids checked there
	// (applyImageRoot). A privileged task runs as root by the operator's
	// grant (authorize): denied_host_uids and denied_host_gids are for
	// every other task, plugin tasks included.
	if tc.Image == "" {
		if isolated {
			if err := checkHostIDs(conf, userOrRoot(taskUser)); err != nil {
				return nil, fmt.Errorf("invalid task config: %w", err)
			}
		}
		if err := checkUserGroup(conf, taskUser); err != nil {
			return nil, fmt.Errorf("invalid task config: %w", err)
		}
	}

	mounts, err := taskMounts(cfg, tc)
	if err != nil {
		return nil, err
	}
	nomadMounts := slices.Clone(mounts)
	// The group's `dns` block, as exec honours it; a mount of the job's
	// own at /etc/resolv.conf wins.
	if dns, err := dnsMount(cfg, hostResolvConf); err != nil {
		return nil, err
	} else if dns != nil && !slices.ContainsFunc(mounts, func(o executor.Mount) bool { return o.Target == dns.Target }) {
		mounts = append(mounts, *dns)
	}
	tmpSize, _, _ := conf.tmpLimits()
	for _, m := range nomadDirMounts(cfg, isolated, tmpSize > 0) {
		if _, err := os.Stat(m.Source); err != nil || slices.ContainsFunc(mounts, func(o executor.Mount) bool { return o.Target == m.Target }) {
			continue
		}
		mounts = append(mounts, m)
	}
	if pc := tc.CSIPlugin; pc != nil {
		for _, m := range pluginMounts(conf, pc) {
			for _, other := range mounts {
				if other.Target == m.Target {
					return nil, fmt.Errorf("csi_plugin mount_dir %q is also the path of another mount of the task", m.Target)
				}
			}
			mounts = append(mounts, m)
		}
		env = setEnv(env, "CSI_ENDPOINT", "unix://"+filepath.Join(pc.MountDir, pluginSocketName))
	}
	for _, m := range mounts {
		if b := insideBidirectional(mounts, m.Target); b != "" {
			return nil, fmt.Errorf("mount %q lies inside the bidirectional mount %q: a mount made there appears on the host and outlives the task; give it a path outside %q", m.Target, b, b)
		}
	}

	spec := &executor.Spec{
		TaskID:       cfg.ID,
		StateDir:     conf.taskStateDir(cfg.ID),
		Command:      tc.Command,
		Args:         tc.Args,
		Env:          env,
		Dir:          dir,
		User:         taskUser,
		StdoutPath:   cfg.StdoutPath,
		StderrPath:   cfg.StderrPath,
		Privileged:   tc.Privileged,
		Mounts:       mounts,
		NetNS:        taskNetNS(cfg),
		Limits:       taskLimits(cfg),
		CgroupParent: conf.CgroupParent,
		CgroupName:   taskCgroupName(cfg),
		Supervisor:   d.shimPath(),
	}
	if cfg.Resources != nil && cfg.Resources.LinuxResources != nil {
		spec.OOMScoreAdj = int(cfg.Resources.LinuxResources.OOMScoreAdj)
	}
	// The user is resolved once, here, in the host's user database: the
	// supervisor (from a spare whose root binds chroot_env's /etc, or
	// not), the driver's checks and every `alloc exec` then take the same
	// ids. An image task's is its image's (imageRoot).
	if tc.Image == "" {
		cred, err := taskuser.Resolve(taskUser)
		if err != nil {
			return nil, fmt.Errorf("invalid task config: %w (a task's user is looked up in the host's user database; a numeric uid needs no entry)", err)
		}
		spec.Credential = &executor.Credential{UID: cred.UID, GID: cred.GID, Groups: cred.Groups}
	}
	if isolated {
		caps, added, err := taskCapabilities(conf.allowCaps(), tc.CapAdd, tc.CapDrop)
		if err != nil {
			return nil, fmt.Errorf("invalid task config: %w", err)
		}
		spec.Capabilities = caps
		if spec.Capabilities == nil {
			spec.Capabilities = []string{}
		}
		spec.AmbientCapabilities = added
		if err := conf.checkHostModes(tc); err != nil {
			return nil, fmt.Errorf("invalid task config: %w", err)
		}
		spec.Isolation = conf.isolation(tc)
		spec.Limits.PidsMax = int64(conf.PidsLimit)
		// Only the minimal /dev can be opened; the devices Nomad hands
		// over and block-device volumes are let in by the executor as
		// their nodes are bound into the task.
		spec.Limits.Devices = append([]cgroups.DeviceRule(nil), cgroups.DefaultDevices...)
		for _, m := range spec.Mounts {
			if reason := isolatedTargetReason(m.Target); reason != "" {
				return nil, fmt.Errorf("invalid task config: %s", reason)
			}
		}
		// Nomad's mounts (host volumes, its CSI volumes, devices) name
		// host paths; the driver's own are the task's directories.
		if len(nomadMounts) > 0 {
			table, err := d.mounter.List()
			if err != nil {
				return nil, fmt.Errorf("failed to read the host's mounts: %w", err)
			}
			others, mine := othersDirs(conf, cfg)
			if err := checkHostMountSources(nomadMounts, table, others, mine); err != nil {
				return nil, fmt.Errorf("invalid task config: %w", err)
			}
		}
	}
	return spec, nil
}

// taskCgroupName is the name of a task's control group: Nomad's task ID
// ("alloc/task/invocation"), kept readable in the cgroup tree without the
// slashes.
func taskCgroupName(cfg *drivers.TaskConfig) string { return strings.ReplaceAll(cfg.ID, "/", ".") }

// defaultTaskPath is a task's PATH when its environment has none.
const defaultTaskPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

func hasEnv(env []string, key string) bool {
	return slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, key+"=") })
}

// userOrRoot names the user a task runs as for the denied_host_uids check.
func userOrRoot(u string) string {
	if u == "" {
		return "root"
	}
	return u
}

// isPluginTask reports whether a task serves a CSI plugin: this driver's
// csi_plugin block, or Nomad's task-level csi_plugin block.
func (d *Driver) isPluginTask(cfg *drivers.TaskConfig, tc *TaskConfig) bool {
	return tc.CSIPlugin != nil || nomadPluginTask(cfg)
}

// resetSparesDir makes dir empty: the roots of spares of an earlier run
// are left over only when one died early.
func resetSparesDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		// Empty directories only (rmdir(2)): never a file, a symlink
		// (not followed either way) or anything in a directory.
		_ = unix.Rmdir(filepath.Join(dir, e.Name()))
	}
	return nil
}

// setEnv sets KEY=value in a KEY=VALUE list, replacing an earlier value.
func setEnv(env []string, key, value string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, key+"=") {
			out = append(out, kv)
		}
	}
	return append(out, key+"="+value)
}

// taskMounts turns the mounts and devices Nomad asks for into the
// executor's bind mounts.
func taskMounts(cfg *drivers.TaskConfig, tc *TaskConfig) ([]executor.Mount, error) {
	var out []executor.Mount
	seen := map[string]bool{}
	for _, m := range cfg.Mounts {
		if m == nil {
			continue
		}
		if !filepath.IsAbs(m.TaskPath) {
			return nil, fmt.Errorf("mount %q: the task path must be absolute", m.TaskPath)
		}
		if !filepath.IsAbs(m.HostPath) {
			return nil, fmt.Errorf("mount %q: the host path %q must be absolute", m.TaskPath, m.HostPath)
		}
		prop := m.PropagationMode
		switch prop {
		case "", executor.PropagationPrivate:
			prop = executor.PropagationPrivate
		case executor.PropagationHostToTask:
			// A mount the host makes under the source later reaches the
			// task as a copy of the host's mount, with the host's flags:
			// writable, whatever the mount it lands under is. The kernel
			// has no read-only that reaches mounts yet to come (the
			// kubelet's recursive read-only refuses propagation for the
			// same reason). A privileged task could remount anyway.
			if m.Readonly && !tc.Privileged {
				return nil, fmt.Errorf("mount %q: propagation_mode \"host-to-task\" cannot keep a read-only mount read-only: a mount the host makes under %q later would be writable in the task; use propagation_mode \"private\" (the default), or a volume that is not read-only", m.TaskPath, m.HostPath)
			}
		case executor.PropagationBidirectional:
			if !tc.Privileged {
				return nil, fmt.Errorf("mount %q: propagation_mode \"bidirectional\" needs privileged = true in the task config, because mounts the task makes there appear on the host", m.TaskPath)
			}
		default:
			return nil, fmt.Errorf("mount %q: propagation_mode %q is not one of \"private\", \"host-to-task\" or \"bidirectional\"", m.TaskPath, prop)
		}
		target := filepath.Clean(m.TaskPath)
		if target == "/dev" && filepath.Clean(m.HostPath) == "/dev" && !tc.Privileged {
			// Nomad's plugin supervisor hands every plugin task the host's
			// /dev; a task that is not privileged keeps its minimal one.
			continue
		}
		if seen[target] {
			return nil, fmt.Errorf("mount %q: two mounts have the same task path", target)
		}
		seen[target] = true
		out = append(out, executor.Mount{
			Source:      filepath.Clean(m.HostPath),
			Target:      target,
			ReadOnly:    m.Readonly,
			Propagation: prop,
		})
	}
	for _, dev := range cfg.Devices {
		if dev == nil {
			continue
		}
		if !filepath.IsAbs(dev.TaskPath) || !filepath.IsAbs(dev.HostPath) {
			return nil, fmt.Errorf("device %q: host and task paths must be absolute", dev.TaskPath)
		}
		target := filepath.Clean(dev.TaskPath)
		if seen[target] {
			return nil, fmt.Errorf("device %q: the task path is already used by a mount", target)
		}
		seen[target] = true
		out = append(out, executor.Mount{
			Source:      filepath.Clean(dev.HostPath),
			Target:      target,
			ReadOnly:    dev.Permissions != "" && !strings.ContainsRune(dev.Permissions, 'w'),
			Propagation: executor.PropagationPrivate,
		})
	}
	return out, nil
}

// insideBidirectional is the target of the bidirectional mount of mounts
// that holds target strictly below it, "" for none. A mount made inside a
// bidirectional one is made in a peer of the host's source: the kernel
// copies it to the host, where it stays after the task (and keeps what it
// mounts busy), whatever its own propagation.
func insideBidirectional(mounts []executor.Mount, target string) string {
	for _, b := range mounts {
		if b.Propagation == executor.PropagationBidirectional && b.Target != target &&
			(b.Target == "/" || strings.HasPrefix(target, b.Target+"/")) {
			return b.Target
		}
	}
	return ""
}

// taskLimits turns the task's `resources` into cgroup limits.
func taskLimits(cfg *drivers.TaskConfig) cgroups.Limits {
	var l cgroups.Limits
	if cfg.Resources == nil {
		return l
	}
	if lr := cfg.Resources.LinuxResources; lr != nil {
		l.MemoryBytes = lr.MemoryLimitBytes
		l.CPUShares = lr.CPUShares
		l.CPUQuota = lr.CPUQuota
		l.CPUPeriod = lr.CPUPeriod
		l.CpusetCpus = lr.CpusetCpus
		l.CpusetCgroupPath = lr.CpusetCgroupPath
	}
	if nr := cfg.Resources.NomadResources; nr != nil {
		const mib = 1024 * 1024
		if nr.Memory.MemoryMaxMB > 0 && nr.Memory.MemoryMaxMB > nr.Memory.MemoryMB {
			// memory_max: memory is the soft target, memory_max the hard cap.
			l.MemoryBytes = nr.Memory.MemoryMaxMB * mib
			l.MemoryReservationBytes = nr.Memory.MemoryMB * mib
		} else if l.MemoryBytes == 0 && nr.Memory.MemoryMB > 0 {
			l.MemoryBytes = nr.Memory.MemoryMB * mib
		}
	}
	return l
}

// checkRootPropagation says, once, when root_dir is not on a shared mount.
// Plugins this driver launches work either way (it makes the stage root a
// shared mount point of its own), but a plugin run by another driver or by
// systemd only sees what it mounts under the stage root if the host's
// mounts propagate to it.
func (d *Driver) checkRootPropagation(cfg *Config) {
	mounts, err := d.mounter.List()
	if err != nil {
		return
	}
	mp, ok := mounter.FindMount(mounts, cfg.RootDir)
	if !ok || mp.Shared {
		return
	}
	d.logger.Warn("root_dir is on a mount without shared propagation: plugins from plugin_socket_dirs will not see what they mount under the stage root; plugins this driver launches are not affected",
		"root_dir", cfg.RootDir, "mount", mp.Path, "propagation", mp.Propagation(),
		"fix", "mount --make-rshared "+mp.Path)
}

// recoveredSharedSources lists the bidirectional sources of a task started
// by an earlier driver process, from the mounts Nomad stored with it.
func recoveredSharedSources(cfg *drivers.TaskConfig) []string {
	var out []string
	for _, m := range cfg.Mounts {
		if m != nil && m.PropagationMode == executor.PropagationBidirectional {
			out = append(out, filepath.Clean(m.HostPath))
		}
	}
	return out
}

// RecoverTask takes back a task after the driver restarted.
func (d *Driver) RecoverTask(handle *drivers.TaskHandle) error {
	if handle == nil {
		return errors.New("failed to recover task: handle is nil")
	}
	if handle.Config == nil {
		return errors.New("failed to recover task: handle has no task config")
	}
	if _, ok := d.tasks.Get(handle.Config.ID); ok {
		return nil
	}
	defer d.churn.begin()()
	// Not while the dangling-task reconciler ends the task (dangling.go).
	release, err := d.invocations.claim(d.ctx, handle.Config.ID)
	if err != nil {
		return errors.New("the csi driver is shutting down")
	}
	defer release()
	if _, ok := d.tasks.Get(handle.Config.ID); ok {
		return nil
	}
	if d.invocations.wasDangling(handle.Config.ID) {
		// Ended whole: nothing of it is left to take back or release.
		return fmt.Errorf("failed to recover task %q: the driver ended it as a dangling task, since Nomad had not recovered it within dangling_tasks' grace of the driver's start (raise the grace if the agent restores its allocations more slowly)", handle.Config.ID)
	}
	var st TaskState
	if err := handle.GetDriverState(&st); err != nil {
		return fmt.Errorf("failed to decode task state for task %q: %w", handle.Config.ID, err)
	}
	logger := d.logger.With("alloc_id", handle.Config.AllocID, "task_name", handle.Config.Name, "task_id", handle.Config.ID)
	// After an agent restart the handle's config has no driver config to
	// decode (Nomad does not persist it): the task state says what the
	// task held. A handle that still has it (same agent process) may add
	// to that.
	volumes, pc := st.Volumes, st.Plugin
	var tc TaskConfig
	if err := handle.Config.DecodeDriverConfig(&tc); err == nil {
		volumes = volumes || len(tc.Volumes) > 0
		if pc == nil {
			pc = tc.CSIPlugin
		}
	}
	job := jobOf(handle.Config)
	if st.JobID != "" {
		job = jobRef{namespace: st.Namespace, id: st.JobID}
	}
	if conf := d.currentConfig(); conf != nil && st.Process.Profile != nil && st.Process.Profile.Privileged && !grantsJob(conf.PrivilegedGrants, job) {
		// Started before the driver had grants, or before the operator
		// removed the job's: taken back as it is, refused at its next start.
		logger.Warn("recovered a privileged task that no privileged_grant matches; it runs on until it is stopped, and is refused at its next start", "namespace", job.namespace, "job_id", job.id)
	}
	if conf := d.currentConfig(); pc != nil && conf != nil {
		if why := reservedFromJob(conf.PrivilegedGrants, pc.ID, job); why != "" {
			// The task runs on (Nomad stops it), serving nothing: the
			// id stays the granted job's.
			logger.Warn("recovered task does not get back its plugin id", "plugin_id", pc.ID, "reason", why)
			d.emitEvent(handle.Config, fmt.Sprintf("Plugin %q not served by this task after the driver restarted: %s", pc.ID, why), nil)
			pc = nil
		}
	}
	p, err := d.recover(logger, st.Process)
	// Nomad has decided on the task either way: it is no longer waited for.
	defer d.invocations.settled(handle.Config.ID)
	if err != nil {
		// Nomad starts the task afresh; what this one held goes now. Its
		// plugin id stays its job's for the restart.
		d.forgetLostTask(logger, handle.Config, volumes)
		if st.Image != "" {
			d.releaseImage(logger, handle.Config.ID)
		}
		if pc != nil && d.plugins.claimGone(handle.Config, *pc, job) {
			d.scheduleForget(handle.Config.ID, pc)
		}
		return fmt.Errorf("failed to recover task %q: %w", handle.Config.ID, err)
	}
	h := newTaskHandle(logger, handle.Config, p, st.StartedAt)
	h.sharedSources = st.SharedSources
	if h.sharedSources == nil {
		// State written before SharedSources was kept.
		h.sharedSources = recoveredSharedSources(handle.Config)
	}
	d.eventTargets.Store(handle.Config.ID, handle.Config)
	h.volumes = volumes
	if h.image = st.Image; h.image != "" {
		d.recoverImage(logger, handle.Config, st.Image)
	}
	h.pinnedBy = st.PinnedBy
	h.stopSignal = st.StopSignal
	d.sharedSources().adopt(h.sharedSources)
	if pc != nil {
		h.plugin = pc
		if conf := d.currentConfig(); conf != nil {
			// The task held the id before the restart: it takes it back
			// over a socket that appeared since.
			if _, err := d.plugins.claim(handle.Config, *pc, job); err != nil {
				logger.Warn("failed to take back the plugin", "plugin_id", pc.ID, "error", err)
			} else if err := d.startPluginProbe(conf, handle.Config, pc, true, st.StartedAt); err != nil {
				logger.Warn("failed to probe the plugin", "plugin_id", pc.ID, "error", err)
			}
		}
	}
	d.tasks.Set(handle.Config.ID, h)
	if conf := d.currentConfig(); conf != nil {
		// The running agent has it now: a driver process started anew
		// under this agent leaves it to Nomad (dangling.go).
		if err := restampInvocation(conf.taskStateDir(handle.Config.ID), d.agent); err != nil {
			logger.Warn("failed to record the agent that recovered the task", "error", err)
		}
	}
	logger.Info("task recovered", "pid", p.Pid())
	return nil
}

// WaitTask returns a channel that receives the task's exit result once.
func (d *Driver) WaitTask(ctx context.Context, taskID string) (<-chan *drivers.ExitResult, error) {
	h, ok := d.tasks.Get(taskID)
	if !ok {
		return nil, drivers.ErrTaskNotFound
	}
	return h.waitExit(nil, ctx, d.ctx), nil
}

// waitTask is WaitTask with the result passed through clean.
func (d *Driver) waitTask(ctx context.Context, taskID string, clean func(*drivers.ExitResult) *drivers.ExitResult) (<-chan *drivers.ExitResult, error) {
	h, ok := d.tasks.Get(taskID)
	if !ok {
		return nil, drivers.ErrTaskNotFound
	}
	return h.waitExit(clean, ctx, d.ctx), nil
}

// StopTask sends the task its kill signal and kills it after timeout.
func (d *Driver) StopTask(taskID string, timeout time.Duration, signal string) error {
	// A stop under way is not quiet: the heap's return waits for it.
	defer d.churn.begin()()
	h, ok := d.tasks.Get(taskID)
	if !ok {
		return drivers.ErrTaskNotFound
	}
	h.stopping.Store(true)
	if h.exited() {
		return nil
	}
	// Nomad passes the task's kill_signal, "" when the job sets none: then
	// the image's STOPSIGNAL, as Docker (and Nomad's docker driver) stops
	// a container, and otherwise SIGINT, as exec.
	if signal == "" {
		signal = h.stopSignal
	}
	if signal == "" {
		signal = "SIGINT"
	}
	sig, err := parseSignal(signal)
	if err != nil {
		return err
	}
	if h.plugin != nil {
		d.awaitPluginTeardowns(h)
	}
	if err := h.process.Shutdown(sig, timeout); err != nil {
		return fmt.Errorf("failed to stop task: %w", err)
	}
	return nil
}

// DestroyTask forgets a task, killing it first when force is set.
func (d *Driver) DestroyTask(taskID string, force bool) error {
	defer d.churn.begin()()
	h, ok := d.tasks.Get(taskID)
	if !ok {
		return drivers.ErrTaskNotFound
	}
	if !h.exited() {
		if !force {
			return errors.New("cannot destroy a running task: stop it first or destroy with force")
		}
		if err := h.process.Kill(); err != nil {
			h.logger.Warn("failed to kill task", "error", err)
		}
		select {
		case <-h.done:
		case <-time.After(destroyWait):
			return fmt.Errorf("task %q did not exit within %s of being killed", taskID, destroyWait)
		}
	}
	// Nomad may destroy a task from two places at once; what the task holds
	// (its references on shared mount points, its plugin id, its volumes)
	// must be let go exactly once, or another task loses a shared mount
	// point it still uses.
	h.destroyMu.Lock()
	defer h.destroyMu.Unlock()
	if h.destroyed {
		return nil
	}
	if err := h.process.Destroy(); err != nil {
		return fmt.Errorf("failed to clean up task %q: %w", taskID, err)
	}
	h.destroyed = true
	d.sharedSources().release(h.sharedSources)
	if h.plugin != nil {
		d.stopPluginProbe(taskID, h.plugin)
	}
	d.releaseVolumes(h)
	if h.image != "" {
		d.releaseImage(h.logger, taskID)
	}
	d.tasks.Delete(taskID)
	d.churn.destroyed()
	return nil
}

// InspectTask reports the task's status.
func (d *Driver) InspectTask(taskID string) (*drivers.TaskStatus, error) {
	h, ok := d.tasks.Get(taskID)
	if !ok {
		return nil, drivers.ErrTaskNotFound
	}
	return h.status(), nil
}

// TaskEvents streams task events to Nomad.
func (d *Driver) TaskEvents(ctx context.Context) (<-chan *drivers.TaskEvent, error) {
	return d.eventer.TaskEvents(ctx)
}

// emitEvent sends an event that `nomad alloc status` shows for the task.
func (d *Driver) emitEvent(cfg *drivers.TaskConfig, msg string, annotations map[string]string) {
	err := d.eventer.EmitEvent(&drivers.TaskEvent{
		TaskID:      cfg.ID,
		TaskName:    cfg.Name,
		AllocID:     cfg.AllocID,
		Timestamp:   time.Now(),
		Message:     msg,
		Annotations: annotations,
	})
	if err != nil {
		d.logger.Warn("failed to emit task event", "task_id", cfg.ID, "error", err)
	}
}

// SignalTask sends a signal to the task's main process.
func (d *Driver) SignalTask(taskID string, signal string) error {
	h, ok := d.tasks.Get(taskID)
	if !ok {
		return drivers.ErrTaskNotFound
	}
	sig, err := parseSignal(signal)
	if err != nil {
		return err
	}
	return h.process.Signal(sig)
}

// ExecTask runs a command in the task and collects its output (script checks).
func (d *Driver) ExecTask(taskID string, cmd []string, timeout time.Duration) (*drivers.ExecTaskResult, error) {
	h, ok := d.tasks.Get(taskID)
	if !ok {
		return nil, drivers.ErrTaskNotFound
	}
	if len(cmd) == 0 {
		return nil, errors.New("exec: command must not be empty")
	}
	if err := h.execRefused(); err != nil {
		return nil, err
	}
	ctx := d.ctx
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	// Nomad runs script checks here, with the job's command: what it
	// writes is kept to the end Nomad's own executor keeps, whatever its
	// length, not in the driver's memory.
	stdout, stderr := newTailBuffer(drivers.CheckBufSize), newTailBuffer(drivers.CheckBufSize)
	code, err := h.process.Exec(ctx, executor.ExecOptions{
		Command: cmd,
		Stdin:   bytes.NewReader(nil),
		Stdout:  stdout,
		Stderr:  stderr,
	})
	if err != nil {
		return nil, fmt.Errorf("exec in task failed: %w", err)
	}
	return &drivers.ExecTaskResult{
		Stdout:     stdout.Bytes(),
		Stderr:     stderr.Bytes(),
		ExitResult: &drivers.ExitResult{ExitCode: code},
	}, nil
}

// ExecTaskStreaming runs a command in the task with streamed I/O (nomad alloc exec).
func (d *Driver) ExecTaskStreaming(ctx context.Context, taskID string, opts *drivers.ExecOptions) (*drivers.ExitResult, error) {
	h, ok := d.tasks.Get(taskID)
	if !ok {
		return nil, drivers.ErrTaskNotFound
	}
	if len(opts.Command) == 0 {
		return nil, errors.New("exec: command must not be empty")
	}
	if err := h.execRefused(); err != nil {
		return nil, err
	}
	var resize chan executor.TerminalSize
	if opts.ResizeCh != nil {
		resize = make(chan executor.TerminalSize, 1)
		go func() {
			defer close(resize)
			for {
				select {
				case s, ok := <-opts.ResizeCh:
					if !ok {
						return
					}
					select {
					case resize <- executor.TerminalSize{Height: s.Height, Width: s.Width}:
					case <-ctx.Done():
						return
					}
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	eo := executor.ExecOptions{Command: opts.Command, Tty: opts.Tty, Resize: resize}
	if opts.Stdin != nil {
		eo.Stdin = opts.Stdin
	}
	if opts.Stdout != nil {
		eo.Stdout = opts.Stdout
	}
	if opts.Stderr != nil {
		eo.Stderr = opts.Stderr
	}
	code, err := h.process.Exec(ctx, eo)
	if err != nil {
		return nil, err
	}
	return &drivers.ExitResult{ExitCode: code}, nil
}

// signalAliases are the names Nomad takes for a signal (consul-template's
// signals.SignalLookup, where exec looks kill_signal up and a template's
// change_signal is checked) that the kernel's list does not hold.
var signalAliases = map[string]syscall.Signal{
	"SIGIOT": unix.SIGIOT,
	// Delivers nothing: it only checks that the task is there.
	"SIGNULL": 0,
}

// imageStopSignal is the signal img asks to be stopped with (its
// STOPSIGNAL) as parseSignal takes it, "" for none. It takes what Docker
// takes: a name with or without SIG, in any case ("SIGTERM", "quit"), a
// real-time signal by name ("SIGRTMIN+3", "RTMAX-1", as systemd images
// ask) and a number ("15", "37"). Signal 0 (which delivers nothing), the
// C library's own real-time signals (32 and 33) and numbers past the
// last signal are not signals to stop with: they, like a name the driver
// does not know, are told to the task's events and left out, and the task
// stops with its kill_signal, or SIGINT. Any signal it takes ends the task
// within its kill_timeout: one the task ignores, or SIGSTOP, is followed by
// SIGKILL to the whole task.
func (d *Driver) imageStopSignal(logger hclog.Logger, cfg *drivers.TaskConfig, img *image.Image) string {
	s := strings.TrimSpace(img.Config.StopSignal)
	if s == "" {
		return ""
	}
	if n, err := strconv.Atoi(s); err == nil {
		// Docker takes a number too ("STOPSIGNAL 9").
		if name := signalName(syscall.Signal(n)); n > 0 && name != "" {
			return name
		}
	} else if sig, err := parseSignal(strings.ToUpper(s)); err == nil && sig != 0 {
		return signalName(sig)
	}
	// The image's string, up to its configuration's 8 MiB, is cut short:
	// the event goes into the allocation Nomad keeps.
	logger.Warn("the image's STOPSIGNAL is not a signal the driver knows; the task stops with its kill_signal or SIGINT", "image", img.Ref, "stop_signal", shortQuote(s))
	d.emitEvent(cfg, fmt.Sprintf("Image %s asks to be stopped with %s, which is not a signal this driver knows: the task stops with its kill_signal, or SIGINT; set kill_signal in the task", img.Ref, shortQuote(s)), map[string]string{"image": img.Ref})
	return ""
}

// parseSignal turns "SIGTERM" (or "TERM") into a signal.
func parseSignal(name string) (syscall.Signal, error) {
	if name == "" {
		return 0, errors.New("signal must not be empty")
	}
	if s, ok := signalAliases[name]; ok {
		return s, nil
	}
	s := unix.SignalNum(name)
	if s == 0 {
		s = unix.SignalNum("SIG" + name)
	}
	if s == 0 {
		s = rtSignal(strings.TrimPrefix(name, "SIG"))
	}
	if s == 0 {
		return 0, fmt.Errorf("unknown signal %q: use a name such as \"SIGTERM\"", name)
	}
	return s, nil
}

// The real-time signals a task may be sent: the kernel's from 32 to 64,
// less the two the C library keeps for itself (its SIGRTMIN is 34), as
// Docker and the C library name them.
const (
	sigRTMin = 34
	sigRTMax = 64
)

// rtSignal is the real-time signal "RTMIN", "RTMIN+n", "RTMAX" or
// "RTMAX-n" names (n in decimal, within sigRTMin..sigRTMax), 0 for none.
func rtSignal(name string) syscall.Signal {
	var base, sign int
	var rest, op string
	switch {
	case strings.HasPrefix(name, "RTMIN"):
		base, sign, rest, op = sigRTMin, 1, name[len("RTMIN"):], "+"
	case strings.HasPrefix(name, "RTMAX"):
		base, sign, rest, op = sigRTMax, -1, name[len("RTMAX"):], "-"
	default:
		return 0
	}
	n := 0
	if rest != "" {
		off, ok := strings.CutPrefix(rest, op)
		if !ok || off == "" || len(off) > 2 || strings.Trim(off, "0123456789") != "" {
			return 0
		}
		n, _ = strconv.Atoi(off)
	}
	sig := base + sign*n
	if sig < sigRTMin || sig > sigRTMax {
		return 0
	}
	return syscall.Signal(sig)
}

// signalName is the name parseSignal takes for sig ("SIGTERM",
// "SIGRTMIN+3"), "" for a signal 0 or one a task may not be sent.
func signalName(sig syscall.Signal) string {
	if sig >= sigRTMin && sig <= sigRTMax {
		if n := int(sig) - sigRTMin; n > 0 {
			return fmt.Sprintf("SIGRTMIN+%d", n)
		}
		return "SIGRTMIN"
	}
	return unix.SignalName(sig)
}

// goBackground runs f in a goroutine that Shutdown waits for, unless the
// driver is shut down already.
func (d *Driver) goBackground(f func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctx.Err() != nil {
		return
	}
	d.background.Add(1)
	go func() {
		defer d.background.Done()
		f()
	}()
}

// Shutdown stops the driver's background work. Tasks keep running.
func (d *Driver) Shutdown() {
	d.mu.Lock()
	d.cancel()
	d.mu.Unlock()
	d.background.Wait()
	d.telemetry.endpoint.Close()
	d.vols.mu.Lock()
	if d.vols.manager != nil {
		// Syncs what the journal has not synced yet.
		d.vols.manager.Close()
	}
	d.vols.mu.Unlock()
	d.spares.Close()
	if p := d.currentProber(); p != nil {
		p.Close()
	}
}
