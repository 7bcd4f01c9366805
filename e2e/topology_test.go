//go:build e2e

package e2e

// Topology and limits: the fixture (--topology zone=a) creates volumes for
// the node's topology; one that answers a volume made in another zone
// (--created-topology zone=b) has it refused before it is staged; with
// --max-volumes 1 a second volume of the plugin on the node is refused
// before any call, naming max_volumes_per_node, while the first is used.

import (
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
)

func TestVolumeTopology(t *testing.T) {
	t.Parallel()
	a := volAgent(t, false)
	zoned := a.StartVolFixture(t, "fxzone", VolFixtureOptions{Args: []string{"--topology", "zone=a", "--max-volumes", "1"}})
	elsewhere := a.StartVolFixture(t, "fxelse", VolFixtureOptions{Args: []string{"--topology", "zone=a", "--created-topology", "zone=b"}})

	vol := func(fx *VolFixture, id string) VolSpec {
		return VolSpec{Name: "data", Plugin: fx.ID, ID: id, Dest: filepath.Join(volDir(a, id), "data"),
			Access: "single-node-writer", Create: true, CreateType: "dir"}
	}
	// The first volume of the limited plugin: created in the node's zone
	// and used.
	first := volUniq("topo-first")
	held := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{vol(zoned, first)}})
	a.WaitAlloc(t, held.ID, volTimeout, StatusRunning)

	t.Run("max_volumes_per_node", func(t *testing.T) {
		second := volUniq("topo-second")
		job := a.RunVolJob(t, VolJob{Script: "echo SHOULD-NOT-RUN", Volumes: []VolSpec{vol(zoned, second)}})
		al := a.WaitAlloc(t, job.ID, volTimeout, StatusFailed)
		must.StrContains(t, eventsText(al, "t"), `CSI plugin "fxzone" may have at most 1 volumes on node`, must.Sprint(al.Describe()))
		must.StrContains(t, eventsText(al, "t"), "max_volumes_per_node from NodeGetInfo")
		must.Eq(t, 0, zoned.Count("CreateVolume", "name="+second), must.Sprint("a plugin call was made for the refused volume"))
	})
	t.Run("created_elsewhere", func(t *testing.T) {
		id := volUniq("topo-else")
		job := a.RunVolJob(t, VolJob{Script: "echo SHOULD-NOT-RUN", Volumes: []VolSpec{vol(elsewhere, id)}})
		al := a.WaitAlloc(t, job.ID, volTimeout, StatusFailed)
		must.StrContains(t, eventsText(al, "t"), `the plugin created the volume accessible from {zone=b}, which does not include node`, must.Sprint(al.Describe()))
		vid := elsewhere.VolumeID(id)
		must.NotEq(t, "", vid)
		must.Eq(t, 0, elsewhere.Count("NodeStageVolume", vid), must.Sprint("the volume made elsewhere was staged"))
		for _, e := range al.Events("t") {
			must.NotEq(t, "Started", e.Type, must.Sprint("the task started"))
		}
	})
}
