package driver

import (
	"fmt"
	"strings"
	"time"
)

// pluginStopPoll is how often a stopping plugin task looks again at the
// teardowns it waits for.
const pluginStopPoll = 200 * time.Millisecond

// awaitPluginTeardowns holds a plugin task's stop while teardowns of its
// volumes on this node are queued or running, at most its csi_plugin
// stop_wait, so that the plugin serves their last unpublish and unstage.
// Volumes that running tasks use do not hold it: those tasks keep their
// mounts, and a new instance of the plugin (an upgrade) serves their
// teardown later. A task event says what the stop waits for, and another
// whether it waited in vain.
//
// A hostile plugin job can hold its own stop (and so a node drain, which
// stops system jobs last) no longer than stop_wait, which validate bounds
// by maxPluginStopWait; a workload cannot extend the wait by staying
// alive, since running tasks are not waited for, and one whose teardown
// is retried in vain holds it only until stop_wait ends.
func (d *Driver) awaitPluginTeardowns(h *taskHandle) {
	limit := h.plugin.stopWait()
	if limit <= 0 {
		return
	}
	pending, recovering := d.pluginTeardowns(h.plugin.ID, h.config.ID)
	if len(pending) == 0 && recovering == 0 {
		return
	}
	id := h.plugin.ID
	start := time.Now()
	d.emitEvent(h.config, fmt.Sprintf("Waiting up to %s before stopping CSI plugin %q: %s", limit, id, describeTeardowns(pending, recovering)),
		map[string]string{"plugin_id": id})
	h.logger.Info("plugin stop waits for volume teardowns", "plugin_id", id, "tasks", pending, "recovering", recovering, "stop_wait", limit)
	deadline := time.NewTimer(limit)
	defer deadline.Stop()
	tick := time.NewTicker(pluginStopPoll)
	defer tick.Stop()
	for {
		select {
		case <-deadline.C:
			pending, recovering = d.pluginTeardowns(id, h.config.ID)
			if len(pending) == 0 && recovering == 0 {
				break
			}
			d.emitEvent(h.config, fmt.Sprintf("Stopping CSI plugin %q after waiting %s (stop_wait); still pending: %s", id, limit, describeTeardowns(pending, recovering)),
				map[string]string{"plugin_id": id})
			h.logger.Warn("plugin stops with volume teardowns pending", "plugin_id", id, "tasks", pending, "recovering", recovering)
			return
		case <-d.ctx.Done():
			return
		case <-h.done:
			// The plugin exited by itself: nothing to hold.
			return
		case <-tick.C:
			pending, recovering = d.pluginTeardowns(id, h.config.ID)
			if len(pending) > 0 || recovering > 0 {
				continue
			}
		}
		took := time.Since(start).Round(10 * time.Millisecond)
		d.emitEvent(h.config, fmt.Sprintf("Volume teardowns of CSI plugin %q done after %s; stopping it", id, took), map[string]string{"plugin_id": id})
		h.logger.Info("volume teardowns done; stopping plugin", "plugin_id", id, "waited", took)
		return
	}
}

// pluginTeardowns returns the tasks whose volumes of plugin id this node
// is still to tear down and that no longer run (they exited, were asked to
// stop, are being destroyed, or are gone with a teardown retried in the
// background), sorted, and how many volumes of the plugin recovery
// settles now. self, the plugin task, is never among them.
func (d *Driver) pluginTeardowns(id, self string) ([]string, int) {
	d.vols.mu.Lock()
	m := d.vols.manager
	d.vols.mu.Unlock()
	if m == nil {
		// No journal open yet: nothing of this process to wait for.
		return nil, 0
	}
	w := m.PluginWork(id)
	retrying := map[string]bool{}
	for _, t := range w.Retrying {
		retrying[t] = true
	}
	var out []string
	for _, t := range w.Tasks {
		if t == self {
			continue
		}
		h, ok := d.tasks.Get(t)
		switch {
		case ok && (h.exited() || h.stopping.Load()):
			// Its DestroyTask tears the volumes down, or does now.
			out = append(out, t)
		case ok:
			// Running: it keeps its volumes, and the plugin is not held.
		case retrying[t]:
			out = append(out, t)
		}
	}
	return out, w.Recovering
}

// describeTeardowns says what a plugin's stop waits for, naming at most
// three tasks.
func describeTeardowns(tasks []string, recovering int) string {
	var parts []string
	if n := len(tasks); n > 0 {
		names := tasks
		if n > 3 {
			names = append(names[:3:3], fmt.Sprintf("%d more", n-3))
		}
		parts = append(parts, fmt.Sprintf("the volume teardown of %d task(s) (%s)", n, strings.Join(names, ", ")))
	}
	if recovering > 0 {
		parts = append(parts, fmt.Sprintf("%d volume(s) recovery settles", recovering))
	}
	return strings.Join(parts, " and ")
}
