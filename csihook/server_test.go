package csihook

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A volume's calls go to the server that set it up: once another server
// serves the plugin id (a socket in plugin_socket_dirs a restarted driver
// found first), its teardown waits, and that server gets no call and none
// of the volume's secrets, until the first server serves the id again.
func TestServer_callsWaitForTheServerThatSetTheVolumeUp(t *testing.T) {
	h, job, other := twoServers(t, fullPlugin)
	ctx := context.Background()
	setupCalls := len(h.fake.Calls())

	h.restart()
	h.setPlugin(other)
	err := h.m.Teardown(ctx, "task-a")
	must.Error(t, err)
	must.StrContains(t, err.Error(), `was set up through job "plugin" in namespace "default"`)
	must.Eq(t, setupCalls, len(h.fake.Calls()), must.Sprintf("calls after the other server came: %v", h.fake.Calls()[setupCalls:]))

	// The job's plugin serves the id again: the retried teardown ends.
	h.setPlugin(job)
	h.waitIdle()
	must.Eq(t, 1, h.fake.Count(MethodNodeUnpublishVolume))
	must.Eq(t, 1, h.fake.Count(MethodNodeUnstageVolume))
	must.Eq(t, 1, h.fake.Count(MethodControllerUnpublishVolume))
	must.SliceEmpty(t, h.journalRecords())
}

// A server the driver cannot name (a plugin task not recovered yet) is not
// told apart: the calls go ahead, as before servers were recorded.
func TestServer_unnamedServerIsNotRefused(t *testing.T) {
	h, _, _ := twoServers(t, fullPlugin)
	ctx := context.Background()
	h.restart()
	h.setPlugin(fullPlugin("p"))
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.Eq(t, 1, h.fake.Count(MethodNodeUnstageVolume))
}

// The stats loop asks only the server that set a volume up: after a
// restart, another server of the plugin id (a socket in
// plugin_socket_dirs) is not sent the volume's id and paths, and its
// answer is neither kept as the volume's stats nor told to the volume's
// tasks as its condition.
func TestServer_statsGoOnlyToTheServerThatSetTheVolumeUp(t *testing.T) {
	h, job, other := twoServers(t, statsPlugin)
	ctx := context.Background()

	h.restart()
	h.m.stats = newStatsLoop(time.Minute)
	h.setPlugin(other)
	h.fake.SetCondition("vol1", true, "the operator's plugin knows no such volume")
	later := time.Now().Add(time.Hour)
	for range 3 {
		later = later.Add(time.Minute)
		statsPassWait(h.m, ctx, later)
	}
	must.Eq(t, 0, h.fake.Count(MethodNodeGetVolumeStats))
	for _, e := range h.eventMsgs() {
		must.StrNotContains(t, e, "abnormal")
	}

	// The job's plugin serves the id again: its stats are read.
	h.setPlugin(job)
	for range 2 {
		later = later.Add(time.Minute)
		statsPassWait(h.m, ctx, later)
	}
	must.Positive(t, h.fake.Count(MethodNodeGetVolumeStats))
}

// A repair of dead mounts (the plugin's process died) waits for the server
// that set the volume up, touching nothing: done through another server
// of the id, it detached the dead publish, was refused the publish again,
// and the volume, no longer dead but no longer mounted, was never repaired
// once the right server came back.
func TestServer_repairWaitsForTheServerThatSetTheVolumeUp(t *testing.T) {
	h, job, other := twoServers(t, fullPlugin)
	ctx := context.Background()
	target := h.m.TargetPath("task-a", "data")
	staging := h.m.StagingPath("p", "vol1")
	h.mnt.SetStale(target, true)

	h.setPlugin(other)
	h.fake.ResetCalls()
	h.mnt.ResetActions()
	rep, err := h.m.RepairStale(ctx, "p")
	must.Error(t, err)
	must.StrContains(t, err.Error(), `was set up through job "plugin" in namespace "default"`)
	must.SliceEmpty(t, rep)
	must.SliceEmpty(t, h.fake.Methods())
	must.SliceEmpty(t, h.mnt.GetActions())

	// The job's plugin is back: the dead mount is repaired through it.
	h.setPlugin(job)
	rep, err = h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.Eq(t, []Repaired{{TaskID: "task-a", Name: "data", PluginID: "p", VolumeID: "vol1",
		HostPath: target, Destination: "/data"}}, rep)
	must.Eq(t, []string{staging, target}, h.mountPaths())
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.mountPaths())
}

// A repair that fails the same way pass after pass (here: another server
// serves the id) tells the task once, and its message says what to do; a
// repair that succeeds, holds, then fails again, tells it again.
func TestServer_repairFailingAgainIsToldOnce(t *testing.T) {
	h, job, other := twoServers(t, fullPlugin)
	ctx := context.Background()
	target := h.m.TargetPath("task-a", "data")
	failures := func() int {
		n := 0
		for _, e := range h.eventMsgs() {
			if strings.Contains(e, "Repair of stale volume") {
				n++
			}
		}
		return n
	}

	h.mnt.SetStale(target, true)
	h.setPlugin(other)
	var err error
	for range 3 {
		_, err = h.m.RepairStale(ctx, "p")
		must.Error(t, err)
	}
	must.StrContains(t, err.Error(), `serve plugin "p" from job "plugin" in namespace "default" again`)
	must.Eq(t, 1, failures(), must.Sprintf("events: %v", h.eventMsgs()))

	h.setPlugin(job)
	_, err = h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	// A check finds it alive: its next death is no relapse (which would
	// wait, see TestRepairStale_RelapsingVolumeBacksOff).
	_, err = h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	h.mnt.SetStale(target, true)
	h.setPlugin(other)
	_, err = h.m.RepairStale(ctx, "p")
	must.Error(t, err)
	must.Eq(t, 2, failures(), must.Sprintf("events: %v", h.eventMsgs()))
	h.setPlugin(job)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
}

// twoServers sets volume "data" (vol1) of task-a up through a job serving
// plugin id "p" (made by plugin), and returns the harness, that job's
// plugin, and another server of the id: a socket in plugin_socket_dirs,
// which no call has gone to yet.
func twoServers(t *testing.T, plugin func(id string) PluginInfo) (h *harness, job, other PluginInfo) {
	t.Helper()
	h = newHarness(t)
	job = plugin("p")
	job.Server = `job "plugin" in namespace "default"`
	h.setPlugin(job)
	_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	other = plugin("p")
	other.Socket = "/run/operator/p.sock"
	other.Server = `socket "/run/operator/p.sock" in plugin_socket_dirs`
	return h, job, other
}

// A repair whose publish the plugin answered Unavailable (it was
// restarting), and that then waits for the volume's own server because
// another began to serve the id, tells the task that too: the same call
// and code, but a failure of another kind, whose message says what the
// operator must do.
func TestServer_repairWaitingForItsServerAfterAnUnavailablePluginIsTold(t *testing.T) {
	h, job, other := twoServers(t, fullPlugin)
	ctx := context.Background()
	target := h.m.TargetPath("task-a", "data")
	const failed = `Repair of stale volume "data" failed`

	h.mnt.SetStale(target, true)
	h.fake.SetError(MethodNodePublishVolume, status.Error(codes.Unavailable, "restarting"))
	_, err := h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "restarting")
	must.Eq(t, 1, countEvents(h, failed), must.Sprint(h.eventMsgs()))

	h.fake.SetError(MethodNodePublishVolume, nil)
	h.setPlugin(other)
	// The driver's next periodic check, 30 s on: past the 20 s the first
	// failed repair waits.
	h.m.now = func() time.Time { return time.Now().Add(30 * time.Second) }
	_, err = h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "serves the plugin id now")
	must.Eq(t, 2, countEvents(h, failed), must.Sprint(h.eventMsgs()))
	msgs := h.eventMsgs()
	must.StrContains(t, msgs[len(msgs)-1], "serves the plugin id now")

	h.setPlugin(job)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.journalRecords())
}
