package cli

import (
	"encoding/json"
	"os"
	"testing"
	"time"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
)

// TestStats_lastSample checks that stats shows the driver's last sample
// of the volume beside its own call (and alone when the call fails), its
// plugin's message escaped, and puts it in -json.
func TestStats_lastSample(t *testing.T) {
	root := shortDir(t)
	m := writeJournal(t, root, map[string][]string{"task-a": {"vol1"}})
	defer m.Close()
	p := &testPlugin{name: "p"}
	servePlugin(t, root, "p", p)
	sampled := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	data, err := json.Marshal(driver.LastStats{Written: sampled, Volumes: []csihook.VolumeStats{
		{PluginID: "p", VolumeID: "other", Sampled: sampled, Bytes: &csihook.Usage{Used: 1}},
		{PluginID: "p", VolumeID: "vol1", Sampled: sampled, Bytes: &csihook.Usage{Total: 100, Used: 40, Available: 60},
			HasCondition: true, Abnormal: true, Message: "bad \x1b[2J"},
	}})
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(driver.VolumeStatsFile(root), data, 0o600))

	// The plugin lacks GET_VOLUME_STATS: the call fails, the sample shows.
	code, out, _ := runCLI("stats", "vol1", "-root-dir", root)
	must.Eq(t, 1, code)
	must.StrContains(t, out, "Driver's last sample at 2026-01-02T03:04:05Z: bytes 40 used, 60 available, 100 total")
	must.StrContains(t, out, `Driver's last condition ABNORMAL: bad \x1b[2J`)
	must.StrNotContains(t, out, "\x1b")

	p.stats = true
	code, out, errOut := runCLI("stats", "vol1", "-root-dir", root, "-json")
	must.Eq(t, 0, code, must.Sprint(errOut))
	var v statsView
	must.NoError(t, json.Unmarshal([]byte(out), &v))
	must.NotNil(t, v.Last)
	must.Eq(t, int64(40), v.Last.Stats.Bytes.Used)
}
