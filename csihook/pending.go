package csihook

import (
	"maps"
	"slices"
	"strings"
)

// PluginWork is what this node's volume lifecycle still holds of one
// plugin id: what a plugin task's stop may wait for (see the driver's
// csi_plugin stop_wait). It is a snapshot; the caller decides which tasks
// are still running and so not waited for.
type PluginWork struct {
	// Tasks are the tasks with volumes of the plugin recorded on this
	// node: published, or unpublished but with a release (unstage,
	// detach) still to do. Sorted.
	Tasks []string
	// Retrying are those of Tasks whose teardown a background worker
	// retries now. Sorted.
	Retrying []string
	// Recovering is how many volumes of the plugin recovery settles now.
	Recovering int
}

// Empty reports whether nothing of the plugin is held on this node.
func (w PluginWork) Empty() bool { return len(w.Tasks) == 0 && w.Recovering == 0 }

// PluginWork returns what the volume lifecycle holds of plugin id on this
// node. It reads the manager's records only and calls nothing.
func (m *Manager) PluginWork(pluginID string) PluginWork {
	m.mu.Lock()
	defer m.mu.Unlock()
	tasks := map[string]bool{}
	for id, recs := range m.tasks {
		for _, t := range recs {
			if t.PluginID == pluginID {
				tasks[id] = true
			}
		}
	}
	for id, keys := range m.unreleased {
		for k := range keys {
			if k.plugin == pluginID {
				tasks[id] = true
			}
		}
	}
	var w PluginWork
	w.Tasks = slices.Sorted(maps.Keys(tasks))
	for key := range m.workers {
		switch {
		case strings.HasPrefix(key, "task:"):
			if id := strings.TrimPrefix(key, "task:"); tasks[id] {
				w.Retrying = append(w.Retrying, id)
			}
		case strings.HasPrefix(key, "vol:"+pluginID+"\x00"):
			w.Recovering++
		}
	}
	slices.Sort(w.Retrying)
	return w
}
