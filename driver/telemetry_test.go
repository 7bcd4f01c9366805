package driver

import (
	"io"
	"net"
	"net/http"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/shoenig/test/must"
)

func TestConfig_validateTelemetry(t *testing.T) {
	for _, tc := range []struct {
		interval, addr, want string
	}{
		{"1m", "", ""},
		{"0", "", ""},
		{"0s", "", ""},
		{"", "", ""},
		{"5s", "127.0.0.1:9465", ""},
		{"1m", "[::1]:9465", ""},
		{"500ms", "", `volume_stats_interval must be "0" (off) or a duration of at least 1s`},
		{"-1m", "", "volume_stats_interval must be"},
		{"often", "", `volume_stats_interval must be "0" (off) or a duration of at least 1s such as "1m", got "often"`},
		{"1m", "127.0.0.1", `metrics_address must be an IP address and port to listen on such as "127.0.0.1:9465", got "127.0.0.1"`},
		{"1m", "127.0.0.1:http", "metrics_address must be"},
		{"1m", "127.0.0.1:70000", "port 70000 is out of range"},
		{"1m", "example.com:9465", `host "example.com" is not an IP address`},
	} {
		t.Run(tc.interval+"/"+tc.addr, func(t *testing.T) {
			c := Config{RootDir: "/x", CgroupParent: "c", VolumeStatsInterval: tc.interval, MetricsAddress: tc.addr}
			err := c.validate()
			if tc.want == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, tc.want)
		})
	}
	must.Eq(t, 0, (&Config{VolumeStatsInterval: "0"}).volumeStatsInterval())
	must.Eq(t, "1m0s", (&Config{VolumeStatsInterval: "1m"}).volumeStatsInterval().String())
	must.Eq(t, DefaultVolumeStatsInterval, defaultConfig().VolumeStatsInterval)
}

// TestSetConfig_metricsListener checks the endpoint's lifetime with
// Nomad's calls: the loader's validation call (no agent config) never
// listens, the real one does, a second one with the same address keeps
// the listener (no "address in use"), and Shutdown frees the port.
func TestSetConfig_metricsListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must.NoError(t, err)
	addr := ln.Addr().String()
	must.NoError(t, ln.Close())
	cfg := Config{Enabled: false, RootDir: t.TempDir(), CgroupParent: "c", VolumeStatsInterval: "1m", MetricsAddress: addr}
	var buf []byte
	must.NoError(t, base.MsgPackEncode(&buf, &cfg))

	d := NewPlugin(hclog.NewNullLogger())
	defer d.Shutdown()
	must.NoError(t, d.SetConfig(&base.Config{PluginConfig: buf}))
	mustBeFree(t, addr)

	must.NoError(t, setConfig(d, cfg))
	must.NoError(t, setConfig(d, cfg))
	resp, err := http.Get("http://" + addr + "/metrics")
	must.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	must.StrContains(t, string(body), "nomad_driver_csi_volumes_published 0")

	d.Shutdown()
	mustBeFree(t, addr)
}

func mustBeFree(t *testing.T, addr string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	must.NoError(t, err, must.Sprint("something listens on ", addr))
	must.NoError(t, ln.Close())
}
