package csihook

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// setupData sets up task-a's volume "data" (vol1 of plugin p) at /data
// and returns its publish target.
func (h *harness) setupData() string {
	h.t.Helper()
	_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(h.t, err)
	return h.m.TargetPath("task-a", "data")
}

// repairInFlight starts a repair of plugin p's volumes and returns once
// it has called method (which the test hangs), with the channel its error
// comes on. A repair that returns without calling method fails the test
// at once, rather than leaving it to spin until go test's timeout.
func (h *harness) repairInFlight(method string) <-chan error {
	h.t.Helper()
	h.fake.ResetCalls()
	done := make(chan error, 1)
	go func() {
		_, err := h.m.RepairStale(context.Background(), "p")
		done <- err
	}()
	for h.fake.Count(method) == 0 {
		select {
		case err := <-done:
			if h.fake.Count(method) > 0 {
				done <- err
				return done
			}
			h.t.Fatalf("the repair returned (error: %v) without calling %s", err, method)
		default:
			runtime.Gosched()
		}
	}
	return done
}

func TestRepairStale(t *testing.T) {
	unavailable := status.Error(codes.Unavailable, "transport is closing")
	cases := []struct {
		name string
		// deadTarget and deadStaging mark the mounts dead.
		deadTarget, deadStaging bool
		unpublishErr            error
		unhealthy               bool
		wantMethods             []string
		wantRepaired            bool
		wantErr                 bool
		wantDetach              bool
		wantEvent               string
	}{
		{name: "healthy mounts are left alone", wantMethods: nil},
		{
			name: "dead target is published again", deadTarget: true,
			wantMethods:  []string{MethodNodeUnpublishVolume, MethodNodePublishVolume},
			wantRepaired: true, wantEvent: `Volume "data" is stale`,
		},
		{
			name: "dead staging is staged again", deadStaging: true, deadTarget: true,
			wantMethods:  []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodNodeStageVolume, MethodNodePublishVolume},
			wantRepaired: true, wantEvent: `Volume "data" is stale`,
		},
		{
			name: "dead staging alone takes its publishes with it", deadStaging: true,
			wantMethods:  []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodNodeStageVolume, MethodNodePublishVolume},
			wantRepaired: true,
		},
		{
			name: "a plugin that cannot unpublish a dead mount: detached lazily", deadTarget: true,
			unpublishErr: status.Error(codes.Internal, "transport endpoint is not connected"),
			wantMethods:  []string{MethodNodeUnpublishVolume, MethodNodePublishVolume},
			wantRepaired: true, wantDetach: true,
		},
		{
			name: "an unhealthy plugin is not called", deadTarget: true, unhealthy: true,
			wantErr: true,
		},
		{
			name: "unpublish unavailable throughout: detached, then published", deadTarget: true,
			unpublishErr: unavailable,
			wantMethods:  []string{MethodNodeUnpublishVolume, MethodNodeUnpublishVolume, MethodNodeUnpublishVolume, MethodNodePublishVolume},
			wantRepaired: true, wantDetach: true,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			ctx := context.Background()
			_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
			must.NoError(t, err)
			target := h.m.TargetPath("task-a", "data")
			staging := h.m.StagingPath("p", "vol1")
			h.mnt.SetStale(target, tc.deadTarget)
			h.mnt.SetStale(staging, tc.deadStaging)
			if tc.unpublishErr != nil {
				h.fake.SetError(MethodNodeUnpublishVolume, tc.unpublishErr)
			}
			if tc.unhealthy {
				p := fullPlugin("p")
				p.Healthy = false
				h.setPlugin(p)
			}
			h.fake.ResetCalls()
			h.mnt.ResetActions()

			rep, err := h.m.RepairStale(ctx, "p")
			if tc.wantErr {
				must.Error(t, err)
			} else {
				must.NoError(t, err)
			}
			must.Eq(t, len(tc.wantMethods), len(h.fake.Methods()))
			if len(tc.wantMethods) > 0 {
				must.Eq(t, tc.wantMethods, h.fake.Methods())
			}
			if tc.wantRepaired {
				must.Eq(t, []Repaired{{TaskID: "task-a", Name: "data", PluginID: "p", VolumeID: "vol1",
					HostPath: target, Destination: "/data"}}, rep)
				// The fresh mounts are alive, and a second pass finds nothing.
				h.fake.ResetCalls()
				rep, err = h.m.RepairStale(ctx, "")
				must.NoError(t, err)
				must.SliceEmpty(t, rep)
				must.SliceEmpty(t, h.fake.Methods())
				must.Eq(t, []string{staging, target}, h.mountPaths())
			} else {
				must.SliceEmpty(t, rep)
			}
			detached := false
			for _, a := range h.mnt.GetActions() {
				if a.Kind == mounter.ActionDetachLazy {
					detached = true
				}
			}
			must.Eq(t, tc.wantDetach, detached)
			if tc.wantEvent != "" {
				must.True(t, containsEvent(h.eventMsgs(), tc.wantEvent), must.Sprint(h.eventMsgs()))
			}
			// The journal still says published: teardown works as before.
			must.Eq(t, []string{"task task-a/data published", "vol p/vol1 staged/published"}, h.journalRecords())
			h.setPlugin(fullPlugin("p"))
			h.fake.SetError(MethodNodeUnpublishVolume, nil)
			must.NoError(t, h.m.Teardown(ctx, "task-a"))
			must.SliceEmpty(t, h.mountPaths())
		})
	}
}

// Other plugins' volumes are not looked at, and a failed repair says so to
// the task.
func TestRepairStale_PluginFilterAndFailureEvent(t *testing.T) {
	h := newHarness(t, noRepairBackoff)
	ctx := context.Background()
	target := h.setupData()
	h.mnt.SetStale(target, true)
	h.fake.ResetCalls()

	rep, err := h.m.RepairStale(ctx, "other")
	must.NoError(t, err)
	must.SliceEmpty(t, rep)
	must.SliceEmpty(t, h.fake.Methods())

	h.fake.SetError(MethodNodePublishVolume, status.Error(codes.Internal, "backend gone"))
	rep, err = h.m.RepairStaleRetry(ctx, "p", 2)
	must.Error(t, err)
	must.SliceEmpty(t, rep)
	must.True(t, containsEvent(h.eventMsgs(), `Repair of stale volume "data" failed`), must.Sprint(h.eventMsgs()))
	var oe *OpError
	must.True(t, errors.As(err, &oe))

	// Once the plugin publishes again, the next pass repairs it.
	h.fake.SetError(MethodNodePublishVolume, nil)
	rep, err = h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.Len(t, 1, rep)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
}

// A stat that hangs (a hung network mount) does not hold the volume: the
// check gives up, says why, and the next check does not stat it again
// until the first returned.
func TestRepairStale_HungStat(t *testing.T) {
	old := staleCheckTimeout
	staleCheckTimeout = 50 * time.Millisecond
	t.Cleanup(func() { staleCheckTimeout = old })
	h := newHarness(t)
	ctx := context.Background()
	h.setupData()
	staging := h.m.StagingPath("p", "vol1")
	release := make(chan struct{})
	h.mnt.SetStaleHang(staging, release)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})

	_, err := h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "did not return within")
	_, err = h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "has not returned yet")
	// The volume's lock is free while the stat hangs: its teardown goes on.
	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}, h.fake.Methods())
}

// Retries do not wait for a plugin that is not healthy: its return starts
// the next repair.
func TestRepairStaleRetry_UnhealthyPluginEndsRetries(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.BackgroundRetryBase, c.BackgroundRetryMax = time.Hour, time.Hour })
	ctx := context.Background()
	h.mnt.SetStale(h.setupData(), true)
	p := fullPlugin("p")
	p.Healthy = false
	h.setPlugin(p)
	// With an hour of backoff, a retry would never return.
	_, err := h.m.RepairStaleRetry(ctx, "p", 5)
	must.ErrorIs(t, err, ErrPluginNotFound)
	h.setPlugin(fullPlugin("p"))
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
}

// A volume set up with secrets is published again with them or not at
// all: in the process that set it up the repair sends them; after a
// restart, when the driver holds none, the repair is refused with an event
// saying to restart the task, and nothing is taken down.
func TestRepairStale_secretsOnlyWhileHeld(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "vol1", "/data")
	r.Secrets = map[string]string{"token": "t0k"}
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{r})
	must.NoError(t, err)
	target := h.m.TargetPath("task-a", "data")
	h.mnt.SetStale(target, true)
	h.fake.ResetCalls()
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceLen(t, 1, rep)
	var published bool
	for _, c := range h.fake.Calls() {
		if c.Method == MethodNodePublishVolume {
			published = true
			must.Eq(t, map[string]string{"token": "t0k"}, c.Secrets)
		}
	}
	must.True(t, published)

	h.restart()
	h.mnt.SetStale(target, true)
	h.fake.ResetCalls()
	rep, err = h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "needs its secrets")
	must.SliceEmpty(t, rep)
	must.SliceEmpty(t, h.fake.Methods())
	must.True(t, containsEvent(h.eventMsgs(), "restart the task"), must.Sprint(h.eventMsgs()))
	must.Eq(t, []string{"task task-a/data published", "vol p/vol1 staged/published"}, h.journalRecords())
}
