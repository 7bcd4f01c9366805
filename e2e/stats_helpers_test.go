//go:build e2e

package e2e

// Helpers of the stats and metrics cases (stats_test.go, metrics_test.go):
// an agent whose driver samples volume stats every second and serves its
// metrics on a unix socket, and a scrape of that endpoint.

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// statsAgent starts a privileged agent for volume cases with
// volume_stats_interval = "1s" and metrics on a unix socket; it returns
// the agent and the metrics address (unix:///path). The volume cases'
// final check runs before the harness closes it.
func statsAgent(t *testing.T) (*Agent, string) {
	t.Helper()
	requireCSI(t)
	csiBin(t, "csi-fixture")
	addr := "unix://" + filepath.Join(t.TempDir(), "metrics.sock")
	a := StartAgent(t, AgentOptions{AllowPrivileged: true,
		DriverConfig: fmt.Sprintf("volume_stats_interval = \"1s\"\n    metrics_address = %q\n", addr)})
	t.Cleanup(func() { volFinalCheck(t, a) })
	return a, addr
}

// scrapeMetrics returns the text the driver's metrics endpoint serves at
// addr, a unix:///path or a host:port without a token.
func scrapeMetrics(addr string) (string, error) {
	c := http.Client{Timeout: 10 * time.Second}
	url := "http://" + addr + "/metrics"
	if sock, ok := strings.CutPrefix(addr, "unix://"); ok {
		c.Transport = &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}}
		url = "http://unix/metrics"
	}
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET /metrics: %s: %s", resp.Status, b)
	}
	return string(b), nil
}

// metricValue returns the value of the series written exactly as series
// (name and labels in the exposition's order), and whether it is there.
func metricValue(text, series string) (float64, bool) {
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f, err == nil
		}
	}
	return 0, false
}

// waitMetric scrapes until the series is above min and returns its value.
func waitMetric(t *testing.T, addr, series string, min float64, timeout time.Duration) float64 {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var text string
	for {
		var err error
		text, err = scrapeMetrics(addr)
		if err == nil {
			if v, ok := metricValue(text, series); ok && v > min {
				return v
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("metric %s not above %v within %v (scrape error %v); the driver's metrics:\n%s", series, min, timeout, err, text)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
