package driver

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
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
// the operator says; a job cannot open or move it. What it serves (other
// namespaces' volume ids, their usage, plugin health) is the node's, not a
// job's: on a TCP port, which every task on the host network can reach
// (loopback included), it asks for a bearer token read from a root-only
// file; on a unix socket (mode 0600 in a root-only directory) only root
// can connect.

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
	if c.MetricsToken != "" {
		return errors.New("metrics_token is not accepted: Nomad shows the plugin's config to whoever can read /v1/agent/self " +
			"(with ACLs off, every task on the host network), and agent config files are often world-readable; write the token " +
			"into a file only root can read (mode 0600) and name it with metrics_token_file")
	}
	if c.MetricsTokenFile != "" {
		if c.MetricsAddress == "" {
			return errors.New("metrics_token_file is set but metrics_address is not: set both, or neither")
		}
		if !filepath.IsAbs(c.MetricsTokenFile) {
			return fmt.Errorf("metrics_token_file must be an absolute path, got %q", c.MetricsTokenFile)
		}
	}
	if c.MetricsAddress == "" {
		return nil
	}
	if path, ok := strings.CutPrefix(c.MetricsAddress, metrics.UnixPrefix); ok {
		if !filepath.IsAbs(path) || filepath.Clean(path) != path {
			return fmt.Errorf("metrics_address %q must name an absolute, clean socket path after %q, such as %q",
				c.MetricsAddress, metrics.UnixPrefix, metrics.UnixPrefix+defaultMetricsSocket)
		}
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
		return fmt.Errorf("metrics_address must be a unix socket such as %q, or an IP address and port such as \"127.0.0.1:9465\", got %q: %v",
			metrics.UnixPrefix+defaultMetricsSocket, c.MetricsAddress, err)
	}
	if c.MetricsTokenFile == "" {
		return fmt.Errorf("metrics_address %q is a TCP port, which every task on the host network can reach, loopback included: "+
			"set metrics_token_file to a root-only file holding a bearer token for the scraper, or listen on a unix socket such as %q",
			c.MetricsAddress, metrics.UnixPrefix+defaultMetricsSocket)
	}
	return nil
}

// defaultMetricsSocket is the socket path the docs and errors suggest.
const defaultMetricsSocket = "/run/nomad-driver-csi/metrics.sock"

// Bounds of the metrics token.
const (
	minMetricsToken = 16
	maxMetricsToken = 4096
)

// readMetricsToken reads the bearer token from path: a regular file (a
// symlink is not followed) owned by root that neither its group nor
// others can read or write, holding one line of at least minMetricsToken
// visible ASCII characters (it goes into an HTTP header). It is read when
// the driver is configured: a new token takes a restart of the agent.
func readMetricsToken(path string) (string, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return "", fmt.Errorf("metrics_token_file %q: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return "", fmt.Errorf("metrics_token_file %q: %w", path, err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.Mode().IsRegular():
		return "", fmt.Errorf("metrics_token_file %q must be a regular file, not %s", path, fi.Mode().Type())
	case !ok || st.Uid != 0:
		return "", fmt.Errorf("metrics_token_file %q must be owned by root (chown root %s)", path, path)
	case fi.Mode().Perm()&0o077 != 0:
		return "", fmt.Errorf("metrics_token_file %q is mode %v: it must be readable by root only (chmod 0600 %s)", path, fi.Mode().Perm(), path)
	case fi.Size() > maxMetricsToken:
		return "", fmt.Errorf("metrics_token_file %q holds %d bytes: a token of at most %d is expected", path, fi.Size(), maxMetricsToken)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxMetricsToken+1))
	if err != nil {
		return "", fmt.Errorf("metrics_token_file %q: %w", path, err)
	}
	token := strings.TrimRight(string(b), "\r\n")
	if len(token) < minMetricsToken {
		return "", fmt.Errorf("metrics_token_file %q holds a token of %d characters: use at least %d, such as the output of `openssl rand -hex 32`", path, len(token), minMetricsToken)
	}
	for i := 0; i < len(token); i++ {
		if token[i] < 0x21 || token[i] > 0x7e {
			return "", fmt.Errorf("metrics_token_file %q: the token must be one line of visible ASCII characters (no spaces), such as the output of `openssl rand -hex 32`", path)
		}
	}
	return token, nil
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
			Counts: func() csihook.VolumeCounts {
				if m := d.openedVolumes(); m != nil {
					return m.VolumeCounts()
				}
				return csihook.VolumeCounts{}
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
	l := metrics.Listen{Address: cfg.MetricsAddress}
	if cfg.MetricsTokenFile != "" {
		token, err := readMetricsToken(cfg.MetricsTokenFile)
		if err != nil {
			return fmt.Errorf("invalid csi plugin config: %w", err)
		}
		l.Token = token
	}
	s, err := d.telemetry.endpoint.Set(d.telemetryMetrics(), l)
	if err != nil {
		return fmt.Errorf("invalid csi plugin config: %w", err)
	}
	d.logger.Info("serving metrics", "metrics_address", s.ListenAddr(), "token", l.Token != "")
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
