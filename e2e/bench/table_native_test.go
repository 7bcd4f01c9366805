//go:build e2e

package bench

// BenchmarkVolumeJobRun measures submit -> running for a task with a CSI
// volume in three set-ups, side by side on one agent, runs interleaved:
//
//   - managed-csi: a driver-managed volume (the csi driver's volume block,
//     served by a plugin task with the driver's own csi_plugin block), on
//     driver = "csi";
//   - native-csi: a volume of Nomad's own CSI (nomad volume create, a
//     group volume block), served by a plugin task with Nomad's
//     task-level csi_plugin block run by the csi driver, on driver = "csi";
//   - native-exec: the same native volume on Nomad's exec driver.
//
// Each plugin is the csi-fixture, and every volume is an ext4 image on a
// loop device, so each run stages (losetup + mount) and publishes (bind)
// the volume and tears it down afterwards: the next run starts only after
// the previous job's allocation is gone and, for native volumes, Nomad has
// released its claim (not timed). "submit" is the job's registration over
// the HTTP API (what "nomad job run -detach" does after parsing; the parse
// is not timed); "running" is the task's StartedAt.
//
//	go test -tags e2e -run '^$' -bench VolumeJobRun -benchtime 1x ./e2e/bench/ -args -volume-job-runs 5

import (
	"flag"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

var volumeJobRuns = flag.Int("volume-job-runs", 5, "measured submit->running runs per set-up in BenchmarkVolumeJobRun")

// tnSetups are the set-ups of BenchmarkVolumeJobRun, in the order they run.
var tnSetups = []string{"managed-csi", "native-csi", "native-exec"}

func BenchmarkVolumeJobRun(b *testing.B) {
	root := setup(b)
	if err := e2e.CheckFixture(root); err != nil {
		b.Fatal(err)
	}
	var dir string
	b.Cleanup(func() {
		if dir != "" {
			_ = e2e.DetachNativeLoops(dir)
		}
	})
	a := e2e.StartAgent(b, e2e.AgentOptions{AllowPrivileged: true, Drivers: []string{e2e.DriverName, "exec"}})
	dir = a.Dir

	// Both plugins, and the native volume.
	managed, err := a.RenderJob("native_managed_plugin", a.ManagedPluginVars("bmanaged"))
	tnNoErr(b, err)
	_, err = a.SubmitRendered(managed)
	tnNoErr(b, err)
	native, err := a.RenderJob("native_plugin", a.NativePluginVars("bnative", true, "host"))
	tnNoErr(b, err)
	_, err = a.SubmitRendered(native)
	tnNoErr(b, err)
	_, err = a.WaitNativePlugin("bnative", 1, 1, 90*time.Second)
	tnNoErr(b, err)
	tnNoErr(b, tnWaitAttr(a, "driver.csi.plugin.bmanaged.healthy", "true", 60*time.Second))
	tnNoErr(b, a.CreateNativeVolume("bench-native", "bnative", "single-node-writer", "ext4"))
	b.Cleanup(func() {
		// Before the agent's Close (cleanups run last-in first-out):
		// the volume is deleted while its plugin still runs.
		if _, err := a.WaitNativeVolumeReleased("bench-native", time.Minute); err != nil {
			b.Logf("%v", err)
		}
		if err := a.DeleteNativeVolume("bench-native", 30*time.Second); err != nil {
			b.Logf("%v", err)
		}
	})

	// One unmeasured warm-up each (the driver-managed volume is created
	// then; exec builds its first chroot).
	for _, s := range tnSetups {
		tnRunOne(b, a, s)
	}
	samples := map[string][]time.Duration{}
	for i := 0; i < *volumeJobRuns; i++ {
		for _, s := range tnSetups {
			samples[s] = append(samples[s], tnRunOne(b, a, s))
		}
	}

	med := map[string]time.Duration{}
	for _, s := range tnSetups {
		med[s] = tnMedian(samples[s])
		b.ReportMetric(float64(med[s].Microseconds())/1000, s+"-ms")
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%-48s %s\n", "volume task, submit->running", "median (runs)")
	for _, s := range tnSetups {
		fmt.Fprintf(&sb, "%-48s %v  (%s)\n", s, med[s].Round(time.Millisecond), tnList(samples[s]))
	}
	fmt.Fprintf(&sb, "%-48s %s\n", "ratio native-csi/managed-csi", tnRatio(med["native-csi"], med["managed-csi"]))
	fmt.Fprintf(&sb, "%-48s %s\n", "ratio native-exec/native-csi", tnRatio(med["native-exec"], med["native-csi"]))
	fmt.Print(sb.String())
}

// tnRunOne runs one sleeping task with a volume in set-up s, returns
// submit -> running, and waits until the job is gone and its volume free.
func tnRunOne(b *testing.B, a *e2e.Agent, s string) time.Duration {
	b.Helper()
	dest := filepath.Join(a.Dir, "mnt", s)
	script := "exec sleep 3600"
	var job e2e.Job
	var err error
	switch s {
	case "managed-csi":
		job, err = a.RenderJob("native_managed_workload", map[string]string{
			"Type": "service", "Count": "1", "PluginID": "bmanaged", "VolumeID": "bench-managed",
			"Dest": dest, "AccessMode": "single-node-writer", "VolumeType": "ext4", "Script": script,
		})
	case "native-csi", "native-exec":
		driver := e2e.DriverName
		if s == "native-exec" {
			driver = "exec"
		}
		job, err = a.RenderJob("native_workload", map[string]string{
			"Driver": driver, "Type": "service", "Count": "1", "VolumeID": "bench-native",
			"AccessMode": "single-node-writer", "Dest": dest, "Script": script,
		})
	default:
		b.Fatalf("unknown set-up %q", s)
	}
	tnNoErr(b, err)
	t0, err := a.SubmitRendered(job)
	tnNoErr(b, err)
	started, _ := waitTaskRunning(b, a, job.ID, "t", 2*time.Minute)
	tnNoErr(b, a.StopWaitPurge(job.ID, true, time.Minute))
	if strings.HasPrefix(s, "native") {
		_, err := a.WaitNativeVolumeReleased("bench-native", time.Minute)
		tnNoErr(b, err)
	}
	return started.Sub(t0)
}

func tnWaitAttr(a *e2e.Agent, key, want string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var got string
	for time.Now().Before(deadline) {
		var n e2e.Node
		if err := a.GetJSON("/v1/node/"+a.NodeID, &n); err == nil {
			if got = n.Attributes[key]; got == want {
				return nil
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("node attribute %s is %q after %v, want %q", key, got, timeout, want)
}

func tnNoErr(b *testing.B, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}

func tnMedian(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func tnList(ds []time.Duration) string {
	parts := make([]string, 0, len(ds))
	for _, d := range ds {
		parts = append(parts, fmt.Sprint(d.Milliseconds()))
	}
	return strings.Join(parts, ",") + " ms"
}

func tnRatio(x, y time.Duration) string {
	if x == 0 || y == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2f", float64(x)/float64(y))
}
