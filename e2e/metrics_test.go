//go:build e2e

package e2e

// The driver's Prometheus endpoint scraped for real: after a volume task
// ran on a real agent (its first NodeStageVolume failed once with
// Unavailable, so it was retried), the endpoint counts the CSI calls by
// plugin, method and code, their latency, the retry, the plugin's health
// and the published volume.

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

func TestMetricsScrape(t *testing.T) {
	t.Parallel()
	a, addr := statsAgent(t)
	fx := a.StartVolFixture(t, "metricsfx", VolFixtureOptions{})

	name := volUniq("metrics")
	must.NoError(t, os.WriteFile(filepath.Join(fx.StateDir, "faults"),
		[]byte(fmt.Sprintf("NodeStageVolume %s fail Unavailable 1\n", name)), 0o644))
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{Type: "service",
		Script:  fmt.Sprintf("echo hi > %s/f && echo wrote && sleep 600", dest),
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Create: true, CreateType: "dir"}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "wrote", volTimeout)
	id := fx.VolumeID(name)

	p := `plugin_id="metricsfx"`
	for _, series := range []string{
		`nomad_driver_csi_csi_calls_total{code="OK",method="CreateVolume",` + p + `}`,
		`nomad_driver_csi_csi_calls_total{code="OK",method="NodeStageVolume",` + p + `}`,
		`nomad_driver_csi_csi_calls_total{code="Unavailable",method="NodeStageVolume",` + p + `}`,
		`nomad_driver_csi_csi_calls_total{code="OK",method="NodePublishVolume",` + p + `}`,
		`nomad_driver_csi_csi_call_retries_total{method="NodeStageVolume",` + p + `}`,
		`nomad_driver_csi_csi_call_duration_seconds_count{code="OK",method="NodePublishVolume",` + p + `}`,
		`nomad_driver_csi_csi_call_duration_seconds_sum{code="OK",method="NodePublishVolume",` + p + `}`,
		`nomad_driver_csi_csi_calls_total{code="OK",method="NodeGetVolumeStats",` + p + `}`,
		`nomad_driver_csi_plugin_healthy{` + p + `}`,
		`nomad_driver_csi_volumes_staged`,
		`nomad_driver_csi_volumes_published`,
		fmt.Sprintf(`nomad_driver_csi_volume_bytes{%s,state="available",volume_id=%q}`, p, id),
		fmt.Sprintf(`nomad_driver_csi_volume_inodes{%s,state="total",volume_id=%q}`, p, id),
		fmt.Sprintf(`nomad_driver_csi_volume_stats_timestamp_seconds{%s,volume_id=%q}`, p, id),
	} {
		v := waitMetric(t, addr, series, 0, 30*time.Second)
		t.Logf("%s %v", series, v)
	}
	text, err := scrapeMetrics(addr)
	must.NoError(t, err)
	v, ok := metricValue(text, `nomad_driver_csi_csi_calls_total{code="Unavailable",method="NodeStageVolume",`+p+`}`)
	must.True(t, ok)
	must.Eq(t, 1, v)
	// Served, and no volume here was refused its stage (the one staged
	// after an Unavailable is staged, not refused).
	v, ok = metricValue(text, `nomad_driver_csi_volumes_refused`)
	must.True(t, ok, must.Sprint("no nomad_driver_csi_volumes_refused series"))
	must.Eq(t, 0, v)
	// A private registry: none of the Go runtime's or Nomad's metrics.
	must.StrNotContains(t, text, "go_goroutines")
}
