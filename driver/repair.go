package driver

import (
	"context"
	"fmt"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

// staleCheckInterval is how often every published volume is checked for a
// dead mount (besides the check when a plugin becomes healthy again): a
// stat of each publish target and staging path, cheap enough to run this
// often; a variable for tests.
var staleCheckInterval = 30 * time.Second

// repairAttempts bounds the passes of one repair (with backoff between
// them) while volumes fail to be set up again: a plugin that just came
// back may refuse for a moment. The periodic check is the next try.
const repairAttempts = 5

// repairTimeout bounds one repair of the volumes of one plugin.
const repairTimeout = 5 * time.Minute

// mountReplacer is the part of a task's process that takes a fresh mount
// into the running task (executor.Process.ReplaceMount).
type mountReplacer interface {
	ReplaceMount(source, target string, readOnly bool) (string, error)
}

// repairLoop checks every published volume for a dead mount every
// staleCheckInterval until the driver shuts down. It never opens the
// journal itself: with no volume lifecycle yet there is nothing published.
func (d *Driver) repairLoop() {
	t := time.NewTicker(staleCheckInterval)
	defer t.Stop()
	for {
		select {
		case <-d.ctx.Done():
			return
		case <-t.C:
			d.repairStale("", 1)
		}
	}
}

// onPluginHealthy starts a repair of the plugin's volumes: a plugin that
// comes back after its process died has left every FUSE mount it served
// dead. The back-off of volumes that kept dying under the plugin before
// ends: the one back is a new process.
func (d *Driver) onPluginHealthy(pluginID string) {
	d.goBackground(func() {
		if m := d.openedVolumes(); m != nil {
			m.ResetRepairBackoff(pluginID)
		}
		d.repairStale(pluginID, repairAttempts)
	})
}

// repairStale repairs the dead mounts of pluginID's volumes ("" for every
// plugin): the lifecycle publishes them again on the host (see
// csihook.RepairStale), then each fresh mount is attached in the running
// task in place of its dead copy. Each task is told what happened; a task
// whose mount could not be replaced is told to restart. One repair runs at
// a time; attempts bounds its passes (the periodic check makes one: it is
// the retry of itself).
func (d *Driver) repairStale(pluginID string, attempts int) {
	d.vols.mu.Lock()
	m := d.vols.manager
	d.vols.mu.Unlock()
	if m == nil {
		return
	}
	d.repairMu.Lock()
	defer d.repairMu.Unlock()
	ctx, cancel := context.WithTimeout(d.ctx, repairTimeout)
	defer cancel()
	start := time.Now()
	reps, err := m.RepairStaleRetry(ctx, pluginID, attempts)
	if err != nil {
		d.logger.Warn("some dead volume mounts are not repaired yet", "plugin_id", pluginID, "error", err)
	}
	for _, r := range reps {
		d.attachRepaired(r, start)
	}
}

// attachRepaired replaces a repaired volume's dead mount in its running
// task and says so to the task.
func (d *Driver) attachRepaired(r csihook.Repaired, start time.Time) {
	ann := map[string]string{"volume": r.Name, "plugin_id": r.PluginID, "volume_id": r.VolumeID}
	h, ok := d.tasks.Get(r.TaskID)
	if !ok {
		d.logger.Info("repaired a volume of a task this driver does not run", "task_id", r.TaskID, "volume", r.Name)
		return
	}
	rp, ok := h.process.(mountReplacer)
	if !ok {
		d.volumeEvent(r.TaskID, fmt.Sprintf("Volume %q was published again but cannot be attached in this running task: restart the task to see its data", r.Name), ann)
		return
	}
	target, err := rp.ReplaceMount(r.HostPath, r.Destination, r.ReadOnly)
	if err != nil {
		d.logger.Error("failed to attach a repaired volume in its task", "task_id", r.TaskID, "volume", r.Name, "error", err)
		d.volumeEvent(r.TaskID, fmt.Sprintf("Repair of stale volume %q failed: it was published again, but attaching it in the running task failed (%v): restart the task to see its data", r.Name, err), ann)
		return
	}
	took := time.Since(start).Round(time.Millisecond)
	d.logger.Info("repaired a stale volume in its running task", "task_id", r.TaskID, "volume", r.Name,
		"destination", target, "duration", took)
	d.volumeEvent(r.TaskID, fmt.Sprintf("Volume %q repaired: its fresh mount is attached at %s in the running task", r.Name, target), ann)
}
