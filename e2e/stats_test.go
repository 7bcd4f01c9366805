//go:build e2e

package e2e

// Volume stats and health on a real agent: the driver samples each
// published volume of the fixture with NodeGetVolumeStats (real statfs
// numbers) every second; a condition the fixture is told to report
// abnormal becomes a task event, with the plugin's control characters
// escaped, and another event when it is normal again; a volume torn down
// is not asked again while another one still is.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

func TestVolumeStats(t *testing.T) {
	t.Parallel()
	a, addr := statsAgent(t)
	fx := a.StartVolFixture(t, "statsfx", VolFixtureOptions{})

	run := func(name string) (string, string, string) {
		dest := filepath.Join(volDir(a, name), "data")
		job := a.RunVolJob(t, VolJob{Type: "service",
			Script:  fmt.Sprintf("head -c 1048576 /dev/zero > %s/blob && echo wrote && sleep 600", dest),
			Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Create: true, CreateType: "dir"}}})
		al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
		a.WaitLogs(t, al.ID, "t", "wrote", volTimeout)
		return job.ID, al.ID, fx.VolumeID(name)
	}
	nameA, nameB := volUniq("stats-a"), volUniq("stats-b")
	jobA, allocA, idA := run(nameA)
	_, _, idB := run(nameB)
	must.NotEq(t, "", idA)

	// Stats appear: sampled again and again, with the real numbers of
	// the volume's file system on the endpoint.
	volWaitAtLeast(t, fx, "NodeGetVolumeStats", idA, 2, 30*time.Second)
	used := waitMetric(t, addr, fmt.Sprintf(`nomad_driver_csi_volume_bytes{plugin_id="statsfx",state="used",volume_id=%q}`, idA), 0, 30*time.Second)
	total := waitMetric(t, addr, fmt.Sprintf(`nomad_driver_csi_volume_bytes{plugin_id="statsfx",state="total",volume_id=%q}`, idA), 0, 30*time.Second)
	inodes := waitMetric(t, addr, fmt.Sprintf(`nomad_driver_csi_volume_inodes{plugin_id="statsfx",state="used",volume_id=%q}`, idA), 0, 30*time.Second)
	must.Greater(t, used, total)
	t.Logf("volume %s: %.0f of %.0f bytes used, %.0f inodes used", idA, used, total, inodes)
	text, err := scrapeMetrics(addr)
	must.NoError(t, err)
	abn, ok := metricValue(text, fmt.Sprintf(`nomad_driver_csi_volume_abnormal{plugin_id="statsfx",volume_id=%q}`, idA))
	must.True(t, ok)
	must.Eq(t, 0, abn)

	// The operator CLI shows the driver's last sample beside its own call.
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, errOut, err := runDriverCLI(t, a, "stats", idA, "-root-dir", a.DriverRoot)
		if err == nil && strings.Contains(out, "Driver's last sample at") {
			t.Logf("stats:\n%s", out)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("stats %s shows no last sample of the driver (%v):\n%s%s", idA, err, out, errOut)
		}
		time.Sleep(200 * time.Millisecond)
	}

	// An abnormal condition, with a terminal escape a hostile plugin
	// could send, becomes one event on the task, escaped.
	rules := filepath.Join(fx.StateDir, "conditions")
	must.NoError(t, os.WriteFile(rules, []byte(nameA+` "disk \x1b[31mon fire\nfake line"`+"\n"), 0o644))
	al := volWaitEvent(t, a, allocA, `is abnormal: disk \x1b[31mon fire\nfake line`, 30*time.Second)
	must.StrNotContains(t, eventsText(al, "t"), "\x1b")
	waitMetric(t, addr, fmt.Sprintf(`nomad_driver_csi_volume_abnormal{plugin_id="statsfx",volume_id=%q}`, idA), 0, 30*time.Second)

	// It clears with another event once the plugin says normal.
	must.NoError(t, os.Remove(rules))
	al = volWaitEvent(t, a, allocA, "is normal again", 30*time.Second)
	abnormal := 0
	for _, e := range al.Events("t") {
		if strings.Contains(e.Text(), "is abnormal") {
			abnormal++
		}
	}
	must.Eq(t, 1, abnormal, must.Sprint(al.Describe()))
	t.Logf("events:\n%s", eventsText(al, "t"))

	// A volume torn down is asked no more, while the other one still is.
	a.VolStopAndWait(t, jobA, volTimeout)
	volWaitAtLeast(t, fx, "NodeUnpublishVolume", idA, 1, volTimeout)
	after := fx.Count("NodeGetVolumeStats", idA)
	b0 := fx.Count("NodeGetVolumeStats", idB)
	volWaitAtLeast(t, fx, "NodeGetVolumeStats", idB, b0+3, 30*time.Second)
	must.Eq(t, after, fx.Count("NodeGetVolumeStats", idA), must.Sprintf("calls for %s: %v", idA, fx.VolumeCalls(idA)))
	text, err = scrapeMetrics(addr)
	must.NoError(t, err)
	must.StrNotContains(t, text, idA)
}

// volWaitAtLeast waits until the fixture saw at least n calls of method
// for volID.
func volWaitAtLeast(t *testing.T, fx *VolFixture, method, volID string, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for fx.Count(method, volID) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d %s calls for %s within %v, want at least %d; calls: %v", fx.Count(method, volID), method, volID, timeout, n, fx.VolumeCalls(volID))
		}
		time.Sleep(100 * time.Millisecond)
	}
}
