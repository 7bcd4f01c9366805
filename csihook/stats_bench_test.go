package csihook

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
)

// BenchmarkStatsInterval is the cost of one stats interval at 10, 100 and
// 500 published volumes with the in-memory fake plugin: every pass the
// loop makes in a minute (it wakes at the volumes' phases, at most 100
// times an interval: wakeAt), each sampling the volumes due then. What is left is the loop's own cost: finding the
// published volumes, scheduling, keeping the answers, conditions; the
// plugin's cost is the plugin's. cpu-ms/interval is the process's CPU
// time (user and system, every goroutine) per interval; ns/op is its
// wall time; passes/interval says how often the loop woke.
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
			statsPassWait(h.m, ctx, now) // finds the volumes
			passes, iters := 0, 0
			cpu0 := processCPU()
			for b.Loop() {
				end := now.Add(interval)
				for now.Before(end) {
					next := statsPassWait(h.m, ctx, now)
					passes++
					now = wakeAt(now, next, interval)
				}
				iters++
				// The fake keeps every call: forget them, as a real
				// plugin would not hold them for us.
				h.fake.ResetCalls()
			}
			cpu := processCPU() - cpu0
			b.ReportMetric(float64(cpu.Microseconds())/1000/float64(iters), "cpu-ms/interval")
			b.ReportMetric(float64(passes)/float64(iters), "passes/interval")
			b.ReportMetric(float64(n), "volumes")
		})
	}
}

// processCPU is the process's user and system CPU time so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
