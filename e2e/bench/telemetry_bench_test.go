//go:build e2e

package bench

// BenchmarkVolumeTelemetry is what the volume stats loop and the metrics
// endpoint cost a volume task's start on a real agent: two agents side by
// side, one with volume_stats_interval = "1s" and metrics_address set (the
// stats loop at its fastest and the endpoint scraped after every start),
// one with both off (volume_stats_interval = "0", no metrics_address; what
// the driver did before either existed). Each agent runs the e2e fixture
// as a plugin task and keeps -tbusy volume tasks running beside the one
// measured, so the loop on the first agent has volumes to sample while the
// measured task starts. The measured task is a dir volume already created:
// submit -> running and the driver's window from its "Staging volume"
// event to "Started", interleaved between the agents with the order
// alternating, -truns runs each.
//
//	go test -tags e2e -run '^$' -bench VolumeTelemetry -benchtime 1x ./e2e/bench/ -args -truns 7
//
// It checks that what it measures is on: the fixture of the first agent
// must have answered NodeGetVolumeStats for the busy volumes, the second's
// never, and every scrape must carry the driver's CSI call counters.

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

var telRuns = flag.Int("truns", 7, "measured runs of the volume task on each of the two agents")

var telBusy = flag.Int("tbusy", 10, "volume tasks kept running on each agent beside the one measured")

func BenchmarkVolumeTelemetry(b *testing.B) {
	setup(b, e2e.VolBuildCSIBinaries)
	// A unix socket, as the README advises (a TCP endpoint asks for a
	// token file).
	sock := filepath.Join(b.TempDir(), "metrics.sock")
	addr := "unix://" + sock

	type side struct {
		name string
		a    *e2e.Agent
		fx   *e2e.VolFixture
		vol  e2e.VolSpec
		id   string
		busy []string // busy volume IDs
		jobs []string
		sub  []time.Duration
		win  []time.Duration
	}
	sides := []*side{
		{name: "on"},
		{name: "off"},
	}
	for _, s := range sides {
		s := s
		opts := e2e.AgentOptions{AllowPrivileged: true}
		if s.name == "on" {
			opts.DriverConfig = fmt.Sprintf("\n    volume_stats_interval = \"1s\"\n    metrics_address = %q", addr)
		} else {
			opts.DriverConfig = "\n    volume_stats_interval = \"0\""
		}
		s.a = startIsolationAgent(b, opts)
		b.Cleanup(func() {
			volStopAll(b, s.a, s.jobs)
			_ = e2e.VolDetachLoops(s.a.Dir)
		})
		s.fx = s.a.StartVolFixture(b, "fixture", e2e.VolFixtureOptions{})
		s.vol = e2e.VolSpec{Name: "data", Plugin: s.fx.ID, ID: "tel-one", Dest: filepath.Join(s.a.Dir, "dst", "one"), Access: "single-node-writer"}
		warm := s.vol
		warm.Create, warm.CreateType = true, "dir"
		volOne(b, s.a, s.fx, warm, "", nil) // creates the volume; unmeasured
		s.id = s.fx.VolumeID("tel-one")
		volOne(b, s.a, s.fx, s.vol, s.id, nil) // warm-up

		busy := e2e.VolSpec{Name: "data", Plugin: s.fx.ID, ID: "tel-busy-${NOMAD_ALLOC_INDEX}", Interpolate: true,
			Dest: filepath.Join(s.a.Dir, "dst", "busy"), Access: "single-node-writer", Create: true, CreateType: "dir"}
		job := volSubmit(b, s.a, &s.jobs, e2e.VolJob{Type: "service", Count: *telBusy, Script: "exec sleep 3600", Volumes: []e2e.VolSpec{busy}}, nil)
		waitRunning(b, s.a, job, *telBusy, 3*time.Minute)
		for i := 0; i < *telBusy; i++ {
			s.busy = append(s.busy, s.fx.VolumeID(fmt.Sprintf("tel-busy-%d", i)))
		}
	}
	on, off := sides[0], sides[1]
	// The loop samples every busy volume within an interval or two.
	deadline := time.Now().Add(time.Minute)
	for !sampledAll(on.fx, on.busy) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if !sampledAll(on.fx, on.busy) {
		b.Fatalf("the stats loop never sampled every busy volume of the agent with it on: %v", on.fx.Calls())
	}

	b.ResetTimer()
	for i := 0; i < *telRuns; i++ {
		order := sides
		if i%2 == 1 {
			order = []*side{off, on}
		}
		for _, s := range order {
			r := volOne(b, s.a, s.fx, s.vol, s.id, nil)
			s.sub, s.win = append(s.sub, r.submitToRunning), append(s.win, r.stagingToStarted)
			if s == on {
				scrapeCSICalls(b, addr)
			}
		}
	}
	b.StopTimer()

	for _, id := range append([]string{off.id}, off.busy...) {
		if n := off.fx.Count("NodeGetVolumeStats", id); n != 0 {
			b.Fatalf("the agent with the stats loop off called NodeGetVolumeStats %d times for %s", n, id)
		}
	}
	var stats int
	for _, id := range on.busy {
		stats += on.fx.Count("NodeGetVolumeStats", id)
	}

	b.Logf("volume task, telemetry on (stats every 1 s over %d busy volumes, %d NodeGetVolumeStats calls, metrics scraped after each start) vs off, %d runs each:",
		*telBusy, stats, *telRuns)
	b.Logf("  submit->running   on %v  off %v  (on: %s; off: %s)", median(on.sub), median(off.sub), list(on.sub), list(off.sub))
	b.Logf("  Staging->Started  on %v  off %v  (on: %s; off: %s)", median(on.win), median(off.win), list(on.win), list(off.win))
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(median(on.sub)), "on-one-ms")
	b.ReportMetric(ms(median(off.sub)), "off-one-ms")
	b.ReportMetric(ms(median(on.win)), "on-window-ms")
	b.ReportMetric(ms(median(off.win)), "off-window-ms")
}

// sampledAll says whether the fixture has answered NodeGetVolumeStats for
// every one of ids.
func sampledAll(fx *e2e.VolFixture, ids []string) bool {
	for _, id := range ids {
		if fx.Count("NodeGetVolumeStats", id) == 0 {
			return false
		}
	}
	return true
}

// scrapeCSICalls reads the metrics endpoint once and fails unless it
// carries the driver's CSI call counter.
func scrapeCSICalls(b *testing.B, addr string) {
	b.Helper()
	sock := strings.TrimPrefix(addr, "unix://")
	c := http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}}}
	resp, err := c.Get("http://unix/metrics")
	if err != nil {
		b.Fatalf("scrape of %s: %v", addr, err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		b.Fatalf("scrape of %s: %v", addr, err)
	}
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "nomad_driver_csi_csi_calls_total{") {
		b.Fatalf("scrape of %s: status %d, no nomad_driver_csi_csi_calls_total series:\n%.2000s", addr, resp.StatusCode, body)
	}
}
