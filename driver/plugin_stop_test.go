package driver

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

// eventLog collects the driver's task events.
type eventLog struct {
	mu   sync.Mutex
	msgs []string
}

func watchEvents(t *testing.T, d *testDriver) *eventLog {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := d.TaskEvents(ctx)
	must.NoError(t, err)
	l := &eventLog{}
	go func() {
		for e := range ch {
			l.mu.Lock()
			l.msgs = append(l.msgs, e.TaskID+": "+e.Message)
			l.mu.Unlock()
		}
	}()
	return l
}

// with returns the events containing s.
func (l *eventLog) with(s string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, m := range l.msgs {
		if strings.Contains(m, s) {
			out = append(out, m)
		}
	}
	return out
}

func (l *eventLog) waitFor(t *testing.T, s string) {
	t.Helper()
	must.Wait(t, wait.InitialSuccess(
		wait.BoolFunc(func() bool { return len(l.with(s)) > 0 }),
		wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond),
	), must.Sprintf("no event containing %q", s))
}

// stopNode is a node with a plugin task "hp" (stop_wait as given) and a
// workload publishing a volume of it.
type stopNode struct {
	d      *testDriver
	fp     *fakePlugins
	events *eventLog
	plugin *drivers.TaskConfig
	work   *drivers.TaskConfig
}

func startStopNode(t *testing.T, stopWait string) *stopNode {
	t.Helper()
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	n := &stopNode{d: d, fp: withFakePlugins(t, d), events: watchEvents(t, d)}
	n.plugin = jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true,
		CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi", StopWait: stopWait}}, "alloc-p", "default", "plugin")
	_, _, err := d.StartTask(n.plugin)
	must.NoError(t, err)
	waitHealthy(t, d, "hp")
	n.work = volumeWorkload(t, "alloc-w", "first")
	_, _, err = d.StartTask(n.work)
	must.NoError(t, err)
	must.Eq(t, 1, n.fp.vols.Count(csihook.MethodNodePublishVolume))
	return n
}

// pluginSignalled reports whether the plugin's process was sent a signal.
func (n *stopNode) pluginSignalled() bool {
	n.d.mu.Lock()
	p := n.d.procs[0]
	n.d.mu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.signals) > 0
}

// A plugin asked to stop while the teardown of a stopped workload's
// volume runs waits for it: the plugin gets its signal only once the
// volume is released on the node, and events say what it waited for.
func TestStopTask_pluginWaitsForQueuedTeardown(t *testing.T) {
	n := startStopNode(t, "1m")
	release := n.fp.vols.HangMethod(csihook.MethodNodeUnpublishVolume)
	defer release()

	must.NoError(t, n.d.StopTask(n.work.ID, time.Second, ""))
	destroyed := make(chan error, 1)
	go func() { destroyed <- n.d.DestroyTask(n.work.ID, true) }()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return n.fp.vols.Count(csihook.MethodNodeUnpublishVolume) > 0
	}), wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)))

	stopped := make(chan error, 1)
	go func() { stopped <- n.d.StopTask(n.plugin.ID, time.Second, "") }()
	n.events.waitFor(t, `Waiting up to 1m0s before stopping CSI plugin "hp": the volume teardown of 1 task(s) (`+n.work.ID+`)`)
	must.False(t, n.pluginSignalled(), must.Sprint("the plugin was signalled while its volume's unpublish ran"))

	release()
	must.NoError(t, <-destroyed)
	must.NoError(t, <-stopped)
	m, err := n.d.volumes()
	must.NoError(t, err)
	must.True(t, m.PluginWork("hp").Empty(), must.Sprintf("the plugin stopped before its volume was released: %+v", m.PluginWork("hp")))
	must.True(t, n.pluginSignalled())
	n.events.waitFor(t, `Volume teardowns of CSI plugin "hp" done after`)
	must.NoError(t, n.d.DestroyTask(n.plugin.ID, true))
}

// A plugin whose volume a running task uses is not held back: an
// upgrade of the plugin must proceed while workloads keep their mounts.
func TestStopTask_pluginNotHeldByRunningTasks(t *testing.T) {
	n := startStopNode(t, "3s")
	must.NoError(t, n.d.StopTask(n.plugin.ID, time.Second, ""))
	must.True(t, n.pluginSignalled())
	must.SliceEmpty(t, n.events.with("Waiting up to"))
	must.NoError(t, n.d.DestroyTask(n.plugin.ID, true))
	must.Eq(t, 0, n.fp.vols.Count(csihook.MethodNodeUnpublishVolume))
}

// The wait is bounded by stop_wait: a teardown that never ends does not
// hold the plugin (and a node's drain) longer, and an event says what was
// left; "0s" waits for nothing.
func TestStopTask_pluginWaitBounded(t *testing.T) {
	for _, tc := range []struct {
		stopWait string
		event    string
	}{
		{"200ms", `Stopping CSI plugin "hp" after waiting 200ms (stop_wait); still pending: the volume teardown of 1 task(s)`},
		{"0s", ""},
	} {
		t.Run(tc.stopWait, func(t *testing.T) {
			n := startStopNode(t, tc.stopWait)
			release := n.fp.vols.HangMethod(csihook.MethodNodeUnpublishVolume)
			defer release()
			must.NoError(t, n.d.StopTask(n.work.ID, time.Second, ""))
			destroyed := make(chan error, 1)
			go func() { destroyed <- n.d.DestroyTask(n.work.ID, true) }()
			defer func() { release(); <-destroyed }()
			must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
				return n.fp.vols.Count(csihook.MethodNodeUnpublishVolume) > 0
			}), wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)))

			must.NoError(t, n.d.StopTask(n.plugin.ID, time.Second, ""))
			must.True(t, n.pluginSignalled())
			if tc.event == "" {
				must.SliceEmpty(t, n.events.with("Waiting up to"))
				return
			}
			n.events.waitFor(t, tc.event)
		})
	}
}

// A plugin whose task was told to stop says so when its socket goes,
// rather than "unhealthy", which reads as a failure.
func TestOnPluginHealth_stoppingPluginNotUnhealthy(t *testing.T) {
	n := startStopNode(t, "0s")
	n.d.onPluginHealth("hp", false, "socket gone")
	n.events.waitFor(t, `alloc-p/t/1: CSI plugin "hp" unhealthy: socket gone`)
	must.NoError(t, n.d.StopTask(n.plugin.ID, time.Second, ""))
	n.d.onPluginHealth("hp", false, "socket gone again")
	n.events.waitFor(t, `alloc-p/t/1: CSI plugin "hp" stopped serving (its task is stopping): socket gone again`)
	must.SliceEmpty(t, n.events.with("unhealthy: socket gone again"))
}
