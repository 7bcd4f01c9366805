package cli

import (
	"context"
	"fmt"
	"os"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/dustin/go-humanize"

	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// expandView is what expand prints.
type expandView struct {
	PluginID string   `json:"plugin_id"`
	VolumeID string   `json:"volume_id"`
	Names    []string `json:"names,omitempty"`
	Path     string   `json:"path"`
	Required int64    `json:"required_bytes"`
	// Controller and Node are the capacities the plugin answered (0:
	// not called or not said).
	Controller int64        `json:"controller_capacity_bytes"`
	Node       int64        `json:"node_capacity_bytes"`
	NodeCalled bool         `json:"node_expanded"`
	Task       journalTaskV `json:"task"`
}

// parseExpandSize reads expand's size argument.
func parseExpandSize(s string) (int64, error) {
	n, err := humanize.ParseBytes(s)
	if err != nil || n == 0 || n > 1<<62 {
		return 0, usagef("expand: size %q is not a size above zero: write it as \"10GiB\" or \"512MiB\"", s)
	}
	return int64(n), nil
}

// runExpand grows a published volume with the plugin's own calls:
// ControllerExpandVolume when the plugin has the controller capability
// EXPAND_VOLUME, then NodeExpandVolume at the published path when it has
// the node one (online). It reads the journal without its lock and writes
// nothing: it is safe beside a running driver, whose journal keeps the
// size the job asked for; a later redeploy with a smaller capacity_min
// does not shrink the volume (plugins never shrink on expand).
//
// What an operator's mistake can do: a size below the volume's is sent as
// is and the plugin answers its current size (CSI expansion never
// shrinks). The path comes from the driver's journal, never from a task.
func runExpand(e *env, args []string, socket string, f volumeFilter) error {
	want, err := parseExpandSize(args[1])
	if err != nil {
		return err
	}
	c, sock, staging, err := publishedVolume(e, args[0], socket, f)
	if err != nil {
		return err
	}
	t := c.task
	v := expandView{PluginID: t.PluginID, VolumeID: t.VolumeID, Names: c.names, Path: t.Target, Required: want,
		Task: journalTaskV{TaskID: t.TaskID, Name: t.Name}}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	fc, err := fingerprint.NewClient(sock, 0)
	if err != nil {
		return err
	}
	ccaps, cerr := fc.ControllerCapabilities(ctx)
	ncaps, err := fc.NodeCapabilities(ctx)
	fc.Close()
	if err != nil {
		return fmt.Errorf("failed to read the node capabilities of plugin %q: %w", t.PluginID, err)
	}
	ctrl := cerr == nil && ccaps.ExpandVolume
	if !ctrl && !ncaps.ExpandVolume {
		return fmt.Errorf("plugin %q cannot expand volumes (no EXPAND_VOLUME capability, controller or node)", t.PluginID)
	}
	conn, err := csiclient.Dial(sock, csiclient.Options{})
	if err != nil {
		return fmt.Errorf("failed to create a client for plugin socket %q: %w", sock, err)
	}
	defer conn.Close()
	pol := csiclient.Policy{Attempts: 3, Base: 200 * time.Millisecond, Max: time.Second}
	node := ncaps.ExpandVolume
	if ctrl {
		var resp *csi.ControllerExpandVolumeResponse
		_, err = pol.Do(ctx, csiclient.ControllerExpandVolume, func(ctx context.Context) (err error) {
			resp, err = conn.Controller.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
				VolumeId: t.VolumeID, CapacityRange: &csi.CapacityRange{RequiredBytes: want}})
			return err
		}, nil, nil)
		if err != nil {
			return fmt.Errorf("ControllerExpandVolume of volume %q on plugin %q failed: %s (a plugin that needs secrets for it takes them from the job: raise create.capacity_min instead)",
				t.VolumeID, t.PluginID, err.Error())
		}
		v.Controller = resp.GetCapacityBytes()
		node = node && resp.GetNodeExpansionRequired()
	}
	if node {
		var vc *csi.VolumeCapability
		if fi, err := os.Lstat(t.Target); err == nil && !fi.IsDir() {
			vc = &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}
		}
		var resp *csi.NodeExpandVolumeResponse
		_, err = pol.Do(ctx, csiclient.NodeExpandVolume, func(ctx context.Context) (err error) {
			resp, err = conn.Node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: t.VolumeID, VolumePath: t.Target,
				StagingTargetPath: staging, CapacityRange: &csi.CapacityRange{RequiredBytes: want}, VolumeCapability: vc})
			return err
		}, nil, nil)
		if err != nil {
			return fmt.Errorf("NodeExpandVolume of volume %q on plugin %q failed: %s", t.VolumeID, t.PluginID, err.Error())
		}
		v.Node, v.NodeCalled = resp.GetCapacityBytes(), true
	}
	if e.json {
		return e.writeJSON(v)
	}
	p := Printable
	fmt.Fprintf(e.out, "%s, task %s volume %s\n", volumeTitle(v.VolumeID, v.PluginID, v.Names), p(v.Task.TaskID), p(v.Task.Name))
	if ctrl {
		fmt.Fprintf(e.out, "Controller: expanded to %s (%d bytes)\n", humanize.IBytes(uint64(v.Controller)), v.Controller)
	}
	if v.NodeCalled {
		fmt.Fprintf(e.out, "Node: file system at %s grown online to %s (%d bytes)\n", p(v.Path), humanize.IBytes(uint64(v.Node)), v.Node)
	} else {
		fmt.Fprintf(e.out, "Node: no expansion needed now (the plugin grows it at its next staging if it must)\n")
	}
	fmt.Fprintf(e.out, "Raise create.capacity_min of the job to %s to keep the size the driver records\n", humanize.IBytes(uint64(want)))
	return nil
}
