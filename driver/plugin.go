package driver

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
)

// pluginForgetAfter is how long a plugin whose task is gone stays listed
// (unhealthy) before the driver forgets it, unless a new task takes it.
// Nomad restarts a failed plugin task within this time.
const pluginForgetAfter = 5 * time.Minute

// pluginTasks tracks which task serves which CSI plugin id on this node.
type pluginTasks struct {
	mu sync.Mutex
	// byID maps a plugin id to the task serving it.
	byID map[string]*pluginTask
}

type pluginTask struct {
	config *drivers.TaskConfig
	plugin PluginTaskConfig
	// job is the task's job: a later task of the same job takes the id
	// back (Nomad restarting or updating the plugin).
	job jobRef
	// gone is set once the task was destroyed; the plugin stays listed
	// until a new task takes the id or pluginForgetAfter passes.
	gone bool
	// prev is the record this claim replaced, put back by drop.
	prev *pluginTask
}

func newPluginTasks() *pluginTasks { return &pluginTasks{byID: map[string]*pluginTask{}} }

// claim reserves a plugin id for a task, refusing an id a live task
// serves. It reports whether the task takes back an id its own job (or
// the task itself) held: the task the claim replaces was of the same job.
func (p *pluginTasks) claim(cfg *drivers.TaskConfig, pc PluginTaskConfig, job jobRef) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	cur, ok := p.byID[pc.ID]
	if ok && !cur.gone && cur.config.ID != cfg.ID {
		return false, fmt.Errorf("csi_plugin id %q is already served on this node by task %q of allocation %s: give each plugin task its own id",
			pc.ID, cur.config.Name, cur.config.AllocID)
	}
	if ok {
		// One record back is enough to undo this claim.
		cur.prev = nil
	}
	p.byID[pc.ID] = &pluginTask{config: cfg, plugin: pc, job: job, prev: cur}
	return ok && (cur.config.ID == cfg.ID || cur.job == job), nil
}

// claimGone records a plugin task that is gone already (one that could
// not be recovered after a restart), so that its job's next task takes
// the id back as if the driver had never stopped. It does not replace a
// claim of another task.
func (p *pluginTasks) claimGone(cfg *drivers.TaskConfig, pc PluginTaskConfig, job jobRef) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.byID[pc.ID]; ok {
		return false
	}
	p.byID[pc.ID] = &pluginTask{config: cfg, plugin: pc, job: job, gone: true}
	return true
}

// job returns the job of the task serving or last serving a plugin id,
// when that is taskID.
func (p *pluginTasks) job(id, taskID string) (jobRef, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	cur, ok := p.byID[id]
	if !ok {
		return jobRef{}, false
	}
	if cur.config.ID != taskID {
		// A new task claimed the id and is starting; the prober still
		// lists the one it replaces.
		if cur.prev == nil || cur.prev.config.ID != taskID {
			return jobRef{}, false
		}
		return cur.prev.job, true
	}
	return cur.job, true
}

// release marks a task's plugin as gone and reports whether the task
// still owned it.
func (p *pluginTasks) release(taskID, id string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	cur, ok := p.byID[id]
	if !ok || cur.config.ID != taskID {
		return false
	}
	cur.gone = true
	return true
}

// forget drops a gone plugin that no task took since.
func (p *pluginTasks) forget(taskID, id string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	cur, ok := p.byID[id]
	if !ok || cur.config.ID != taskID || !cur.gone {
		return false
	}
	delete(p.byID, id)
	return true
}

// drop undoes a claim whose task never started, putting back the record
// of the gone task it replaced.
func (p *pluginTasks) drop(taskID, id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if cur, ok := p.byID[id]; ok && cur.config.ID == taskID {
		if cur.prev != nil && cur.prev.gone && cur.prev.config.ID != taskID {
			p.byID[id] = cur.prev
		} else {
			delete(p.byID, id)
		}
	}
}

func (p *pluginTasks) task(id string) (*drivers.TaskConfig, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	cur, ok := p.byID[id]
	if !ok || cur.gone {
		return nil, false
	}
	return cur.config, true
}

// socketPeer is the check of the process listening on a socket the driver
// dials (csiclient.Options.Peer), nil for a socket that is not a plugin
// task's (plugin_socket_dirs, the operator's): the listener on
// root_dir/plugins/<id>/csi.sock must be a process of the task that serves
// id, in its control group. Every privileged task sees the host's files,
// and one whose program takes its socket from a flag (--endpoint), as most
// plugins remove a stale socket before they listen, would otherwise listen
// in another plugin's place and get its calls, volume secrets included.
func (d *Driver) socketPeer(socket string) func(pid int32) error {
	conf := d.currentConfig()
	if conf == nil || filepath.Base(socket) != pluginSocketName {
		return nil
	}
	dir := filepath.Dir(socket)
	id := filepath.Base(dir)
	if filepath.Clean(socket) != conf.pluginSocket(id) {
		return nil
	}
	return func(pid int32) error {
		cfg, ok := d.plugins.task(id)
		if !ok {
			return fmt.Errorf("no task serves csi_plugin %q on this node, and process %d listens on its socket", id, pid)
		}
		return inTaskCgroup(pid, taskCgroupNames(cfg)...)
	}
}

// grantedPluginShares is the least CPU weight (cpu.shares, the unit of a
// task's cpu) of a task that serves a CSI plugin the operator granted:
// plugin_cpu_shares. A node's plugins are its infrastructure: every volume
// task's start and stop waits on their calls, and on a busy node a plugin
// that weighs as its few hundred MHz waits for a CPU behind the tasks it
// serves. Granted means a privileged plugin task (its privileged_grant
// matched) or one serving an id a privileged_grant reserves (authorize
// refused it otherwise): the operator named the job. 0 for any other
// task: a job writes its own csi_plugin block, and a weight above its cpu
// would take CPU from the node's other tasks whenever the CPUs are busy.
// The weight is a share under contention, never a cap: cpu_hard_limit's
// quota and the memory limits stay the task's.
func grantedPluginShares(conf *Config, cfg *drivers.TaskConfig, tc *TaskConfig, grant *PrivilegedGrant) int64 {
	id, ok := "", false
	if tc.CSIPlugin != nil {
		id, ok = tc.CSIPlugin.ID, true
	} else {
		id, ok = nomadPluginID(cfg)
	}
	if !ok || conf.PluginCPUShares == 0 {
		return 0
	}
	if grant == nil && len(reserving(conf.PrivilegedGrants, id)) == 0 {
		return 0
	}
	return int64(conf.PluginCPUShares)
}

// taskCgroupNames are the names a task's control group can have: the
// driver's own (taskCgroupName, under cgroup_parent), and on cgroup v2 the
// scope Nomad laid out for the task (nomad.slice/share.slice/ALLOC.TASK.scope
// or reserve.slice), where the task goes when Nomad manages cgroups.
// Only Nomad and the driver, as root, make groups of these names.
func taskCgroupNames(cfg *drivers.TaskConfig) []string {
	names := []string{taskCgroupName(cfg)}
	if cfg.Resources != nil && cfg.Resources.LinuxResources != nil {
		if p := cfg.Resources.LinuxResources.CpusetCgroupPath; strings.HasSuffix(p, ".scope") {
			names = append(names, filepath.Base(p))
		}
	}
	return names
}

// inTaskCgroup checks that process pid is in a control group of one of
// names (a task's, taskCgroupNames), or one below it, in some hierarchy.
func inTaskCgroup(pid int32, names ...string) error {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return fmt.Errorf("cannot read the control group of process %d listening on the socket: %w", pid, err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		elems := strings.Split(parts[2], "/")
		for _, name := range names {
			if slices.Contains(elems, name) {
				return nil
			}
		}
	}
	return fmt.Errorf("process %d listening on the socket is not the plugin task's (control group %q): another task took the socket's path", pid, strings.Join(names, `" or "`))
}

// pluginMounts are the mounts a plugin task gets: its socket directory at
// mount_dir and, for node and monolith plugins, the stage/publish root at
// its own path with bidirectional propagation.
func pluginMounts(conf *Config, pc *PluginTaskConfig) []executor.Mount {
	// mount_dir clean: compared with the task's other mounts, which are,
	// "/secrets/" as the job wrote it would pass for another directory.
	mounts := []executor.Mount{{
		Source:      conf.pluginSocketDir(pc.ID),
		Target:      filepath.Clean(pc.MountDir),
		Propagation: executor.PropagationPrivate,
	}}
	if pc.Type != PluginTypeController {
		mounts = append(mounts, executor.Mount{
			Source:      conf.stageRoot(),
			Target:      conf.stageRoot(),
			Propagation: executor.PropagationBidirectional,
		})
	}
	return mounts
}

// preparePluginDirs makes the plugin's socket directory and the stage root,
// and removes a socket left by an earlier run of the plugin (most plugins
// refuse to listen on an existing path).
func preparePluginDirs(conf *Config, pc *PluginTaskConfig) error {
	if err := os.MkdirAll(conf.pluginSocketDir(pc.ID), 0o700); err != nil {
		return fmt.Errorf("failed to create the plugin's socket directory: %w", err)
	}
	if err := os.MkdirAll(conf.stageRoot(), 0o700); err != nil {
		return fmt.Errorf("failed to create the stage root %q: %w", conf.stageRoot(), err)
	}
	sock := conf.pluginSocket(pc.ID)
	if fi, err := os.Lstat(sock); err == nil && fi.Mode()&os.ModeSocket != 0 {
		if err := os.Remove(sock); err != nil {
			return fmt.Errorf("failed to remove the stale socket %q: %w", sock, err)
		}
	}
	return nil
}

// startPluginProbe starts fingerprinting a launched plugin, started at
// started: until its health_timeout has passed since, it is starting, not
// unhealthy. With reclaim the task takes back an id it or its job held
// (see claimPlugin).
func (d *Driver) startPluginProbe(conf *Config, cfg *drivers.TaskConfig, pc *PluginTaskConfig, reclaim bool, started time.Time) error {
	// The id was claimed, so a task still listed for it is gone: this task
	// replaces it (Nomad restarting a plugin task). A reclaim replaces it
	// in Add, so that no socket owns the id in between.
	if st, ok := d.prober.Get(pc.ID); !reclaim && ok && st.Source == fingerprint.SourceTask && st.TaskID != cfg.ID {
		d.prober.Remove(pc.ID)
	}
	err := d.prober.Add(fingerprint.PluginSpec{
		ID:      pc.ID,
		Type:    fingerprint.PluginType(pc.Type),
		Socket:  conf.pluginSocket(pc.ID),
		TaskID:  cfg.ID,
		Source:  fingerprint.SourceTask,
		Reclaim: reclaim,

		StartingUntil: started.Add(pc.healthTimeout()),
	})
	if err != nil {
		return fmt.Errorf("csi_plugin %q: %w", pc.ID, err)
	}
	return nil
}

// stopPluginProbe is called when a plugin task is destroyed: the plugin
// stays listed, unhealthy, so that jobs constrained on it are not placed,
// and is forgotten after pluginForgetAfter unless a new task takes it.
func (d *Driver) stopPluginProbe(taskID string, pc *PluginTaskConfig) {
	if !d.plugins.release(taskID, pc.ID) {
		return
	}
	d.scheduleForget(taskID, pc)
}

// scheduleForget forgets a gone plugin task after pluginForgetAfter,
// unless a new task took its id.
func (d *Driver) scheduleForget(taskID string, pc *PluginTaskConfig) {
	time.AfterFunc(pluginForgetAfter, func() {
		if d.plugins.forget(taskID, pc.ID) {
			if p := d.currentProber(); p != nil {
				if st, ok := p.Get(pc.ID); ok && st.Source == fingerprint.SourceTask && st.TaskID == taskID {
					p.Remove(pc.ID)
				}
			}
		}
	})
}

// onPluginHealth turns a plugin's health change into an event on the task
// that serves it.
func (d *Driver) onPluginHealth(id string, healthy bool, reason string) {
	if healthy {
		// A plugin back after its process died left its FUSE mounts dead.
		d.onPluginHealthy(id)
	}
	cfg, ok := d.plugins.task(id)
	if !ok {
		return
	}
	msg := fmt.Sprintf("CSI plugin %q healthy", id)
	switch {
	case healthy:
	case d.taskStopping(cfg.ID):
		// Its task was told to stop: the plugin going away is expected,
		// not a failure.
		msg = fmt.Sprintf("CSI plugin %q stopped serving (its task is stopping): %s", id, reason)
	default:
		msg = fmt.Sprintf("CSI plugin %q unhealthy: %s", id, reason)
	}
	d.emitEvent(cfg, msg, map[string]string{"plugin_id": id})
}

// taskStopping reports whether Nomad asked the task to stop.
func (d *Driver) taskStopping(taskID string) bool {
	h, ok := d.tasks.Get(taskID)
	return ok && h.stopping.Load()
}
