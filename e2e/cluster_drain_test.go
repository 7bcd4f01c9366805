//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// clusterLong gates the longer cluster cases (drains, plugin updates):
// make e2e-cluster sets it; make e2e runs TestCluster alone.
func clusterLong(t *testing.T) {
	t.Helper()
	if os.Getenv("E2E_CLUSTER_LONG") == "" {
		t.Skip("a longer cluster case: set E2E_CLUSTER_LONG=1 (make e2e-cluster does)")
	}
}

// drainWorkloads is how many volume workloads the drained client runs.
const drainWorkloads = 2

// Case 2: "nomad node drain" of a client that runs volume workloads and
// the plugin (a system job). The workloads move to the other clients; the
// plugin stops last, and only once the teardown of the workloads' volumes
// is done: each volume's NodeUnstageVolume is made to fail on the drained
// client more often than the workload's stop retries it, so its teardown
// is still retried in the background when Nomad stops the plugin, and the
// plugin's stop waits for it (csi_plugin stop_wait, with a task event). The
// drained client is left with no volume mount under its root_dir and no
// journal record. Beside them a workload of a native volume (registered
// with Nomad, served by the fixture with Nomad's csi_plugin block, also a
// system job) runs on the client: it moves too, with its data, and the
// servers hold no claim of the volume for an allocation on the drained
// client, whose instance of that plugin holds nothing staged or published
// and whose Nomad CSI directory has no mount of it. Needs root.
func TestClusterDrain(t *testing.T) {
	requireCSI(t)
	clusterLong(t)
	csiBin(t, "csi-fixture")
	// The workload's stop tries each unstage 5 times; the 9th call
	// succeeds, in the background retry.
	d := startDrainCase(t, "dfx", "1m", "fail Unavailable 8")
	c, fx, target, p := d.c, d.fx, d.target, d.p
	names := d.names

	start := time.Now()
	must.NoError(t, c.Drain(target, 3*time.Minute, false))
	status, err := c.WaitDrained(target, 4*time.Minute)
	must.NoError(t, err)
	t.Logf("drain of %s with %d volume workloads: %s after %.1fs", target.NodeName(), drainWorkloads, status, time.Since(start).Seconds())

	t.Run("workloads_moved", d.workloadsMoved)

	t.Run("plugin_stopped_last_after_teardown", func(t *testing.T) {
		// Nomad calls the drain complete once the plugin's allocation is
		// told to stop; its stop is what waits.
		pa := pluginAllocOn(t, c, fx, target)
		for deadline := time.Now().Add(2 * time.Minute); !IsTerminal(pa.ClientStatus) && time.Now().Before(deadline); {
			time.Sleep(200 * time.Millisecond)
			pa = c.Server.Allocation(t, pa.ID)
		}
		must.True(t, IsTerminal(pa.ClientStatus), must.Sprint(pa.Describe()))
		text := pa.Describe()
		must.StrContains(t, text, `before stopping CSI plugin "dfx": the volume teardown of`)
		must.StrContains(t, text, `Volume teardowns of CSI plugin "dfx" done after`)
		// Each volume's last unstage reached the plugin before it stopped.
		for _, n := range names {
			must.Eq(t, 9, p.Count("NodeUnstageVolume", p.VolumeID(n)), must.Sprintf("calls: %v", p.Calls()))
		}
	})

	t.Run("drained_client_left_clean", func(t *testing.T) {
		must.SliceEmpty(t, target.WaitVolMountsGone(30*time.Second), must.Sprint("volume mounts left on the drained client"))
		must.SliceEmpty(t, target.WaitVolJournalClear(30*time.Second), must.Sprint("journal records left on the drained client"))
	})

	t.Run("native_claims_released", func(t *testing.T) { d.nativeReleased(t, target) })
}

// Case 3: the drain with -ignore-system, then the plugin's job stopped
// while the teardown of the volumes the moved workloads left on the
// drained client cannot finish (every NodeUnstageVolume there fails):
// the plugin's stop waits stop_wait and no longer, and says what is left.
// Nothing is stranded: once the plugin's job runs again on that client,
// the teardown completes (no mount, no journal record, the plugin's
// instance there holds nothing staged or published), and the native
// volume's workload moved with its claim: none is left for the drained
// client (the native plugin, a system job too, stayed). Needs root.
func TestClusterDrainIgnoreSystem(t *testing.T) {
	requireCSI(t)
	clusterLong(t)
	csiBin(t, "csi-fixture")
	d := startDrainCase(t, "ifx", "2s", "fail Unavailable")
	c, fx, target := d.c, d.fx, d.target

	must.NoError(t, c.Drain(target, 3*time.Minute, true))
	_, err := c.WaitDrained(target, 4*time.Minute)
	must.NoError(t, err)
	t.Run("workloads_moved", d.workloadsMoved)
	pa := pluginAllocOn(t, c, fx, target)
	must.Eq(t, StatusRunning, pa.ClientStatus, must.Sprint("the plugin left the client despite -ignore-system:\n", pa.Describe()))

	c.Server.VolStopAndWait(t, fx.JobID, 2*time.Minute)
	t.Run("plugin_stop_bounded", func(t *testing.T) {
		pa := c.Server.Allocation(t, pa.ID)
		must.StrContains(t, pa.Describe(), `Stopping CSI plugin "ifx" after waiting 2s (stop_wait); still pending: the volume teardown of`)
		must.SliceNotEmpty(t, target.VolJournalLeft(), must.Sprint("the teardown cannot have finished"))
	})

	t.Run("teardown_completes_once_the_plugin_runs_again", func(t *testing.T) {
		must.NoError(t, d.p.ClearFaults())
		must.NoError(t, c.SetEligible(target, true))
		c.RerunClusterFixture(t, fx)
		// The background retry's backoff grows to 2 minutes.
		must.SliceEmpty(t, target.WaitVolJournalClear(3*time.Minute), must.Sprint("journal records left on the drained client"))
		must.SliceEmpty(t, target.WaitVolMountsGone(30*time.Second), must.Sprint("volume mounts left on the drained client"))
		for _, n := range d.names {
			held, err := d.p.Held(d.p.VolumeID(n))
			must.NoError(t, err)
			must.SliceEmpty(t, held, must.Sprintf("the plugin on the drained client still holds volume %s", n))
		}
	})

	t.Run("native_claims_released", func(t *testing.T) { d.nativeReleased(t, target) })
	// The workloads go before the plugin that serves them (the cleanup
	// stops the newest job first).
	for _, j := range d.jobs {
		c.Server.VolStopAndWait(t, j.ID, volTimeout)
	}
}

// drainCase is a cluster whose client target runs drainWorkloads volume
// workloads (service jobs free to move) beside the fixture plugin, with
// the fixture on target answering each volume's NodeUnstageVolume with
// the fault unstageFault ("fail Unavailable 8").
type drainCase struct {
	c            *Cluster
	fx           *ClusterFixture
	target       *Agent
	p            *VolFixture
	jobs         []Job
	names, dests []string
	// before maps each job to its allocation on target.
	before map[string]string
	// The native volume nvol of plugin nfx, used at ndest by job njob.
	nfx   *ClusterNativeFixture
	nvol  string
	njob  Job
	ndest string
}

func startDrainCase(t *testing.T, pluginID, stopWait, unstageFault string) *drainCase {
	t.Helper()
	c := StartCluster(t, clusterClients, AgentOptions{AllowPrivileged: true})
	fx, _ := c.StartClusterFixtureWith(t, pluginID, map[string]string{"StopWait": stopWait})
	target := c.Clients[1]
	// The native plugin goes on every client before they turn ineligible.
	nvol := volUniq(pluginID + "-native")
	nfx, err := c.StartClusterNativeFixture(pluginID+"n", nvol)
	must.NoError(t, err)

	// The workloads go to the target: the other clients take nothing new
	// until the drain.
	for _, a := range c.Clients {
		if a != target {
			must.NoError(t, c.SetEligible(a, false))
		}
	}
	d := &drainCase{c: c, fx: fx, target: target, before: map[string]string{}, nfx: nfx, nvol: nvol}
	d.ndest = filepath.Join(c.Server.Dir, "mnt", d.nvol)
	d.njob, err = c.Server.RenderJob("native_workload", map[string]string{
		"Driver": DriverName, "Type": "service", "Count": "1", "VolumeID": d.nvol, "AccessMode": "single-node-writer",
		"Dest": d.ndest, "Script": fmt.Sprintf("echo native > %s/file\nexec sleep 3600", d.ndest),
	})
	must.NoError(t, err)
	_, err = c.Server.SubmitRendered(d.njob)
	must.NoError(t, err)
	for i := 0; i < drainWorkloads; i++ {
		name := volUniq(fmt.Sprintf("drain%d", i))
		dest := filepath.Join(volDir(c.Server, name), "data")
		d.dests = append(d.dests, dest)
		d.jobs = append(d.jobs, c.Server.RunVolJob(t, VolJob{
			Type:   "service",
			Script: fmt.Sprintf("echo written > %s/file && %s", dest, volSleeper),
			Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest,
				Access: "single-node-writer", Create: true}},
		}))
		d.names = append(d.names, name)
	}
	for _, j := range append([]Job{d.njob}, d.jobs...) {
		al := c.Server.WaitAlloc(t, j.ID, volTimeout, StatusRunning)
		must.Eq(t, target.NodeID, al.NodeID, must.Sprintf("job %s placed on %s", j.ID, al.NodeID))
		d.before[j.ID] = al.ID
	}
	for _, a := range c.Clients {
		must.NoError(t, c.SetEligible(a, true))
	}
	must.Len(t, 2*drainWorkloads, target.VolJournalLeft(), must.Sprint("a volume and a task record per workload"))

	d.p = fx.On(t, target)
	var rules []string
	for _, n := range d.names {
		rules = append(rules, "NodeUnstageVolume "+n+" "+unstageFault)
	}
	must.NoError(t, d.p.SetFaults(rules...))
	t.Cleanup(func() { _ = d.p.ClearFaults() })
	return d
}

// workloadsMoved checks that every workload runs again, on another client
// than target, with its volume writable.
func (d *drainCase) workloadsMoved(t *testing.T) {
	for i, j := range d.jobs {
		al := d.c.Server.WaitAlloc(t, j.ID, volTimeout, StatusRunning)
		must.NotEq(t, d.before[j.ID], al.ID)
		must.NotEq(t, d.target.NodeID, al.NodeID, must.Sprintf("job %s still on the drained client", j.ID))
		out := volExec(t, d.c.Server, al.ID, "cat "+d.dests[i]+"/file")
		must.StrContains(t, out, "written")
	}
	// The native volume's workload, with what it wrote on target.
	al := d.c.Server.WaitAlloc(t, d.njob.ID, volTimeout, StatusRunning)
	must.NotEq(t, d.before[d.njob.ID], al.ID)
	must.NotEq(t, d.target.NodeID, al.NodeID, must.Sprintf("job %s still on the drained client", d.njob.ID))
	must.StrContains(t, volExec(t, d.c.Server, al.ID, "cat "+d.ndest+"/file"), "native")
}

// nativeReleased checks that nothing of the native volume is left on
// client a: the servers hold no read or write claim of it for an
// allocation on a (the volume watcher released it), the plugin's instance
// on a holds nothing staged or published, and nothing under a's Nomad CSI
// directory is a mount of it. The workload that moved holds its claim
// elsewhere.
func (d *drainCase) nativeReleased(t *testing.T, a *Agent) {
	left, err := d.c.Server.WaitNativeClaimsOffNode(d.nvol, a.NodeID, 2*time.Minute)
	must.NoError(t, err)
	must.SliceEmpty(t, left, must.Sprintf("claims of volume %s left for allocations on %s: %v", d.nvol, a.NodeName(), left))
	v, err := d.c.Server.NativeVolume(d.nvol)
	must.NoError(t, err)
	must.MapLen(t, 1, v.WriteAllocs, must.Sprint("the moved workload's claim"))
	held, err := d.nfx.Held(a, d.nvol)
	must.NoError(t, err)
	must.SliceEmpty(t, held, must.Sprintf("the native plugin on %s still holds volume %s", a.NodeName(), d.nvol))
	must.SliceEmpty(t, mountsNaming(t, a.NativeCSIDir(), d.nvol), must.Sprintf("mounts of volume %s left on %s", d.nvol, a.NodeName()))
}

// pluginAllocOn returns the newest allocation of the fixture's job on
// client a.
func pluginAllocOn(t *testing.T, c *Cluster, fx *ClusterFixture, a *Agent) *Allocation {
	t.Helper()
	allocs, err := c.Server.JobAllocations(fx.JobID)
	must.NoError(t, err)
	for _, al := range allocs {
		if al.NodeID == a.NodeID {
			return c.Server.Allocation(t, al.ID)
		}
	}
	t.Fatalf("no allocation of %s on %s: %v", fx, a.NodeName(), allocs)
	return nil
}
