package driver

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"
)

// BenchmarkStartTaskTelemetry is the start of a task with one fresh volume
// with the volume stats loop (every second) and the metrics endpoint on,
// against the same start with both off (volume_stats_interval = "0", no
// metrics_address): two drivers, each with its own fixture plugin task,
// interleaved in each iteration, the order alternating. Root, as the other
// start benchmarks. It reports the medians (on-ms, off-ms) and their
// ratio.
func BenchmarkStartTaskTelemetry(b *testing.B) {
	addr := "unix://" + filepath.Join(shortTempDir(b), "metrics.sock")
	on := newStartBench(b, func(c *Config) {
		c.CgroupParent = "nomad-csi-bench-on"
		c.VolumeStatsInterval = "1s"
		c.MetricsAddress = addr
	})
	off := newStartBench(b, func(c *Config) {
		c.CgroupParent = "nomad-csi-bench-off"
		c.VolumeStatsInterval = "0"
	})
	var onTimes, offTimes []time.Duration
	b.ResetTimer()
	b.StopTimer()
	for i := 0; i < b.N; i++ {
		run := func(e *startBench, kind string, times *[]time.Duration) {
			task := e.task(b, fmt.Sprintf("%s%d", kind, i), TaskConfig{
				Command: "/bin/true",
				Volumes: map[string]VolumeConfig{"data": e.volume(b, fmt.Sprintf("%s-%d", kind, i))},
			}, false)
			*times = append(*times, e.start(b, task))
		}
		if i%2 == 0 {
			run(on, "on", &onTimes)
			run(off, "off", &offTimes)
		} else {
			run(off, "off", &offTimes)
			run(on, "on", &onTimes)
		}
	}
	a, z := median(onTimes), median(offTimes)
	b.ReportMetric(float64(a.Microseconds())/1000, "on-ms")
	b.ReportMetric(float64(z.Microseconds())/1000, "off-ms")
	b.ReportMetric(float64(a)/float64(z), "ratio")
}
