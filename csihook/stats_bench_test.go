package csihook

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
)

// BenchmarkStatsInterval is the cost of one stats interval at 10, 100 and
// 500 published volumes with the in-memory fake plugin: every pass the
// loop makes in a minute (it wakes at the volumes' phases, at most 100
// times an interval: wakeAt), each sampling the volumes due then. What is left is the loop's own cost: finding the
// published volumes, scheduling, keeping the answers, conditions; the
// plugin's cost is the plugin's. ns/op is the CPU time of one interval's
// work (the loop does nothing else); passes/interval says how often it
// woke.
func BenchmarkStatsInterval(b *testing.B) {
	for _, n := range []int{10, 100, 500} {
		b.Run(fmt.Sprintf("volumes=%d", n), func(b *testing.B) {
			h := newHarness(b, func(c *Config) { c.Logger = hclog.NewNullLogger() })
			h.setPlugin(statsPlugin("p"))
			putPublished(h, n)
			const interval = time.Minute
			h.m.stats = newStatsLoop(interval)
			ctx := context.Background()
			now := time.Now()
			h.m.statsPass(ctx, now) // finds the volumes
			passes, iters := 0, 0
			for b.Loop() {
				end := now.Add(interval)
				for now.Before(end) {
					next := h.m.statsPass(ctx, now)
					passes++
					now = wakeAt(now, next, interval)
				}
				iters++
				// The fake keeps every call: forget them, as a real
				// plugin would not hold them for us.
				h.fake.ResetCalls()
			}
			b.ReportMetric(float64(passes)/float64(iters), "passes/interval")
			b.ReportMetric(float64(n), "volumes")
		})
	}
}
