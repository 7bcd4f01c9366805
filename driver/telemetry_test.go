package driver

import (
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/shoenig/test/must"
)

func TestConfig_validateTelemetry(t *testing.T) {
	const tf = "/etc/nomad-driver-csi/metrics.token"
	for _, tc := range []struct {
		interval, addr, tokenFile, token, want string
	}{
		{"1m", "", "", "", ""},
		{"0", "", "", "", ""},
		{"0s", "", "", "", ""},
		{"", "", "", "", ""},
		{"5s", "127.0.0.1:9465", tf, "", ""},
		{"1m", "[::1]:9465", tf, "", ""},
		{"1m", "unix:///run/nomad-driver-csi/metrics.sock", "", "", ""},
		{"1m", "unix:///run/nomad-driver-csi/metrics.sock", tf, "", ""},
		{"500ms", "", "", "", `volume_stats_interval must be "0" (off) or a duration of at least 1s`},
		{"-1m", "", "", "", "volume_stats_interval must be"},
		{"often", "", "", "", `volume_stats_interval must be "0" (off) or a duration of at least 1s such as "1m", got "often"`},
		{"1m", "127.0.0.1", tf, "", `metrics_address must be a unix socket such as "unix:///run/nomad-driver-csi/metrics.sock", or an IP address and port such as "127.0.0.1:9465", got "127.0.0.1"`},
		{"1m", "127.0.0.1:http", tf, "", "metrics_address must be"},
		{"1m", "127.0.0.1:70000", tf, "", "port 70000 is out of range"},
		{"1m", "example.com:9465", tf, "", `host "example.com" is not an IP address`},
		{"1m", "127.0.0.1:9465", "", "", `metrics_address "127.0.0.1:9465" is a TCP port, which every task on the host network can reach, loopback included: set metrics_token_file`},
		{"1m", "unix://run/m.sock", "", "", `metrics_address "unix://run/m.sock" must name an absolute, clean socket path`},
		{"1m", "unix:///run/../m.sock", "", "", "must name an absolute, clean socket path"},
		{"1m", "127.0.0.1:9465", "metrics.token", "", "metrics_token_file must be an absolute path"},
		{"1m", "", tf, "", "metrics_token_file is set but metrics_address is not"},
		{"1m", "127.0.0.1:9465", "", "0123456789abcdef", "metrics_token is not accepted: Nomad shows the plugin's config to whoever can read /v1/agent/self"},
	} {
		t.Run(tc.interval+"/"+tc.addr+"/"+tc.tokenFile, func(t *testing.T) {
			c := Config{RootDir: "/x", CgroupParent: "c", VolumeStatsInterval: tc.interval, MetricsAddress: tc.addr,
				MetricsTokenFile: tc.tokenFile, MetricsToken: tc.token}
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

// The token file is root's alone, one line of visible ASCII, long enough;
// anything else is refused, saying how to fix it.
func TestReadMetricsToken(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	const token = "0123456789abcdef0123456789abcdef"
	write := func(name, content string, mode os.FileMode, uid int) string {
		p := filepath.Join(dir, name)
		must.NoError(t, os.WriteFile(p, []byte(content), 0o600))
		must.NoError(t, os.Chmod(p, mode))
		must.NoError(t, os.Chown(p, uid, 0))
		return p
	}
	good := write("good", token+"\n", 0o600, 0)
	got, err := readMetricsToken(good)
	must.NoError(t, err)
	must.Eq(t, token, got)
	got, err = readMetricsToken(write("readonly", token, 0o400, 0))
	must.NoError(t, err)
	must.Eq(t, token, got)

	link := filepath.Join(dir, "link")
	must.NoError(t, os.Symlink(good, link))
	for _, tc := range []struct {
		path, want string
	}{
		{write("group", token, 0o640, 0), "is mode -rw-r-----: it must be readable by root only (chmod 0600"},
		{write("world", token, 0o644, 0), "it must be readable by root only"},
		{write("nobody", token, 0o600, 65534), "must be owned by root"},
		{write("short", "tooshort\n", 0o600, 0), "holds a token of 8 characters: use at least 16"},
		{write("spaces", "0123456789 abcdef0123\n", 0o600, 0), "one line of visible ASCII"},
		{write("lines", token+"\n"+token+"\n", 0o600, 0), "one line of visible ASCII"},
		{link, "symbolic link"},
		{dir, "must be a regular file"},
		{filepath.Join(dir, "missing"), "no such file"},
	} {
		t.Run(filepath.Base(tc.path), func(t *testing.T) {
			_, err := readMetricsToken(tc.path)
			must.ErrorContains(t, err, tc.want)
			must.ErrorContains(t, err, "metrics_token_file")
		})
	}
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
	tokenFile := filepath.Join(t.TempDir(), "token")
	must.NoError(t, os.WriteFile(tokenFile, []byte("0123456789abcdef0123\n"), 0o600))
	cfg := Config{Enabled: false, RootDir: t.TempDir(), CgroupParent: "c", VolumeStatsInterval: "1m", MetricsAddress: addr, MetricsTokenFile: tokenFile}
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
	resp.Body.Close()
	must.Eq(t, http.StatusUnauthorized, resp.StatusCode)
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+"/metrics", nil)
	must.NoError(t, err)
	req.Header.Set("Authorization", "Bearer 0123456789abcdef0123")
	resp, err = http.DefaultClient.Do(req)
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
