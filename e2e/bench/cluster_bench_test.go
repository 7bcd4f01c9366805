//go:build e2e

package bench

// The cluster benchmarks: one server and three clients on this host
// (e2e.StartCluster), the e2e fixture as the CSI plugin.
//
// BenchmarkClusterPluginHealth: submit of the plugin's system job → the
// plugin healthy on all three clients, for the driver's own csi_plugin
// block (every client's node attribute driver.csi.plugin.<id>.healthy)
// against Nomad's task-level csi_plugin block on a csi-driver task
// (/v1/plugin/csi/<id> counting three healthy nodes); median of
// -cluster-runs runs each, a fresh plugin id per run.
//
// BenchmarkClusterDrain: "nomad node drain -ignore-system" of a client
// running clusterDrainN service workloads, from the drain's start to every
// workload running on another client, with a driver-managed volume each
// against the same workloads without volumes; median of -cluster-runs
// runs each. -ignore-system keeps the plugin, so that both variants drain
// only the workloads.
//
//	go test -tags e2e -run '^$' -bench Cluster -benchtime 1x ./e2e/bench/ -args -cluster-runs 3

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

var clusterRuns = flag.Int("cluster-runs", 2, "measured runs per variant of the cluster benchmarks")

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
	for i := 0; i < *clusterRuns; i++ {
		_, took := c.StartClusterFixture(b, fmt.Sprintf("cph%d", i))
		ours = append(ours, took)
		native = append(native, clusterNativeHealthy(b, c, fixture, fmt.Sprintf("cpn%d", i)))
	}
	b.Logf("submit → plugin healthy on 3 clients: driver csi_plugin %v, native csi_plugin %v", ours, native)
	b.ReportMetric(float64(median(ours).Microseconds())/1000, "driver-ms")
	b.ReportMetric(float64(median(native).Microseconds())/1000, "native-ms")
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
	return time.Since(t0)
}

func BenchmarkClusterDrain(b *testing.B) {
	setup(b)
	c := e2e.StartCluster(b, 3, e2e.AgentOptions{AllowPrivileged: true})
	fx, _ := c.StartClusterFixture(b, "cdr")
	target := c.Clients[1]
	var withVols, without []time.Duration
	for i := 0; i < *clusterRuns; i++ {
		without = append(without, clusterDrainOnce(b, c, target, fx, false))
		withVols = append(withVols, clusterDrainOnce(b, c, target, fx, true))
	}
	b.Logf("drain of %d workloads: with volumes %v, without %v", clusterDrainN, withVols, without)
	b.ReportMetric(float64(median(withVols).Microseconds())/1000, "drain-volumes-ms")
	b.ReportMetric(float64(median(without).Microseconds())/1000, "drain-plain-ms")
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
