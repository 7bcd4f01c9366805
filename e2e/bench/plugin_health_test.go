//go:build e2e

package bench

// BenchmarkPluginHealth measures how soon a CSI plugin that a task serves
// is seen healthy through the agent's HTTP API, for the same plugin binary
// (the e2e fixture, build/csi/csi-fixture) on the same agent, two ways:
//
//   - driver: the csi driver's own csi_plugin block (e2e/jobs/plugin_task.hcl);
//     "healthy" is the node attribute driver.csi.plugin.<id>.healthy = true
//     in /v1/node/<id>;
//   - native: Nomad's task-level csi_plugin block on a csi-driver task
//     (e2e/jobs/plugin_native.hcl); "healthy" is /v1/plugin/csi/<id>
//     (what "nomad plugin status" shows) with at least one healthy node.
//
// Each is timed from the moment the plugin's socket file appears on the
// host (polled every 10ms) and from the task's StartedAt, to the first
// answer (polled every 10ms) that says healthy; median of -runs runs each,
// after one unmeasured warm-up each, with a fresh plugin id per run. It
// runs once, whatever b.N:
//
//	go test -tags e2e -run '^$' -bench PluginHealth -benchtime 1x ./e2e/bench/ -args -runs 5

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

// phInterval is how often the socket and the API are polled.
const phInterval = 10 * time.Millisecond

// phResult is one plugin start.
type phResult struct {
	socketToHealthy  time.Duration
	startedToHealthy time.Duration
}

func BenchmarkPluginHealth(b *testing.B) {
	root := setup(b)
	fixture, err := e2e.CSIToolPath(root, "csi-fixture")
	if err != nil {
		b.Fatal(err)
	}
	a := e2e.StartAgent(b, e2e.AgentOptions{AllowPrivileged: true})

	ours := func(id string) phResult { return phMeasureDriver(b, a, fixture, id) }
	native := func(id string) phResult { return phMeasureNative(b, a, fixture, id) }
	ours("warm-driver")
	native("warm-native")
	var driverRuns, nativeRuns []phResult
	for i := 0; i < *runs; i++ {
		driverRuns = append(driverRuns, ours(fmt.Sprintf("bench-%d", i)))
		nativeRuns = append(nativeRuns, native(fmt.Sprintf("native-%d", i)))
	}

	col := func(s []phResult, f func(phResult) time.Duration) []time.Duration {
		out := make([]time.Duration, len(s))
		for i, x := range s {
			out[i] = f(x)
		}
		return out
	}
	sock := func(x phResult) time.Duration { return x.socketToHealthy }
	started := func(x phResult) time.Duration { return x.startedToHealthy }
	dSock, nSock := col(driverRuns, sock), col(nativeRuns, sock)
	dStart, nStart := col(driverRuns, started), col(nativeRuns, started)
	b.ReportMetric(float64(median(dSock).Microseconds())/1000, "driver-socket-ms")
	b.ReportMetric(float64(median(nSock).Microseconds())/1000, "native-socket-ms")

	ratio := func(x, y time.Duration) string {
		if y <= 0 {
			return "n/a"
		}
		return fmt.Sprintf("%.2f", float64(x)/float64(y))
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%-52s %s\n", "plugin health (fixture, same agent)", "median  (runs)")
	fmt.Fprintf(&sb, "%-52s %s\n", strings.Repeat("-", 52), strings.Repeat("-", 24))
	fmt.Fprintf(&sb, "%-52s %v  (%s)\n", "socket -> healthy, csi driver csi_plugin (node attr)", median(dSock).Round(time.Millisecond), list(dSock))
	fmt.Fprintf(&sb, "%-52s %v  (%s)\n", "socket -> healthy, Nomad csi_plugin (plugin status)", median(nSock).Round(time.Millisecond), list(nSock))
	fmt.Fprintf(&sb, "%-52s %s\n", "ratio native/driver, from the socket", ratio(median(nSock), median(dSock)))
	fmt.Fprintf(&sb, "%-52s %v  (%s)\n", "task started -> healthy, csi driver csi_plugin", median(dStart).Round(time.Millisecond), list(dStart))
	fmt.Fprintf(&sb, "%-52s %v  (%s)\n", "task started -> healthy, Nomad csi_plugin", median(nStart).Round(time.Millisecond), list(nStart))
	fmt.Fprintf(&sb, "%-52s %s\n", "ratio native/driver, from the task's start", ratio(median(nStart), median(dStart)))
	fmt.Print(sb.String())
}

// phMeasureDriver runs the fixture with the driver's csi_plugin block
// and times it until the node attribute says healthy.
func phMeasureDriver(b *testing.B, a *e2e.Agent, fixture, id string) phResult {
	b.Helper()
	jobID := phSubmit(b, a, "plugin_task", map[string]string{
		"Command": fixture, "Args": e2e.HCLList("--state-dir", filepath.Join(a.Dir, "state-"+id)),
		"Privileged": "true", "PluginID": id, "Type": "monolith",
	})
	defer stop(b, a, jobID)
	socketAt := phWatchFile(filepath.Join(a.DriverRoot, "plugins", id, "csi.sock"))
	healthyAt, err := phPollUntil(time.Minute, func() (bool, error) {
		attrs, err := a.NodeAttributes()
		return err == nil && attrs["driver.csi.plugin."+id+".healthy"] == "true", nil
	})
	if err != nil {
		b.Fatalf("plugin %s (job %s) not healthy: %v\n%s", id, jobID, err, phDescribe(b, a, jobID))
	}
	return phSample(b, a, jobID, socketAt, healthyAt)
}

// phMeasureNative runs the fixture with Nomad's own csi_plugin block
// and times it until Nomad's plugin record has a healthy node.
func phMeasureNative(b *testing.B, a *e2e.Agent, fixture, id string) phResult {
	b.Helper()
	jobID := phSubmit(b, a, "plugin_native", map[string]string{
		"Command": fixture, "Args": e2e.HCLList("--state-dir", filepath.Join(a.Dir, "state-"+id)), "PluginID": id,
	})
	defer stop(b, a, jobID)
	// Nomad puts the socket at <client state dir>/csi/plugins/<alloc id>.
	var allocID string
	if _, err := phPollUntil(time.Minute, func() (bool, error) {
		allocs, err := a.JobAllocations(jobID)
		if err == nil && len(allocs) > 0 {
			allocID = allocs[0].ID
		}
		return allocID != "", nil
	}); err != nil {
		b.Fatalf("job %s has no allocation: %v", jobID, err)
	}
	socketAt := phWatchFile(filepath.Join(a.DataDir, "client", "csi", "plugins", allocID, "csi.sock"))
	healthyAt, err := phPollUntil(time.Minute, func() (bool, error) {
		st, found, err := a.NativeCSIPlugin(id)
		return err == nil && found && st.NodesHealthy >= 1, nil
	})
	if err != nil {
		b.Fatalf("native plugin %s (job %s) not healthy: %v\n%s", id, jobID, err, phDescribe(b, a, jobID))
	}
	return phSample(b, a, jobID, socketAt, healthyAt)
}

// phSample turns the instants of one run into durations.
func phSample(b *testing.B, a *e2e.Agent, jobID string, socketAt <-chan time.Time, healthyAt time.Time) phResult {
	b.Helper()
	var sock time.Time
	select {
	case sock = <-socketAt:
	case <-time.After(5 * time.Second):
		b.Fatalf("job %s: healthy, but its socket never showed up where expected", jobID)
	}
	// The client may tell the server about the plugin's health before it
	// syncs the task's state.
	var startedAt time.Time
	if _, err := phPollUntil(10*time.Second, func() (bool, error) {
		allocs, err := a.JobAllocations(jobID)
		if err == nil && len(allocs) > 0 {
			if ts := allocs[0].TaskStates["plugin"]; ts != nil {
				startedAt = ts.StartedAt
			}
		}
		return !startedAt.IsZero(), nil
	}); err != nil {
		b.Fatalf("job %s: no start time for task plugin: %v", jobID, err)
	}
	return phResult{socketToHealthy: healthyAt.Sub(sock), startedToHealthy: healthyAt.Sub(startedAt)}
}

// phSubmit renders a job from e2e/jobs, parses it through the agent and
// registers it; Close stops it should the benchmark fail first.
func phSubmit(b *testing.B, a *e2e.Agent, name string, vars map[string]string) string {
	b.Helper()
	job, err := a.RenderJob(name, vars)
	if err != nil {
		b.Fatal(err)
	}
	hcl, err := os.ReadFile(job.File)
	if err != nil {
		b.Fatal(err)
	}
	var parsed map[string]any
	if err := a.PutJSON("POST", "/v1/jobs/parse", map[string]any{"JobHCL": string(hcl), "Canonicalize": true}, &parsed); err != nil {
		b.Fatalf("failed to parse %s: %v", job.File, err)
	}
	a.TrackJob(job.ID)
	if err := a.PutJSON("POST", "/v1/jobs", map[string]any{"Job": parsed}, nil); err != nil {
		b.Fatalf("failed to register %s: %v", job.ID, err)
	}
	return job.ID
}

// phWatchFile polls for a path every phInterval, for up to two minutes,
// and sends the first instant it exists.
func phWatchFile(path string) <-chan time.Time {
	ch := make(chan time.Time, 1)
	go func() {
		for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(phInterval) {
			if _, err := os.Stat(path); err == nil {
				ch <- time.Now()
				return
			}
		}
	}()
	return ch
}

// phPollUntil calls done every phInterval until it says true, and returns
// when that was seen.
func phPollUntil(timeout time.Duration, done func() (bool, error)) (time.Time, error) {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := done()
		now := time.Now()
		if err != nil {
			return now, err
		}
		if ok {
			return now, nil
		}
		if now.After(deadline) {
			return now, errors.New("timed out after " + timeout.String())
		}
		time.Sleep(phInterval)
	}
}

func phDescribe(b *testing.B, a *e2e.Agent, jobID string) string {
	allocs, err := a.JobAllocations(jobID)
	if err != nil || len(allocs) == 0 {
		return fmt.Sprintf("(no allocation: %v)", err)
	}
	return a.Allocation(b, allocs[0].ID).Describe()
}
