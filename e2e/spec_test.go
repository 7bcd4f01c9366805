//go:build e2e

package e2e

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// TestVolumeSpecCapabilities runs the fixture as plugins that each lack a
// capability the default fixture has, and that hold the driver to what the
// CSI spec then asks of a CO:
//   - without PUBLISH_READONLY, ControllerPublishVolume's readonly must be
//     false (the plugin refuses true); a reader-only volume is still
//     read-only in the task;
//   - with VolumeExpansion OFFLINE only, ControllerExpandVolume must wait
//     until the volume is released on the node (the plugin refuses it in
//     use): the driver refuses the growth before calling, then grows the
//     released volume;
//   - without NodeGetInfo (allowed without PUBLISH_UNPUBLISH_VOLUME), the
//     plugin is healthy and its volumes work.
func TestVolumeSpecCapabilities(t *testing.T) {
	t.Parallel()
	a := volAgent(t, false)

	t.Run("no_publish_readonly", func(t *testing.T) {
		fx := a.StartVolFixture(t, "fxnoro", VolFixtureOptions{Args: []string{"--controller-publish", "--no-publish-readonly"}})
		name := volUniq("noro")
		dest := filepath.Join(volDir(a, name), "data")
		job := a.RunVolJob(t, VolJob{
			Script: "if touch " + dest + "/x; then echo WRITABLE; exit 1; fi; echo refused",
			Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-reader-only", ReadOnly: true,
				Create: true, CreateType: "dir"}},
		})
		al := a.WaitAlloc(t, job.ID, volTimeout, StatusComplete, StatusFailed)
		must.Eq(t, StatusComplete, al.ClientStatus, must.Sprint(al.Describe()))
		must.StrContains(t, a.AllocLogs(t, al.ID, "t", false), "refused")
		must.Eq(t, 1, fx.CountFor("ControllerPublishVolume", name))
	})

	t.Run("offline_expansion", func(t *testing.T) {
		fx := a.StartVolFixture(t, "fxoffl", VolFixtureOptions{Args: []string{"--offline-expansion"}})
		name := volUniq("offl")
		vol := func(size string) VolSpec {
			return VolSpec{Name: "data", Plugin: fx.ID, ID: name, Dest: filepath.Join(volDir(a, name), "data"),
				Access: "multi-node-multi-writer", Create: true, CreateType: "dir", CapacityMin: size}
		}
		held := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{vol("64MiB")}})
		heldAlloc := a.WaitAlloc(t, held.ID, volTimeout, StatusRunning)

		grown := a.RunVolJob(t, VolJob{Script: "echo SHOULD-NOT-RUN", Volumes: []VolSpec{vol("128MiB")}})
		al := a.WaitAlloc(t, grown.ID, volTimeout, StatusFailed)
		must.StrContains(t, eventsText(al, "t"), `expands volumes only offline (no ONLINE volume expansion)`, must.Sprint(al.Describe()))
		must.Eq(t, 0, fx.CountFor("ControllerExpandVolume", name), must.Sprint("ControllerExpandVolume was called for a volume in use"))

		// Released, the volume grows.
		a.StopJob(t, held.ID)
		a.WaitAllocID(t, heldAlloc.ID, volTimeout, StatusComplete)
		volWaitCount(t, fx, "NodeUnstageVolume", fx.VolumeID(name), 1, 30*time.Second)
		again := a.RunVolJob(t, VolJob{Script: "echo grown", Volumes: []VolSpec{vol("128MiB")}})
		al = a.WaitAlloc(t, again.ID, volTimeout, StatusComplete, StatusFailed)
		must.Eq(t, StatusComplete, al.ClientStatus, must.Sprint(al.Describe()))
		must.Eq(t, 1, fx.CountFor("ControllerExpandVolume", name))
	})

	t.Run("no_node_info", func(t *testing.T) {
		// StartVolFixture waits for the plugin to be healthy.
		fx := a.StartVolFixture(t, "fxnoinfo", VolFixtureOptions{Args: []string{"--no-node-info"}})
		name := volUniq("noinfo")
		dest := filepath.Join(volDir(a, name), "data")
		job := a.RunVolJob(t, VolJob{Script: "touch " + dest + "/x && echo wrote",
			Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer", Create: true, CreateType: "dir"}}})
		al := a.WaitAlloc(t, job.ID, volTimeout, StatusComplete, StatusFailed)
		must.Eq(t, StatusComplete, al.ClientStatus, must.Sprint(al.Describe()))
		must.StrContains(t, a.AllocLogs(t, al.ID, "t", false), "wrote")
	})
}
