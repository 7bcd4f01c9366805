package metrics

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// scrape returns the text exposition of m's registry.
func scrape(t *testing.T, m *Metrics) string {
	t.Helper()
	srv, err := m.Serve(Listen{Address: "127.0.0.1:0"})
	must.NoError(t, err)
	defer srv.Close()
	return get(t, srv.ListenAddr())
}

func get(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	must.NoError(t, err)
	defer resp.Body.Close()
	must.Eq(t, http.StatusOK, resp.StatusCode)
	b, err := io.ReadAll(resp.Body)
	must.NoError(t, err)
	return string(b)
}

type fakeSource struct {
	mu   sync.Mutex
	vols []csihook.VolumeStats
}

func (f *fakeSource) source() Source {
	return Source{
		Volumes: func() []csihook.VolumeStats {
			f.mu.Lock()
			defer f.mu.Unlock()
			return f.vols
		},
		Counts:  func() csihook.VolumeCounts { return csihook.VolumeCounts{Staged: 2, Refused: 1, Published: 3} },
		Plugins: func() []PluginHealth { return []PluginHealth{{ID: "fixture", Healthy: true}, {ID: "sick"}} },
	}
}

func TestMetrics(t *testing.T) {
	src := &fakeSource{vols: []csihook.VolumeStats{{
		PluginID: "fixture", VolumeID: "vol1", Sampled: time.Unix(100, 0),
		Bytes:        &csihook.Usage{Total: 1000, Used: 300, Available: 700},
		Inodes:       &csihook.Usage{Total: 50, Used: 5, Available: 45},
		HasCondition: true, Abnormal: true, Message: "never a label",
	}}}
	m := New(src.source())
	m.ObserveCall("fixture", csiclient.Observation{Method: csiclient.NodeStageVolume, Code: codes.Unavailable, Duration: 3 * time.Millisecond, N: 1})
	m.ObserveCall("fixture", csiclient.Observation{Method: csiclient.NodeStageVolume, Code: codes.OK, Duration: 2 * time.Millisecond, N: 2})
	out := scrape(t, m)
	for _, line := range []string{
		`nomad_driver_csi_csi_calls_total{code="OK",method="NodeStageVolume",plugin_id="fixture"} 1`,
		`nomad_driver_csi_csi_calls_total{code="Unavailable",method="NodeStageVolume",plugin_id="fixture"} 1`,
		`nomad_driver_csi_csi_call_retries_total{method="NodeStageVolume",plugin_id="fixture"} 1`,
		`nomad_driver_csi_csi_call_duration_seconds_count{code="OK",method="NodeStageVolume",plugin_id="fixture"} 1`,
		`nomad_driver_csi_csi_call_duration_seconds_bucket{code="OK",method="NodeStageVolume",plugin_id="fixture",le="0.0025"} 1`,
		`nomad_driver_csi_volumes_staged 2`,
		`nomad_driver_csi_volumes_refused 1`,
		`nomad_driver_csi_volumes_published 3`,
		`nomad_driver_csi_plugin_healthy{plugin_id="fixture"} 1`,
		`nomad_driver_csi_plugin_healthy{plugin_id="sick"} 0`,
		`nomad_driver_csi_volume_bytes{plugin_id="fixture",state="used",volume_id="vol1"} 300`,
		`nomad_driver_csi_volume_bytes{plugin_id="fixture",state="available",volume_id="vol1"} 700`,
		`nomad_driver_csi_volume_inodes{plugin_id="fixture",state="total",volume_id="vol1"} 50`,
		`nomad_driver_csi_volume_abnormal{plugin_id="fixture",volume_id="vol1"} 1`,
		`nomad_driver_csi_volume_stats_failing{plugin_id="fixture",volume_id="vol1"} 0`,
		`nomad_driver_csi_volume_series_dropped 0`,
	} {
		must.StrContains(t, out, line+"\n")
	}
	must.StrNotContains(t, out, "never a label")
	// Only this package's metrics: a private registry, not the global
	// one with the Go runtime's.
	must.StrNotContains(t, out, "go_goroutines")

	// A volume unpublished leaves no series behind.
	src.mu.Lock()
	src.vols = nil
	src.mu.Unlock()
	must.StrNotContains(t, scrape(t, m), `volume_id="vol1"`)
}

// TestMetricsHostileVolumes checks what a job choosing volume ids can do
// to the endpoint: ids that are long or hold quotes, newlines or escapes
// become a short hash, and no more than MaxVolumeSeries volumes are
// exported however many are published.
func TestMetricsHostileVolumes(t *testing.T) {
	src := &fakeSource{}
	usage := &csihook.Usage{Total: 1, Used: 1}
	weird := []string{strings.Repeat("x", 1024), "a\"}\nfake_metric 1", "esc\x1b[2J", "sp ace"}
	for _, id := range weird {
		src.vols = append(src.vols, csihook.VolumeStats{PluginID: "p", VolumeID: id, Sampled: time.Unix(1, 0), Bytes: usage})
	}
	for i := range MaxVolumeSeries + 50 {
		src.vols = append(src.vols, csihook.VolumeStats{PluginID: "p", VolumeID: fmt.Sprintf("v%05d", i), Sampled: time.Unix(1, 0), Bytes: usage})
	}
	out := scrape(t, New(src.source()))
	for _, id := range weird {
		must.StrContains(t, out, `volume_id="`+Label(id)+`"`)
		must.StrHasPrefix(t, "h-", Label(id))
	}
	must.StrNotContains(t, out, "fake_metric")
	must.StrNotContains(t, out, "\x1b")
	must.Eq(t, MaxVolumeSeries, strings.Count(out, `state="used"`))
	must.StrContains(t, out, fmt.Sprintf("nomad_driver_csi_volume_series_dropped %d\n", len(src.vols)-MaxVolumeSeries))
	for _, l := range strings.Split(out, "\n") {
		must.True(t, len(l) < 512, must.Sprintf("line of %d bytes", len(l)))
	}
}

// TestEndpoint checks the listener's lifetime: Set with the address it
// already listens on keeps the server (no "address in use"), another
// address moves it, "" and Close free the port.
func TestEndpoint(t *testing.T) {
	m := New(Source{})
	addr := freeAddr(t)
	var e Endpoint
	defer e.Close()
	s1, err := e.Set(m, Listen{Address: addr})
	must.NoError(t, err)
	s2, err := e.Set(m, Listen{Address: addr})
	must.NoError(t, err)
	must.True(t, s1 == s2)
	get(t, addr)

	addr2 := freeAddr(t)
	_, err = e.Set(m, Listen{Address: addr2})
	must.NoError(t, err)
	get(t, addr2)
	mustBeFree(t, addr)

	_, err = e.Set(m, Listen{})
	must.NoError(t, err)
	mustBeFree(t, addr2)

	_, err = e.Set(m, Listen{Address: addr})
	must.NoError(t, err)
	e.Close()
	mustBeFree(t, addr)

	// A port someone else holds is a clear error naming the key.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must.NoError(t, err)
	defer ln.Close()
	_, err = e.Set(m, Listen{Address: ln.Addr().String()})
	must.ErrorContains(t, err, "metrics_address")
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must.NoError(t, err)
	addr := ln.Addr().String()
	must.NoError(t, ln.Close())
	return addr
}

func mustBeFree(t *testing.T, addr string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	must.NoError(t, err, must.Sprint("the endpoint still holds ", addr))
	must.NoError(t, ln.Close())
}
