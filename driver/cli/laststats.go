package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
)

// lastSample is the driver's last sample of a volume (the stats loop,
// driver.VolumeStatsFile), as stats shows it beside its own call.
type lastSample struct {
	Written time.Time           `json:"written"`
	Stats   csihook.VolumeStats `json:"stats"`
}

// readLastSample returns the driver's last sample of the volume, or nil
// when the driver keeps none (the loop is off, or has not sampled it).
func readLastSample(rootDir, pluginID, volumeID string) *lastSample {
	b, err := os.ReadFile(driver.VolumeStatsFile(rootDir))
	if err != nil {
		return nil
	}
	var ls driver.LastStats
	if json.Unmarshal(b, &ls) != nil {
		return nil
	}
	for _, v := range ls.Volumes {
		if v.PluginID == pluginID && v.VolumeID == volumeID && !v.Sampled.IsZero() {
			return &lastSample{Written: ls.Written, Stats: v}
		}
	}
	return nil
}

// printLastSample writes the sample for a person; its strings are the
// plugin's and the job's, so they are printed escaped.
func printLastSample(w io.Writer, l *lastSample) {
	if l == nil {
		return
	}
	s := l.Stats
	fmt.Fprintf(w, "Driver's last sample at %s", s.Sampled.UTC().Format(time.RFC3339))
	if s.Bytes != nil {
		fmt.Fprintf(w, ": bytes %d used, %d available, %d total", s.Bytes.Used, s.Bytes.Available, s.Bytes.Total)
	}
	if s.Inodes != nil {
		fmt.Fprintf(w, "; inodes %d used, %d available, %d total", s.Inodes.Used, s.Inodes.Available, s.Inodes.Total)
	}
	fmt.Fprintln(w)
	if s.HasCondition {
		cond := "normal"
		if s.Abnormal {
			cond = "ABNORMAL"
		}
		fmt.Fprintf(w, "Driver's last condition %s: %s\n", cond, Printable(s.Message))
	}
	if s.Error != "" {
		fmt.Fprintf(w, "Driver's last call failed: %s\n", Printable(s.Error))
	}
}
