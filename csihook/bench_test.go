package csihook

import (
	"context"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
)

// BenchmarkSetupTeardown times Setup and Teardown of one fresh volume with
// the in-memory fake plugin, so what is left is the manager's own cost:
// mostly the journal's synced writes. The journal directory is on the
// file system of the test's temporary directory. Sub-benchmarks: a plugin
// that attaches and stages (full) and one that only stages (stage).
func BenchmarkSetupTeardown(b *testing.B) {
	for _, bc := range []struct {
		name string
		info PluginInfo
	}{
		{"full", fullPlugin("p")},
		{"stage", PluginInfo{ID: "p", Socket: "/run/p.sock", NodeID: "node-1", Healthy: true, StageUnstage: true}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			h := newHarness(b, func(c *Config) { c.Logger = hclog.NewNullLogger() })
			h.setPlugin(bc.info)
			ctx := context.Background()
			reqs := []VolumeRequest{req("data", "vol1", "/data")}
			var setup, teardown time.Duration
			n := 0
			for b.Loop() {
				t0 := time.Now()
				if _, err := h.m.Setup(ctx, "task-a", reqs); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if err := h.m.Teardown(ctx, "task-a"); err != nil {
					b.Fatal(err)
				}
				setup, teardown, n = setup+t1.Sub(t0), teardown+time.Since(t1), n+1
			}
			b.ReportMetric(float64(setup.Microseconds())/float64(n), "setup-µs/op")
			b.ReportMetric(float64(teardown.Microseconds())/float64(n), "teardown-µs/op")
		})
	}
}
