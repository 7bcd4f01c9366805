//go:build e2e

package e2e

import (
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// Case 4: a rolling update of the plugin's system job (a new version, the
// same job and plugin id) while workloads on two clients use its volumes.
// No workload is disturbed: the same allocation keeps running and reads
// its file; the old plugin instances are not held back by volumes in use
// (no stop_wait); no plugin instance, old or new, reports "unhealthy"
// while it starts (health_timeout) or stops; and the new instance serves
// the old volumes' teardown when the workloads stop. Needs root.
func TestClusterPluginUpdate(t *testing.T) {
	requireCSI(t)
	clusterLong(t)
	csiBin(t, "csi-fixture")
	c := StartCluster(t, clusterClients, AgentOptions{AllowPrivileged: true})
	fx, _ := c.StartClusterFixture(t, "ufx")
	old := runningPluginAllocs(t, c, fx)
	must.MapLen(t, clusterClients, old)

	type workload struct {
		client *Agent
		name   string
		dest   string
		job    Job
		alloc  string
	}
	var ws []*workload
	for _, a := range c.Clients[1:] {
		w := &workload{client: a, name: volUniq("upd")}
		w.dest = filepath.Join(volDir(a, w.name), "data")
		w.job = c.Server.RunVolJob(t, VolJob{
			Type:   "service",
			Node:   a.NodeName(),
			Script: fmt.Sprintf("echo before > %s/file && %s", w.dest, volSleeper),
			Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: w.name, Dest: w.dest,
				Access: "single-node-writer", Create: true}},
		})
		ws = append(ws, w)
	}
	for _, w := range ws {
		w.alloc = c.Server.WaitAlloc(t, w.job.ID, volTimeout, StatusRunning).ID
	}

	c.UpdateClusterFixture(t, fx, "2")
	// Every client runs a new instance of the plugin, and it is healthy.
	var fresh map[string]string
	deadline := time.Now().Add(3 * time.Minute)
	for {
		fresh = runningPluginAllocs(t, c, fx)
		replaced := len(fresh) == clusterClients
		for node, id := range fresh {
			if old[node] == id {
				replaced = false
			}
		}
		if replaced {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the plugin was not replaced on every client: before %v, now %v", old, fresh)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, a := range c.Clients {
		a.WaitVolPluginHealthy(t, fx.ID, 2*time.Minute)
	}

	t.Run("workloads_undisturbed", func(t *testing.T) {
		for _, w := range ws {
			al := c.Server.WaitAlloc(t, w.job.ID, volTimeout, StatusRunning)
			must.Eq(t, w.alloc, al.ID, must.Sprint("the workload was replaced"))
			must.Eq(t, 0, al.Task("t").Restarts, must.Sprint(al.Describe()))
			must.StrContains(t, volExec(t, c.Server, al.ID, "cat "+w.dest+"/file"), "before")
			volExec(t, c.Server, al.ID, "echo after > "+w.dest+"/file2")
		}
	})

	t.Run("plugin_events", func(t *testing.T) {
		for _, id := range append(slices.Collect(maps.Values(old)), slices.Collect(maps.Values(fresh))...) {
			al := c.Server.Allocation(t, id)
			text := al.Describe()
			// Neither while it starts nor, told to stop, when its socket
			// goes (that event says the task is stopping).
			must.StrNotContains(t, text, "unhealthy", must.Sprint("a plugin reported unhealthy"))
			must.StrNotContains(t, text, "Waiting up to", must.Sprint("volumes in use held the plugin's stop"))
		}
	})

	t.Run("new_instance_serves_teardown", func(t *testing.T) {
		for _, w := range ws {
			c.Server.VolStopAndWait(t, w.job.ID, volTimeout)
		}
		for _, w := range ws {
			a := w.client
			must.SliceEmpty(t, a.WaitVolMountsGone(30*time.Second), must.Sprintf("%s mounts", a.NodeName()))
			must.SliceEmpty(t, a.WaitVolJournalClear(30*time.Second), must.Sprintf("%s journal", a.NodeName()))
			// Only the new instance runs on the client now: it served the
			// unpublish and unstage of the volume the old one staged.
			p := fx.On(t, a)
			id := p.VolumeID(w.name)
			must.Eq(t, []string{"CreateVolume", "NodeStageVolume", "NodePublishVolume", "NodeUnpublishVolume", "NodeUnstageVolume"},
				volumeMethods(p, w.name, id), must.Sprintf("calls: %v", p.Calls()))
			al := c.Server.Allocation(t, fresh[a.NodeID])
			must.Eq(t, StatusRunning, al.ClientStatus, must.Sprint(al.Describe()))
		}
	})
}

// runningPluginAllocs maps each client's node id to the running
// allocation of the fixture's job there.
func runningPluginAllocs(t *testing.T, c *Cluster, fx *ClusterFixture) map[string]string {
	t.Helper()
	allocs, err := c.Server.JobAllocations(fx.JobID)
	must.NoError(t, err)
	out := map[string]string{}
	for _, al := range allocs {
		if al.ClientStatus == StatusRunning && al.DesiredStatus == "run" {
			out[al.NodeID] = al.ID
		}
	}
	return out
}

// volumeMethods lists the calls the fixture logged for a volume created
// under name with id, in order, without the stats loop's
// NodeGetVolumeStats, which samples a published volume at any time.
func volumeMethods(p *VolFixture, name, id string) []string {
	var out []string
	for _, c := range p.Calls() {
		m, v, _ := strings.Cut(c, " ")
		if m == "NodeGetVolumeStats" {
			continue
		}
		if v == id || v == "name="+name {
			out = append(out, m)
		}
	}
	return out
}
