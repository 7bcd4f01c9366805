//go:build e2e

package e2e

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// clusterClients is how many clients the cluster cases run.
const clusterClients = 3

// The cluster cases: one server and three clients on this host, each
// client with its own data dir, ports, node name, cgroup_parent and csi
// driver root_dir and cgroup parent (needs root, like every e2e case).
//
// Case 1: the CSI fixture as a system job is healthy on every client, and
// driver-managed volume workloads placed on each client by a constraint
// are each staged and published on their own node only, by the plugin
// instance of that node; stopping them leaves no mount and no journal
// record on any node.
func TestCluster(t *testing.T) {
	requireCSI(t)
	csiBin(t, "csi-fixture") // builds build/csi once
	c := StartCluster(t, clusterClients, AgentOptions{AllowPrivileged: true})

	t.Run("clients_distinct", func(t *testing.T) {
		seen := map[string]string{}
		for i, a := range c.Clients {
			for what, v := range map[string]string{
				"node id": a.NodeID, "node name": a.NodeName(), "data dir": a.DataDir,
				"driver root_dir": a.DriverRoot, "cgroup_parent": a.cgroupParent,
				"driver cgroup parent": a.DriverCgroupParent(),
			} {
				key := what + " " + v
				if prev, ok := seen[key]; ok {
					t.Errorf("client %d has the %s %q of %s", i, what, v, prev)
				}
				seen[key] = fmt.Sprintf("client %d", i)
			}
			must.Eq(t, a.NodeName(), a.Node(t).Name, must.Sprintf("client %d", i))
		}
		var nodes []NodeStub
		must.NoError(t, c.Server.GetJSON("/v1/nodes", &nodes))
		must.Len(t, clusterClients, nodes, must.Sprintf("nodes: %+v", nodes))
	})

	fx, took := c.StartClusterFixture(t, "cfx")
	t.Logf("plugin %s healthy on %d clients %.1fs after submit", fx.ID, clusterClients, took.Seconds())

	t.Run("plugin_on_every_client", func(t *testing.T) {
		allocs, err := c.Server.JobAllocations(fx.JobID)
		must.NoError(t, err)
		on := map[string]int{}
		for _, al := range allocs {
			if al.ClientStatus == StatusRunning {
				on[al.NodeID]++
			}
		}
		for i, a := range c.Clients {
			must.Eq(t, 1, on[a.NodeID], must.Sprintf("running plugin allocations on client %d (%s): %v", i, a.NodeName(), allocs))
		}
	})

	type workload struct {
		client *Agent
		name   string
		job    Job
		alloc  *Allocation
	}
	var ws []*workload
	t.Run("volumes_spread_by_constraint", func(t *testing.T) {
		for _, a := range c.Clients {
			w := &workload{client: a, name: volUniq("spread")}
			dest := filepath.Join(volDir(a, w.name), "data")
			w.job = c.Server.RunVolJob(t, VolJob{
				Type:   "service",
				Node:   a.NodeName(),
				Script: fmt.Sprintf("echo %s > %s/who && %s", a.NodeName(), dest, volSleeper),
				Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: w.name, Dest: dest,
					Access: "single-node-writer", Create: true}},
			})
			ws = append(ws, w)
		}
		for _, w := range ws {
			w.alloc = c.Server.WaitAlloc(t, w.job.ID, volTimeout, StatusRunning)
			must.Eq(t, w.client.NodeID, w.alloc.NodeID, must.Sprintf("job %s placed on %s, not on %s", w.job.ID, w.alloc.NodeID, w.client.NodeName()))
		}
		// Each node's journal holds its own volume only, created and
		// staged by the plugin instance of that node (its state and call
		// log are the node's own), and that instance staged no other
		// volume.
		for i, w := range ws {
			a := w.client
			st, err := a.VolJournal()
			must.NoError(t, err)
			must.Len(t, 1, st.Volumes, must.Sprintf("client %d journal: %v", i, a.VolJournalLeft()))
			v := st.Volumes[0]
			must.Eq(t, fx.ID, v.PluginID)
			must.Eq(t, "staged", v.Stage)
			must.True(t, strings.HasPrefix(v.StagingPath, a.DriverRoot+"/"), must.Sprintf("staging path %s outside client %d's root_dir %s", v.StagingPath, i, a.DriverRoot))
			must.SliceNotEmpty(t, VolMountedAmong([]string{v.StagingPath}), must.Sprintf("client %d: nothing mounted at %s", i, v.StagingPath))
			p := fx.On(t, a)
			must.Eq(t, v.VolumeID, p.VolumeID(w.name), must.Sprintf("client %d: the volume was not created by its own plugin instance", i))
			must.Eq(t, 1, p.Count("NodeStageVolume", ""), must.Sprintf("client %d plugin calls: %v", i, p.Calls()))
			must.Eq(t, 1, p.Count("NodeStageVolume", v.VolumeID))
			for j, other := range ws {
				if j == i {
					continue
				}
				for _, m := range other.client.VolMounts() {
					must.StrNotContains(t, m, v.VolumeID, must.Sprintf("client %d's volume mounted under client %d", i, j))
				}
			}
			out := volExec(t, c.Server, w.alloc.ID, "cat "+filepath.Join(volDir(a, w.name), "data", "who"))
			must.StrContains(t, out, a.NodeName())
		}
	})

	t.Run("native_volumes_placed_by_csi_scheduling", func(t *testing.T) { clusterNativeVolumes(t, c) })

	t.Run("teardown_leaves_nothing", func(t *testing.T) {
		for _, w := range ws {
			c.Server.VolStopAndWait(t, w.job.ID, volTimeout)
		}
		for i, a := range c.Clients {
			must.SliceEmpty(t, a.WaitVolMountsGone(30*time.Second), must.Sprintf("client %d mounts", i))
			must.SliceEmpty(t, a.WaitVolJournalClear(30*time.Second), must.Sprintf("client %d journal", i))
		}
	})
}
