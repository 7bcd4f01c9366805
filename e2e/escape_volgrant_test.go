//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// vgGrantSlot marks, in each client's configuration, where the csi
// driver's volume_grant blocks go when the clients restart with them.
const vgGrantSlot = "    # volume_grant blocks (escape_volgrant_test.go)"

// 21c. Another namespace's volume on another node. A volume's owner is
// recorded per node (the first namespace to use it there), so where the
// storage is shared between nodes the owner check of one node knows
// nothing of the others. Two clients whose plugin instances serve the same
// volumes (the fixture's volume directories are one host directory for
// both, as with storage both nodes reach).
//
// Without grants: namespace A's job leaves a marker in a volume on client
// 1; namespace B's job on client 2 names the same plugin_id and volume_id
// and READS it. That is the per-node limit, asserted so that it is
// documented and seen; it is why volume_grant exists.
//
// With volume_grant blocks on both clients (A's volume ids for A, another
// prefix for B): A's job leaves a marker in a volume it was never used
// with on client 2; B's job on client 2 naming it fails with the grant
// refusal, naming namespace B and only B's own grant, before any CSI call
// (client 2's plugin instance is not called for it, nothing is staged,
// mounted or journaled there) and never prints the marker; A's own job on
// client 2 then runs with the same volume and reads the marker.
func TestEscapeNamespaceOtherNode(t *testing.T) {
	requireCSI(t)
	csiBin(t, "csi-fixture") // builds build/csi once
	c := StartCluster(t, 2, AgentOptions{AllowPrivileged: true, DriverConfig: vgGrantSlot})
	one, two := c.Clients[0], c.Clients[1]
	u := escUniq()
	nsA, nsB := "vg-a-"+u, "vg-b-"+u
	escNamespaces(t, c.Server, nsA, nsB)
	t.Cleanup(func() {
		for _, ns := range []string{nsA, nsB} {
			if out, err := c.Server.Nomad("namespace", "delete", ns); err != nil {
				t.Logf("nomad namespace delete %s: %v: %s", ns, err, out)
			}
		}
	})

	const fxID = "vgfx"
	prefixA, prefixB := "vga-"+u+"-", "vgb-"+u+"-"
	v1, v2 := prefixA+"1", prefixA+"2"
	for _, id := range []string{v1, v2} {
		vgSharedVolume(t, c, fxID, id)
	}
	fx, took := c.StartClusterFixture(t, fxID)
	t.Logf("plugin %s healthy on both clients %.1fs after submit", fx.ID, took.Seconds())
	p1, p2 := fx.On(t, one), fx.On(t, two)
	const reader = `cat /data/marker 2>&1; echo DONE`

	t.Run("without_grants_other_node_reads", func(t *testing.T) {
		secret := "VG-A-SECRET-1-" + u
		alA, out := vgRun(t, c, one, nsA, fx.ID, v1, fmt.Sprintf(`echo %s > /data/marker && echo written`, secret))
		if alA.ClientStatus != StatusComplete || !strings.Contains(out, "written") {
			t.Fatalf("namespace %s's job did not write its marker on %s (%s): %q\n%s", nsA, one.NodeName(), alA.ClientStatus, out, alA.Describe())
		}
		alB, out := vgRun(t, c, two, nsB, fx.ID, v1, reader)
		t.Logf("namespace %s's task on %s (%s) said %q", nsB, two.NodeName(), alB.ClientStatus, out)
		// The per-node limit: client 2 never saw the volume used by A,
		// so nothing there says it is A's. This is the hole volume_grant
		// closes; were it closed another way, this case should say so.
		must.Eq(t, StatusComplete, alB.ClientStatus, must.Sprint(alB.Describe()))
		must.StrContains(t, out, secret, must.Sprint("without grants, B on another node should reach A's shared volume (the per-node limit)"))
		must.Eq(t, 1, p2.Count("NodeStageVolume", v1), must.Sprintf("client 2's plugin calls: %v", p2.Calls()))
	})

	// The same grants on both clients; they restart with them (the
	// plugin's task is recovered, and the grants name no plugin job: a
	// csi_plugin task has no volume blocks).
	grants := fmt.Sprintf(`    volume_grant {
      namespace = %q
      plugin_id = %q
      volume_id = %q
    }
    volume_grant {
      namespace = %q
      plugin_id = %q
      volume_id = %q
    }`, nsA, fx.ID, prefixA+"*", nsB, fx.ID, prefixB+"*")
	for _, a := range c.Clients {
		vgRestartWith(t, c, fx, a, grants)
	}

	t.Run("with_grants_other_node_refused", func(t *testing.T) {
		must.SliceEmpty(t, p2.VolumeCalls(v2), must.Sprint("the volume was used on client 2 before the case"))
		must.SliceEmpty(t, two.WaitVolMountsGone(volTimeout), must.Sprint("client 2 mounts before the case"))
		must.SliceEmpty(t, two.WaitVolJournalClear(volTimeout), must.Sprint("client 2 journal before the case"))

		secret := "VG-A-SECRET-2-" + u
		alA, out := vgRun(t, c, one, nsA, fx.ID, v2, fmt.Sprintf(`echo %s > /data/marker && echo written`, secret))
		if alA.ClientStatus != StatusComplete || !strings.Contains(out, "written") {
			t.Fatalf("namespace %s's granted job did not write its marker on %s (%s): %q\n%s", nsA, one.NodeName(), alA.ClientStatus, out, alA.Describe())
		}
		must.Positive(t, p1.Count("NodePublishVolume", v2), must.Sprintf("client 1's plugin calls: %v", p1.Calls()))

		stages, publishes := p2.Count("NodeStageVolume", ""), p2.Count("NodePublishVolume", "")
		alB, out := vgRun(t, c, two, nsB, fx.ID, v2, reader)
		text := eventsText(alB, "t")
		t.Logf("namespace %s's task on %s (%s) said %q; its events:\n%s", nsB, two.NodeName(), alB.ClientStatus, out, text)
		if strings.Contains(out, secret) {
			t.Fatalf("ESCAPED: namespace %s read namespace %s's volume %s on %s, where %s never used it", nsB, nsA, v2, two.NodeName(), nsA)
		}
		must.Eq(t, StatusFailed, alB.ClientStatus, must.Sprint(alB.Describe()))
		must.StrContains(t, text, "is not granted to job")
		must.StrContains(t, text, fmt.Sprintf("in namespace %q", nsB))
		must.StrContains(t, text, fmt.Sprintf(`volume_id %q of plugin %q`, v2, fx.ID))
		// B learns its own grant, never A's.
		must.StrContains(t, text, fmt.Sprintf(`volume_id %q`, prefixB+"*"))
		must.StrNotContains(t, text, prefixA+"*")
		// No CSI call for B, and nothing of v2 on client 2.
		must.SliceEmpty(t, p2.VolumeCalls(v2), must.Sprint("client 2's plugin was called for the refused volume"))
		must.Eq(t, stages, p2.Count("NodeStageVolume", ""), must.Sprintf("client 2's plugin calls: %v", p2.Calls()))
		must.Eq(t, publishes, p2.Count("NodePublishVolume", ""), must.Sprintf("client 2's plugin calls: %v", p2.Calls()))
		must.SliceEmpty(t, two.VolMounts(), must.Sprint("mounts under client 2's staging and publish roots"))
		must.SliceEmpty(t, two.VolJournalLeft(), must.Sprint("client 2's journal"))

		// A, with the id granted to it, runs on client 2 and reads its
		// marker: the refusal was the grant, not the node or the storage.
		alA2, out := vgRun(t, c, two, nsA, fx.ID, v2, reader)
		if alA2.ClientStatus != StatusComplete || !strings.Contains(out, secret) {
			t.Fatalf("namespace %s's granted job on %s did not read its volume (%s): %q\n%s", nsA, two.NodeName(), alA2.ClientStatus, out, alA2.Describe())
		}
		must.Eq(t, 1, p2.Count("NodeStageVolume", v2), must.Sprintf("client 2's plugin calls: %v", p2.Calls()))
	})

	t.Run("teardown_leaves_nothing", func(t *testing.T) {
		for i, a := range c.Clients {
			must.SliceEmpty(t, a.WaitVolMountsGone(volTimeout), must.Sprintf("client %d mounts", i))
			must.SliceEmpty(t, a.WaitVolJournalClear(volTimeout), must.Sprintf("client %d journal", i))
		}
	})
}

// vgSharedVolume gives every client's instance of the cluster fixture of
// plugin fxID a "dir" volume with id (and name) id whose directory is one
// directory of the host for all of them, before the fixture starts (it
// reads its records at its start): storage that both nodes reach.
func vgSharedVolume(t *testing.T, c *Cluster, fxID, id string) {
	t.Helper()
	shared := filepath.Join(c.Server.Dir, "shared-volumes", id)
	must.NoError(t, os.MkdirAll(shared, 0o755))
	rec, err := json.Marshal(map[string]any{"id": id, "name": id, "type": "dir", "capacity_bytes": 0})
	must.NoError(t, err)
	for _, a := range c.Clients {
		state := filepath.Join(c.FixtureStateBase(fxID), a.NodeName(), "state")
		for _, d := range []string{"meta", "volumes"} {
			must.NoError(t, os.MkdirAll(filepath.Join(state, d), 0o755))
		}
		must.NoError(t, os.Symlink(shared, filepath.Join(state, "volumes", id)))
		must.NoError(t, os.WriteFile(filepath.Join(state, "meta", id+".json"), rec, 0o644))
	}
}

// vgRestartWith puts grants into client a's csi driver configuration (at
// vgGrantSlot), restarts the client, and waits until the driver has taken
// the plugin's task back and the plugin is healthy.
func vgRestartWith(t *testing.T, c *Cluster, fx *ClusterFixture, a *Agent, grants string) {
	t.Helper()
	b, err := os.ReadFile(a.ConfigPath)
	must.NoError(t, err)
	must.StrContains(t, string(b), vgGrantSlot)
	must.NoError(t, os.WriteFile(a.ConfigPath, []byte(strings.Replace(string(b), vgGrantSlot, grants, 1)), 0o600))
	var plugin string
	allocs, err := c.Server.JobAllocations(fx.JobID)
	must.NoError(t, err)
	for _, al := range allocs {
		if al.NodeID == a.NodeID && al.ClientStatus == StatusRunning {
			plugin = al.ID
		}
	}
	must.NotEq(t, "", plugin, must.Sprintf("no running plugin allocation on %s: %v", a.NodeName(), allocs))
	start := time.Now()
	must.NoError(t, a.Restart())
	volWaitRecovered(t, a, []string{plugin}, volTimeout)
	a.WaitVolPluginHealthy(t, fx.ID, volTimeout)
	t.Logf("%s restarted with the grants in %v", a.NodeName(), time.Since(start).Round(time.Millisecond))
}

// vgRun runs job escape-ns-volume in namespace ns on client node, as root
// (the fixture's volumes are root's): script in
// task "t" with volume_id volumeID of plugin pluginID at /data, and waits
// until it completes or fails. It returns the allocation and what the task
// printed.
func vgRun(t *testing.T, c *Cluster, node *Agent, ns, pluginID, volumeID, script string) (*Allocation, string) {
	t.Helper()
	job, err := c.Server.RenderJob("escape-ns-volume", map[string]string{
		"Namespace": ns, "Node": node.NodeName(), "User": "root", "PluginID": pluginID,
		"VolumeID": volHCLString(volumeID), "Script": volHCLString(script), "Create": "",
	})
	must.NoError(t, err)
	t.Cleanup(func() { stopNamespaced(t, c.Server, ns, job.ID) })
	out, err := c.Server.Nomad("job", "run", "-detach", job.File)
	must.NoError(t, err, must.Sprint(out))
	al := waitNamespacedAlloc(t, c.Server, ns, job.ID, volTimeout, StatusComplete, StatusFailed)
	must.Eq(t, node.NodeID, al.NodeID, must.Sprintf("job %s/%s placed on %s, not on %s", ns, job.ID, al.NodeID, node.NodeName()))
	logs, err := c.Server.Nomad("alloc", "logs", "-namespace", ns, al.ID, "t")
	if err != nil {
		if !strings.Contains(logs, "not started yet") {
			t.Fatalf("nomad alloc logs -namespace %s %s t failed: %v\n%s", ns, al.ID, err, logs)
		}
		logs = "" // a task refused at its start printed nothing
	}
	return al, logs
}
