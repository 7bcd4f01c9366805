package cli

import (
	"context"
	"fmt"
	"slices"
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
	Names    []string     `json:"names,omitempty"`
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

// volumeFilter narrows the volumes a command's <volume> argument names:
// to one plugin, one Nomad namespace, or both ("" for any).
type volumeFilter struct {
	plugin, namespace string
}

// candidate is one published volume an argument names.
type candidate struct {
	task      csihook.JournalTask
	names     []string
	namespace string
}

// findPublished returns the published volumes the argument names, one per
// volume: by the plugin's volume id, by the volume_id a job created it
// under (its name), or by the name of the task's volume block.
//
// Names are a job's choice: a job of another namespace can create a volume
// under the name of someone else's. The name then fits both, and the
// command refuses and lists each with its plugin and namespace rather than
// pick one; a name that fits one volume is shown with its plugin's id.
func findPublished(st csihook.JournalState, arg string, f volumeFilter) []candidate {
	ns := map[[2]string]string{}
	for _, v := range st.Volumes {
		ns[[2]string{v.PluginID, v.VolumeID}] = v.Namespace
	}
	seen := map[[2]string]bool{}
	var out []candidate
	for _, t := range st.Tasks {
		k := [2]string{t.PluginID, t.VolumeID}
		if t.State != "published" || seen[k] || (f.plugin != "" && t.PluginID != f.plugin) ||
			(f.namespace != "" && ns[k] != f.namespace) {
			continue
		}
		names := st.NamesOf(t.PluginID, t.VolumeID)
		if t.VolumeID != arg && t.Name != arg && !slices.Contains(names, arg) {
			continue
		}
		seen[k] = true
		out = append(out, candidate{task: t, names: names, namespace: ns[k]})
	}
	sort.Slice(out, func(i, j int) bool {
		return out[i].task.PluginID+"\x00"+out[i].task.VolumeID < out[j].task.PluginID+"\x00"+out[j].task.VolumeID
	})
	return out
}

// volumeTitle heads what a command prints of a volume: the name its job
// created it under next to the plugin's id, or the id alone.
func volumeTitle(volumeID, pluginID string, names []string) string {
	p := Printable
	if len(names) > 0 {
		return fmt.Sprintf("Volume %s (plugin %s, plugin's volume ID %s)", p(strings.Join(names, ", ")), p(pluginID), p(volumeID))
	}
	return fmt.Sprintf("Volume %s (plugin %s)", p(volumeID), p(pluginID))
}

// String names a candidate for the operator to tell it from the others.
func (c candidate) String() string {
	s := fmt.Sprintf("plugin %q volume ID %q", c.task.PluginID, c.task.VolumeID)
	if len(c.names) > 0 {
		s += fmt.Sprintf(" (created as %s)", quotedList(c.names))
	}
	if c.namespace != "" {
		s += fmt.Sprintf(" in namespace %q", c.namespace)
	}
	return s + fmt.Sprintf(", volume block %q of task %q", c.task.Name, c.task.TaskID)
}

func quotedList(ss []string) string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = fmt.Sprintf("%q", s)
	}
	return strings.Join(q, ", ")
}

func runStats(e *env, args []string, socket string, f volumeFilter) error {
	c, sock, staging, err := publishedVolume(e, args[0], socket, f)
	if err != nil {
		return err
	}
	t := c.task
	last := readLastSample(e.rootDir, t.PluginID, t.VolumeID)
	v, err := volumeStats(context.Background(), sock, t, staging)
	v.Names = c.names
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
func publishedVolume(e *env, arg, socket string, f volumeFilter) (candidate, string, string, error) {
	_, st, err := readVolumes(e.rootDir)
	if err != nil {
		return candidate{}, "", "", err
	}
	found := findPublished(st, arg, f)
	switch {
	case len(found) == 0:
		var only string
		if f.plugin != "" {
			only += fmt.Sprintf(" of plugin %q", f.plugin)
		}
		if f.namespace != "" {
			only += fmt.Sprintf(" in namespace %q", f.namespace)
		}
		return candidate{}, "", "", fmt.Errorf("no published volume %q%s in the journal under %q: give a volume_id, the plugin's volume ID or a volume block's name that `volumes` lists as published",
			arg, only, e.rootDir)
	case len(found) > 1:
		var names []string
		for _, c := range found {
			names = append(names, c.String())
		}
		return candidate{}, "", "", fmt.Errorf("%q names more than one published volume: %s; choose one with -plugin or -namespace, or give its plugin's volume ID",
			arg, strings.Join(names, "; "))
	}
	c := found[0]
	t := c.task
	if socket == "" {
		socket = t.PluginID
	}
	sock, err := resolveSocket(e.rootDir, socket)
	if err != nil {
		return candidate{}, "", "", fmt.Errorf("plugin of volume %q: %w (give -socket when the plugin is not a plugin task of this driver)", t.VolumeID, err)
	}
	var staging string
	for _, vol := range st.Volumes {
		if vol.PluginID == t.PluginID && vol.VolumeID == t.VolumeID {
			staging = vol.StagingPath
		}
	}
	return c, sock, staging, nil
}

func printStats(e *env, v statsView) error {
	if e.json {
		return e.writeJSON(v)
	}
	p := Printable
	fmt.Fprintf(e.out, "%s, task %s volume %s\n", volumeTitle(v.VolumeID, v.PluginID, v.Names), p(v.Task.TaskID), p(v.Task.Name))
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
