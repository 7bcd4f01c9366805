package driver

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
)

// Dangling tasks are tasks an earlier driver process handed to Nomad that
// Nomad never recovers nor destroys: the agent was stopped while it
// stopped or collected their allocation (a purge racing an interrupt), and
// its restore then no longer knows them. Their supervisor, processes,
// cgroups, state directory and volumes would stay for good, and a
// single-node-writer volume could not be used elsewhere.
//
// Nomad calls RecoverTask for every task of its client state when the
// agent starts; when only the driver went, it calls it for a task once
// that task's runner needs the driver again, which may be much later. A
// task found on disk at the driver's start (invocations.waiting), last
// handed to an agent process other than the one running this driver
// (invocation.Agent), that Nomad has neither recovered, nor replaced by a
// new start of the same task, within the grace is ended as DestroyTask
// ends a task: process tree killed, volumes torn down through the volume
// lifecycle (its refcounts stay right), shared mount points released,
// cgroups and state directory removed. Only tasks an earlier driver
// process left are candidates, never one this process started or
// recovered. As Nomad's docker driver's gc.dangling_containers.

// Defaults of the dangling_tasks block.
const (
	DefaultDanglingGrace  = "5m"
	DefaultDanglingPeriod = "5m"
)

// DanglingTasks is the plugin's dangling_tasks block.
type DanglingTasks struct {
	Enabled bool   `codec:"enabled"`
	DryRun  bool   `codec:"dry_run"`
	Grace   string `codec:"grace"`
	Period  string `codec:"period"`
}

type danglingSettings struct {
	enabled, dryRun bool
	grace, period   time.Duration
}

// settings are the block's values, its defaults where the agent's config
// has no block.
func (dt *DanglingTasks) settings() danglingSettings {
	def := func(s, d string) time.Duration {
		if s == "" {
			s = d
		}
		v, _ := time.ParseDuration(s)
		return v
	}
	if dt == nil {
		return danglingSettings{enabled: true, grace: def("", DefaultDanglingGrace), period: def("", DefaultDanglingPeriod)}
	}
	return danglingSettings{enabled: dt.Enabled, dryRun: dt.DryRun,
		grace: def(dt.Grace, DefaultDanglingGrace), period: def(dt.Period, DefaultDanglingPeriod)}
}

func (dt *DanglingTasks) validate() error {
	if dt == nil {
		return nil
	}
	for _, f := range []struct{ key, val, what string }{
		{"grace", dt.Grace, "how long after the driver starts Nomad may still recover a task it left"},
		{"period", dt.Period, "how often a dangling task that could not be ended is tried again"},
	} {
		if f.val == "" {
			continue
		}
		if v, err := time.ParseDuration(f.val); err != nil || v < time.Second {
			return fmt.Errorf("dangling_tasks %s must be a duration of at least \"1s\" (%s), got %q", f.key, f.what, f.val)
		}
	}
	return nil
}

// waitingList is a snapshot of the tasks an earlier driver process handed
// to Nomad that Nomad has not taken back: workloads first, plugin tasks
// last (a workload's volumes are torn down through its plugin).
func (iv *invocations) waitingList() []invocation {
	iv.mu.Lock()
	defer iv.mu.Unlock()
	out := make([]invocation, 0, len(iv.waiting))
	for _, inv := range iv.waiting {
		out = append(out, inv)
	}
	sort.Slice(out, func(i, j int) bool {
		if (out[i].PluginID == "") != (out[j].PluginID == "") {
			return out[i].PluginID == ""
		}
		return out[i].TaskID < out[j].TaskID
	})
	return out
}

// isWaiting reports whether id still waits for Nomad.
func (iv *invocations) isWaiting(id string) bool {
	iv.mu.Lock()
	defer iv.mu.Unlock()
	_, ok := iv.waiting[id]
	return ok
}

// takeDangling stops waiting for id and records it as ended dangling, if
// it still waits. The caller holds id.
func (iv *invocations) takeDangling(id string) bool {
	iv.mu.Lock()
	defer iv.mu.Unlock()
	if _, ok := iv.waiting[id]; !ok {
		return false
	}
	delete(iv.waiting, id)
	iv.dangling[id] = true
	return true
}

// untakeDangling undoes takeDangling for a task that could not be ended:
// its processes may run on, so it waits for Nomad again. The caller holds
// the task's ID.
func (iv *invocations) untakeDangling(inv invocation) {
	iv.mu.Lock()
	defer iv.mu.Unlock()
	delete(iv.dangling, inv.TaskID)
	iv.waiting[inv.TaskID] = inv
}

// wasDangling reports whether the reconciler ended id.
func (iv *invocations) wasDangling(id string) bool {
	iv.mu.Lock()
	defer iv.mu.Unlock()
	return iv.dangling[id]
}

// danglingLoop waits the grace from the driver's start, then ends the
// dangling tasks, trying those it could not end again every period.
func (d *Driver) danglingLoop(conf *Config) {
	s := conf.DanglingTasks.settings()
	if !s.enabled {
		return
	}
	if !d.sleep(s.grace) {
		return
	}
	pending := d.invocations.waitingList()
	for len(pending) > 0 {
		var left []invocation
		for _, inv := range pending {
			if d.ctx.Err() != nil {
				// Shutting down: the next driver process judges again.
				return
			}
			if !d.endDangling(conf, inv, s) {
				left = append(left, inv)
			}
		}
		if pending = left; len(pending) == 0 || !d.sleep(s.period) {
			return
		}
	}
}

// sleep waits for dur; false when the driver shuts down first.
func (d *Driver) sleep(dur time.Duration) bool {
	t := time.NewTimer(dur)
	defer t.Stop()
	select {
	case <-d.ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// endDangling ends one dangling task; false when it is to be tried again.
func (d *Driver) endDangling(conf *Config, inv invocation, s danglingSettings) bool {
	id := inv.TaskID
	// A StartTask or RecoverTask of the task works on it: Nomad knows it.
	release, _ := d.invocations.tryClaim(id)
	if release == nil {
		return !d.invocations.isWaiting(id)
	}
	defer release()
	if _, known := d.tasks.Get(id); known || !d.invocations.isWaiting(id) {
		return true
	}
	logger := d.logger.With("task_id", id, "alloc_id", inv.AllocID, "task_name", inv.TaskName)
	if d.agent != "" && inv.Agent == d.agent {
		// Handed to, or recovered under, the agent that runs this
		// driver: only the driver went. Nomad recovers such a task when
		// its task runner next needs the driver, which may be long after
		// the grace (a task whose prestart hook waits for a template), so
		// it is the agent's to recover or to destroy.
		logger.Info("task of the running agent not recovered yet; left to Nomad", "state_dir", conf.taskStateDir(id))
		return true
	}
	dir := conf.taskStateDir(id)
	spec, specErr := executor.ReadSpec(dir)
	pluginID := inv.PluginID
	if pluginID == "" && specErr == nil {
		pluginID = specPluginID(conf, &spec)
	}
	m, err := d.volumes()
	if err != nil {
		logger.Warn("dangling task not ended yet: the volume journal is not open", "error", err)
		return false
	}
	volumes := slices.Contains(m.TasksWithPrefix(id), id)
	var shared []string
	if specErr == nil {
		shared = bidirectionalSources(spec.Mounts)
	}
	if s.dryRun {
		// Said once, what a run without dry_run would do first.
		logger.Warn("found a dangling task: Nomad did not recover it within the grace; dry_run leaves it", "state_dir", dir, "plugin_id", pluginID,
			"volumes", volumes, "shared_mounts", strings.Join(shared, ","), "grace", s.grace.String())
		return true
	}
	if pluginID != "" && !d.servedByOther(pluginID, id) {
		if w := m.PluginWork(pluginID); !w.Empty() {
			logger.Warn("dangling plugin task kept while volumes of its plugin are held on this node", "plugin_id", pluginID, "volume_tasks", strings.Join(w.Tasks, ","))
			return false
		}
	}
	if !d.invocations.takeDangling(id) {
		return true
	}
	// As DestroyTask: the process tree, its cgroups and state directory,
	// then what it held.
	if err := d.discard(d.logger, dir); err != nil {
		// Not ended: it waits for Nomad again, and is tried again.
		d.invocations.untakeDangling(inv)
		logger.Warn("failed to end a dangling task; trying again", "state_dir", dir, "error", err, "retry_in", s.period.String())
		return false
	}
	d.sharedSources().adopt(shared)
	d.sharedSources().release(shared)
	// Its image, if it had one: its last use is now (a task without a
	// lease has nothing to let go).
	d.releaseImage(logger, id)
	var volErr error
	if volumes {
		volErr = d.teardownVolumes(id)
	}
	logger.Warn("ended a dangling task: an earlier driver process handed it to Nomad, which did not recover it within the grace",
		"state_dir", dir, "plugin_id", pluginID, "volumes_torn_down", volumes && volErr == nil, "shared_mounts", strings.Join(shared, ","),
		"grace", s.grace.String())
	if volErr != nil {
		logger.Warn("volumes of a dangling task not torn down yet; retrying in the background", "error", volErr)
	}
	return true
}

// servedByOther reports whether a task other than taskID serves plugin id
// now: a dangling instance of the plugin then serves nothing.
func (d *Driver) servedByOther(id, taskID string) bool {
	p := d.currentProber()
	if p == nil {
		return false
	}
	st, ok := p.Get(id)
	return ok && st.Source == fingerprint.SourceTask && st.TaskID != "" && st.TaskID != taskID
}

// specPluginID is the plugin id of a task whose state directory predates
// the plugin id in its invocation file: the socket directory mounted into
// it, root_dir/plugins/<id>.
func specPluginID(conf *Config, spec *executor.Spec) string {
	base := conf.pluginSocketDir("x")
	base = base[:len(base)-1]
	for _, m := range append(slices.Clone(spec.Mounts), spec.LateMounts...) {
		if rest, ok := strings.CutPrefix(m.Source, base); ok && rest != "" && !strings.Contains(rest, "/") {
			return rest
		}
	}
	return ""
}
