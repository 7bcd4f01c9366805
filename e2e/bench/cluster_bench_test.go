//go:build e2e

package bench

// The cluster benchmarks: one server and three clients on this host
// (e2e.StartCluster), the e2e fixture as the CSI plugin.
//
// BenchmarkClusterPluginHealth: submit of the plugin's system job → the
// plugin healthy on all three clients, for the driver's own csi_plugin
// block (every client's node attribute driver.csi.plugin.<id>.healthy)
// against Nomad's task-level csi_plugin block on a csi-driver task
// (/v1/plugin/csi/<id> counting three healthy nodes); median and spread
// (fastest–slowest) of -health-runs runs each, interleaved, a fresh plugin
// id per run, each plugin job stopped before the next is submitted.
//
// BenchmarkClusterDrain: "nomad node drain -ignore-system" of a client
// running clusterDrainN service workloads, from the drain's start to every
// workload running on another client, with a driver-managed volume each
// against the same workloads without volumes; median and spread of
// -drain-runs runs each, interleaved. -ignore-system keeps the plugin, so
// that both variants drain only the workloads.
//
//	go run -tags e2e ./e2e/bench/cmd/benchtable -bench 'ClusterPluginHealth|ClusterDrain|RepairStale'
//	go test -tags e2e -run '^$' -bench ClusterDrain -benchtime 1x ./e2e/bench/ -args -drain-runs 3

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

var (
	healthRuns = flag.Int("health-runs", 5, "measured runs per variant of BenchmarkClusterPluginHealth")
	drainRuns  = flag.Int("drain-runs", 3, "measured runs per variant of BenchmarkClusterDrain")
)

// clusterDrainN is how many workloads the drained client runs.
const clusterDrainN = 3

func BenchmarkClusterPluginHealth(b *testing.B) {
	root := setup(b)
	fixture, err := e2e.CSIToolPath(root, "csi-fixture")
	if err != nil {
		b.Fatal(err)
	}
	c := e2e.StartCluster(b, 3, e2e.AgentOptions{AllowPrivileged: true})
	var ours, native []time.Duration
	for i := 0; i < *healthRuns; i++ {
		fx, took := c.StartClusterFixture(b, fmt.Sprintf("cph%d", i))
		ours = append(ours, took)
		// Each variant runs alone: the fixtures of earlier runs would
		// load the clients more with every run.
		c.Server.VolStopAndWait(b, fx.JobID, 2*time.Minute)
		native = append(native, clusterNativeHealthy(b, c, fixture, fmt.Sprintf("cpn%d", i)))
	}
	b.Logf("submit → plugin healthy on 3 clients: driver csi_plugin %s; native csi_plugin %s", spread(ours), spread(native))
	b.ReportMetric(float64(median(ours).Microseconds())/1000, "driver-ms")
	b.ReportMetric(float64(median(native).Microseconds())/1000, "native-ms")
	b.ReportMetric(float64((slowest(ours)-fastest(ours)).Microseconds())/1000, "driver-spread-ms")
	b.ReportMetric(float64((slowest(native)-fastest(native)).Microseconds())/1000, "native-spread-ms")
}

// spread says the median, fastest and slowest of ds and lists them all.
func spread(ds []time.Duration) string {
	r := func(d time.Duration) time.Duration {
		if d >= time.Second {
			return d.Round(10 * time.Millisecond)
		}
		return d.Round(10 * time.Microsecond)
	}
	return fmt.Sprintf("median %v, %v–%v over %d runs (%s)", r(median(ds)), r(fastest(ds)), r(slowest(ds)), len(ds), list(ds))
}

func fastest(ds []time.Duration) time.Duration {
	var m time.Duration
	for i, d := range ds {
		if i == 0 || d < m {
			m = d
		}
	}
	return m
}

func slowest(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		if d > m {
			m = d
		}
	}
	return m
}

// clusterNativeHealthy runs the fixture with Nomad's csi_plugin block as a
// system job and returns how long from its submission until the servers
// count it healthy on every client.
func clusterNativeHealthy(b *testing.B, c *e2e.Cluster, fixture, id string) time.Duration {
	b.Helper()
	base := filepath.Join(c.Server.Dir, "fx-"+id)
	for _, a := range c.Clients {
		if err := os.MkdirAll(filepath.Join(base, a.NodeName()), 0o755); err != nil {
			b.Fatal(err)
		}
	}
	job, err := c.Server.RenderJob("cluster_plugin_native", map[string]string{
		"PluginID": id, "Command": fixture, "StateBase": base, "MountDir": filepath.Join(c.Server.Dir, "sock-"+id),
	})
	if err != nil {
		b.Fatal(err)
	}
	t0, err := c.Server.SubmitRendered(job)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := c.Server.WaitNativePlugin(id, len(c.Clients), len(c.Clients), 3*time.Minute); err != nil {
		b.Fatal(err)
	}
	took := time.Since(t0)
	if err := c.Server.StopWaitPurge(job.ID, false, 2*time.Minute); err != nil {
		b.Fatal(err)
	}
	return took
}

func BenchmarkClusterDrain(b *testing.B) {
	setup(b)
	c := e2e.StartCluster(b, 3, e2e.AgentOptions{AllowPrivileged: true})
	fx, _ := c.StartClusterFixture(b, "cdr")
	target := c.Clients[1]
	var withVols, without []time.Duration
	for i := 0; i < *drainRuns; i++ {
		without = append(without, clusterDrainOnce(b, c, target, fx, false))
		withVols = append(withVols, clusterDrainOnce(b, c, target, fx, true))
	}
	b.Logf("drain of %d workloads: with volumes %s; without %s", clusterDrainN, spread(withVols), spread(without))
	b.ReportMetric(float64(median(withVols).Microseconds())/1000, "drain-volumes-ms")
	b.ReportMetric(float64(median(without).Microseconds())/1000, "drain-plain-ms")
	b.ReportMetric(float64((slowest(withVols)-fastest(withVols)).Microseconds())/1000, "drain-volumes-spread-ms")
	b.ReportMetric(float64((slowest(without)-fastest(without)).Microseconds())/1000, "drain-plain-spread-ms")
}

// clusterDrainOnce places clusterDrainN workloads on target, drains it
// with -ignore-system and returns how long until every workload runs on
// another client; it then stops them and makes target eligible again.
func clusterDrainOnce(b *testing.B, c *e2e.Cluster, target *e2e.Agent, fx *e2e.ClusterFixture, volumes bool) time.Duration {
	b.Helper()
	for _, a := range c.Clients {
		if err := c.SetEligible(a, a == target); err != nil {
			b.Fatal(err)
		}
	}
	var jobs []e2e.Job
	for i := 0; i < clusterDrainN; i++ {
		j := e2e.VolJob{Type: "service", Script: "exec sleep 3600"}
		if volumes {
			name := fmt.Sprintf("cdr-%d-%d", time.Now().UnixNano()%1e9, i)
			dest := filepath.Join(c.Server.Dir, "dst", name)
			j.Script = fmt.Sprintf("echo x > %s/f && exec sleep 3600", dest)
			j.Volumes = []e2e.VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer", Create: true}}
		}
		jobs = append(jobs, c.Server.RunVolJob(b, j))
	}
	before := map[string]string{}
	for _, j := range jobs {
		before[j.ID] = c.Server.WaitAlloc(b, j.ID, 2*time.Minute, e2e.StatusRunning).ID
	}
	for _, a := range c.Clients {
		if a != target {
			if err := c.SetEligible(a, true); err != nil {
				b.Fatal(err)
			}
		}
	}
	start := time.Now()
	if err := c.Drain(target, 5*time.Minute, true); err != nil {
		b.Fatal(err)
	}
	for _, j := range jobs {
		for {
			allocs, err := c.Server.JobAllocations(j.ID)
			if err != nil {
				b.Fatal(err)
			}
			if len(allocs) > 0 && allocs[0].ID != before[j.ID] && allocs[0].ClientStatus == e2e.StatusRunning && allocs[0].NodeID != target.NodeID {
				break
			}
			if time.Since(start) > 5*time.Minute {
				b.Fatalf("job %s did not move off %s: %+v", j.ID, target.NodeName(), allocs)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if _, err := c.WaitDrained(target, 5*time.Minute); err != nil {
		b.Fatal(err)
	}
	took := time.Since(start)
	for _, j := range jobs {
		c.Server.VolStopAndWait(b, j.ID, 2*time.Minute)
	}
	return took
}
