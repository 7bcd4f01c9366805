package cli

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// statsView is what stats prints.
type statsView struct {
	PluginID string       `json:"plugin_id"`
	VolumeID string       `json:"volume_id"`
	Path     string       `json:"path"`
	Usage    []usageView  `json:"usage"`
	Abnormal *bool        `json:"abnormal,omitempty"`
	Message  string       `json:"condition_message,omitempty"`
	Task     journalTaskV `json:"task"`
	// Last is the driver's own last sample (laststats.go), if it keeps one.
	Last *lastSample `json:"driver_last_sample,omitempty"`
}

type usageView struct {
	Unit      string `json:"unit"`
	Total     int64  `json:"total"`
	Used      int64  `json:"used"`
	Available int64  `json:"available"`
}

type journalTaskV struct {
	TaskID string `json:"task_id"`
	Name   string `json:"name"`
}

// findPublished returns the published task record of the volume named arg
// (its volume_id, or the name a task gave it), one per volume.
func findPublished(st csihook.JournalState, arg string) []csihook.JournalTask {
	seen := map[[2]string]bool{}
	var out []csihook.JournalTask
	for _, t := range st.Tasks {
		if t.State != "published" || (t.VolumeID != arg && t.Name != arg) {
			continue
		}
		k := [2]string{t.PluginID, t.VolumeID}
		if seen[k] {
			continue
		}
		seen[k] = true
		out = append(out, t)
	}
	sort.Slice(out, func(i, j int) bool {
		return out[i].PluginID+"\x00"+out[i].VolumeID < out[j].PluginID+"\x00"+out[j].VolumeID
	})
	return out
}

func runStats(e *env, args []string, socket string) error {
	t, sock, staging, err := publishedVolume(e, args[0], socket)
	if err != nil {
		return err
	}
	last := readLastSample(e.rootDir, t.PluginID, t.VolumeID)
	v, err := volumeStats(context.Background(), sock, t, staging)
	if err != nil {
		if last != nil && !e.json {
			printLastSample(e.out, last)
		}
		return err
	}
	v.Last = last
	return printStats(e, v)
}

// publishedVolume finds the one published volume arg names in the journal
// and the socket and staging path to reach it by.
func publishedVolume(e *env, arg, socket string) (csihook.JournalTask, string, string, error) {
	args := []string{arg}
	_, st, err := readVolumes(e.rootDir)
	if err != nil {
		return csihook.JournalTask{}, "", "", err
	}
	found := findPublished(st, args[0])
	switch {
	case len(found) == 0:
		return csihook.JournalTask{}, "", "", fmt.Errorf("no published volume %q in the journal under %q: give a volume_id or volume name that `volumes` lists as published",
			args[0], e.rootDir)
	case len(found) > 1:
		var names []string
		for _, t := range found {
			names = append(names, fmt.Sprintf("%q of plugin %q", t.VolumeID, t.PluginID))
		}
		return csihook.JournalTask{}, "", "", fmt.Errorf("%q names more than one published volume (%s): give its volume_id", args[0], strings.Join(names, ", "))
	}
	t := found[0]
	if socket == "" {
		socket = t.PluginID
	}
	sock, err := resolveSocket(e.rootDir, socket)
	if err != nil {
		return csihook.JournalTask{}, "", "", fmt.Errorf("plugin of volume %q: %w (give -socket when the plugin is not a plugin task of this driver)", t.VolumeID, err)
	}
	var staging string
	for _, vol := range st.Volumes {
		if vol.PluginID == t.PluginID && vol.VolumeID == t.VolumeID {
			staging = vol.StagingPath
		}
	}
	return t, sock, staging, nil
}

func printStats(e *env, v statsView) error {
	if e.json {
		return e.writeJSON(v)
	}
	p := Printable
	fmt.Fprintf(e.out, "Volume %s (plugin %s), task %s volume %s\n", p(v.VolumeID), p(v.PluginID), p(v.Task.TaskID), p(v.Task.Name))
	fmt.Fprintf(e.out, "Path %s\n", p(v.Path))
	tw := tabwriter.NewWriter(e.out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "UNIT\tTOTAL\tUSED\tAVAILABLE\t")
	for _, u := range v.Usage {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t\n", u.Unit, u.Total, u.Used, u.Available)
	}
	_ = tw.Flush()
	if v.Abnormal != nil {
		cond := "normal"
		if *v.Abnormal {
			cond = "ABNORMAL"
		}
		fmt.Fprintf(e.out, "Condition %s", cond)
		if v.Message != "" {
			fmt.Fprintf(e.out, ": %s", p(v.Message))
		}
		fmt.Fprintln(e.out)
	}
	printLastSample(e.out, v.Last)
	return nil
}

// volumeStats asks the plugin at sock for the usage of the volume t
// published, once it said it can (GET_VOLUME_STATS).
func volumeStats(ctx context.Context, sock string, t csihook.JournalTask, staging string) (statsView, error) {
	v := statsView{PluginID: t.PluginID, VolumeID: t.VolumeID, Path: t.Target, Task: journalTaskV{TaskID: t.TaskID, Name: t.Name}}
	fc, err := fingerprint.NewClient(sock, 0)
	if err != nil {
		return v, err
	}
	caps, err := fc.NodeCapabilities(ctx)
	fc.Close()
	if err != nil {
		return v, fmt.Errorf("failed to read the node capabilities of plugin %q: %w", t.PluginID, err)
	}
	if !caps.GetVolumeStats {
		return v, fmt.Errorf("plugin %q does not offer volume stats (no GET_VOLUME_STATS node capability): nothing to ask it", t.PluginID)
	}
	conn, err := csiclient.Dial(sock, csiclient.Options{})
	if err != nil {
		return v, fmt.Errorf("failed to create a client for plugin socket %q: %w", sock, err)
	}
	defer conn.Close()
	var resp *csi.NodeGetVolumeStatsResponse
	pol := csiclient.Policy{Attempts: 3, Base: 200 * time.Millisecond, Max: time.Second}
	_, err = pol.Do(ctx, csiclient.NodeGetVolumeStats, func(ctx context.Context) (err error) {
		resp, err = conn.Node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: t.VolumeID, VolumePath: t.Target, StagingTargetPath: staging})
		return err
	}, nil, nil)
	if err != nil {
		return v, fmt.Errorf("NodeGetVolumeStats of volume %q on plugin %q failed: %s", t.VolumeID, t.PluginID,
			err.Error())
	}
	v.Usage = []usageView{}
	for _, u := range resp.GetUsage() {
		unit := "unknown"
		switch u.GetUnit() {
		case csi.VolumeUsage_BYTES:
			unit = "bytes"
		case csi.VolumeUsage_INODES:
			unit = "inodes"
		}
		v.Usage = append(v.Usage, usageView{Unit: unit, Total: u.GetTotal(), Used: u.GetUsed(), Available: u.GetAvailable()})
	}
	if c := resp.GetVolumeCondition(); c != nil {
		ab := c.GetAbnormal()
		v.Abnormal = &ab
		v.Message = c.GetMessage()
	}
	return v, nil
}
