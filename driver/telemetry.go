package driver

import (
	"encoding/json"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/atomicfile"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/metrics"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// Volume stats and the Prometheus endpoint, set by the agent's plugin
// config (volume_stats_interval, metrics_address).
//
// What a job can do with them: a job chooses its volume ids and how many
// volumes it publishes; each published volume is sampled once per
// interval at its own phase (no burst), and its series on the endpoint
// are bounded and hashed (driver/metrics). The plugin's condition message
// reaches the task's events cleaned (csihook.cleanMessage): no terminal
// escapes, no secrets, at most 256 runes. The endpoint listens only where
// the operator says; a job cannot open or move it.

// DefaultVolumeStatsInterval is volume_stats_interval when unset.
const DefaultVolumeStatsInterval = "1m"

// minVolumeStatsInterval bounds volume_stats_interval from below: every
// published volume costs a call per interval.
const minVolumeStatsInterval = time.Second

// volumeStatsInterval is volume_stats_interval as a duration (0: off).
func (c *Config) volumeStatsInterval() time.Duration {
	d, _ := parseStatsInterval(c.VolumeStatsInterval)
	return d
}

func parseStatsInterval(s string) (time.Duration, error) {
	if s == "" || s == "0" {
		return 0, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || (d != 0 && d < minVolumeStatsInterval) {
		return 0, fmt.Errorf("volume_stats_interval must be \"0\" (off) or a duration of at least %s such as %q, got %q",
			minVolumeStatsInterval, DefaultVolumeStatsInterval, s)
	}
	return d, nil
}

func (c *Config) validateTelemetry() error {
	if _, err := parseStatsInterval(c.VolumeStatsInterval); err != nil {
		return err
	}
	if c.MetricsAddress == "" {
		return nil
	}
	host, port, err := net.SplitHostPort(c.MetricsAddress)
	if err == nil {
		var n int
		n, err = strconv.Atoi(port)
		if err == nil && (n < 1 || n > 65535) {
			err = fmt.Errorf("port %d is out of range", n)
		}
		if err == nil && host != "" && net.ParseIP(host) == nil && host != "localhost" {
			err = fmt.Errorf("host %q is not an IP address", host)
		}
	}
	if err != nil {
		return fmt.Errorf("metrics_address must be an IP address and port to listen on such as \"127.0.0.1:9465\", got %q: %v",
			c.MetricsAddress, err)
	}
	return nil
}

// telemetry is the driver's metrics and their endpoint.
type telemetry struct {
	once     sync.Once
	metrics  *metrics.Metrics
	endpoint metrics.Endpoint
}

// telemetryMetrics returns the driver's metrics, made on first use.
func (d *Driver) telemetryMetrics() *metrics.Metrics {
	d.telemetry.once.Do(func() {
		d.telemetry.metrics = metrics.New(metrics.Source{
			Volumes: func() []csihook.VolumeStats {
				if m := d.openedVolumes(); m != nil {
					return m.VolumeStats()
				}
				return nil
			},
			Counts: func() (int, int) {
				if m := d.openedVolumes(); m != nil {
					return m.VolumeCounts()
				}
				return 0, 0
			},
			Plugins: func() []metrics.PluginHealth {
				p := d.currentProber()
				if p == nil {
					return nil
				}
				var out []metrics.PluginHealth
				for _, st := range p.Snapshot() {
					if st.ID != "" && st.Conflict == "" {
						out = append(out, metrics.PluginHealth{ID: st.ID, Healthy: st.Healthy})
					}
				}
				return out
			},
		})
	})
	return d.telemetry.metrics
}

// observeCall counts a CSI call of the volume lifecycle in the metrics.
func (d *Driver) observeCall(pluginID string, o csiclient.Observation) {
	d.telemetryMetrics().ObserveCall(pluginID, o)
}

// openedVolumes is the volume lifecycle if it is open, without opening it.
func (d *Driver) openedVolumes() *csihook.Manager {
	d.vols.mu.Lock()
	defer d.vols.mu.Unlock()
	return d.vols.manager
}

// configureMetrics opens, keeps, moves or closes the endpoint for the
// agent's configuration. Only SetConfig with an agent configuration calls
// it: the plugin loader's validation call never listens.
func (d *Driver) configureMetrics(cfg Config) error {
	if d.ctx.Err() != nil {
		return nil
	}
	if cfg.MetricsAddress == "" {
		d.telemetry.endpoint.Close()
		return nil
	}
	s, err := d.telemetry.endpoint.Set(d.telemetryMetrics(), cfg.MetricsAddress)
	if err != nil {
		return fmt.Errorf("invalid csi plugin config: %w", err)
	}
	d.logger.Info("serving metrics", "metrics_address", s.ListenAddr())
	return nil
}

// VolumeStatsFile is where the driver keeps the stats loop's last sample
// of every volume, rewritten once per volume_stats_interval, for the
// operator CLI (`stats`) to read. It holds volume and task ids and cleaned
// plugin messages, no secrets; mode 0600.
func VolumeStatsFile(rootDir string) string { return filepath.Join(rootDir, "volume-stats.json") }

// LastStats is the content of VolumeStatsFile.
type LastStats struct {
	Written time.Time             `json:"written"`
	Volumes []csihook.VolumeStats `json:"volumes"`
}

// writeStatsFile writes the stats loop's last samples to VolumeStatsFile
// once per interval until the driver shuts down, and once more then.
func (d *Driver) writeStatsFile(m *csihook.Manager, rootDir string, interval time.Duration) {
	write := func() {
		data, err := json.Marshal(LastStats{Written: time.Now().UTC(), Volumes: m.VolumeStats()})
		if err == nil {
			err = atomicfile.Write(VolumeStatsFile(rootDir), data, 0o600, false)
		}
		if err != nil {
			d.logger.Debug("failed to write the last volume stats", "error", err)
		}
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-d.ctx.Done():
			write()
			return
		case <-t.C:
			write()
		}
	}
}
