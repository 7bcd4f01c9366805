package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// resolveSocket turns a plugin id or a socket path into a socket path: an
// argument with a slash is a path; anything else is the csi_plugin id of a
// plugin task of the driver, whose socket is under root_dir.
func resolveSocket(rootDir, arg string) (string, error) {
	if arg == "" {
		return "", usagef("the plugin id or socket path is empty")
	}
	sock := arg
	if !strings.Contains(arg, "/") {
		sock = driver.PluginSocketPath(rootDir, arg)
	} else if !filepath.IsAbs(arg) {
		abs, err := filepath.Abs(arg)
		if err != nil {
			return "", fmt.Errorf("socket path %q: %w", arg, err)
		}
		sock = abs
	}
	fi, err := os.Stat(sock)
	switch {
	case err != nil && !strings.Contains(arg, "/"):
		return "", fmt.Errorf("no plugin task %q on this node: its socket %q is not there (%w); give a running csi_plugin id or the path of a plugin socket",
			arg, sock, errors.Unwrap(err))
	case err != nil:
		return "", fmt.Errorf("socket %q is not there: %w", sock, errors.Unwrap(err))
	case fi.Mode()&os.ModeSocket == 0:
		return "", fmt.Errorf("%q is not a unix socket", sock)
	}
	return sock, nil
}

// probeView is what probe prints.
type probeView struct {
	Socket             string                              `json:"socket"`
	Info               *fingerprint.PluginInfo             `json:"info,omitempty"`
	Ready              *bool                               `json:"ready,omitempty"`
	PluginCapabilities *fingerprint.PluginCapabilities     `json:"plugin_capabilities,omitempty"`
	Node               *fingerprint.NodeInfo               `json:"node,omitempty"`
	NodeCapabilities   *fingerprint.NodeCapabilities       `json:"node_capabilities,omitempty"`
	ControllerCaps     *fingerprint.ControllerCapabilities `json:"controller_capabilities,omitempty"`
	// Errors holds each call that failed, by method; a service the plugin
	// does not offer is "not implemented by the plugin".
	Errors map[string]string `json:"errors,omitempty"`
}

func runProbe(e *env, args []string) error {
	sock, err := resolveSocket(e.rootDir, args[0])
	if err != nil {
		return err
	}
	v, err := probe(context.Background(), sock)
	if e.json {
		if jerr := e.writeJSON(v); jerr != nil {
			return jerr
		}
	} else {
		printProbe(e, v)
	}
	return err
}

// probe asks the plugin at sock everything it tells of itself. Each call
// runs under the Rules table's deadline. The error is set when the plugin
// did not answer who it is or is not ready.
func probe(ctx context.Context, sock string) (probeView, error) {
	v := probeView{Socket: sock, Errors: map[string]string{}}
	c, err := fingerprint.NewClient(sock, 0)
	if err != nil {
		return v, err
	}
	defer c.Close()
	fail := func(method string, err error) {
		if errors.Is(err, fingerprint.ErrUnimplemented) {
			v.Errors[method] = fingerprint.ErrUnimplemented.Error()
			return
		}
		v.Errors[method] = err.Error()
	}
	if info, err := c.PluginInfo(ctx); err == nil {
		v.Info = &info
	} else {
		fail(csiclient.GetPluginInfo, err)
	}
	if caps, err := c.PluginCapabilities(ctx); err == nil {
		v.PluginCapabilities = &caps
	} else {
		fail(csiclient.GetPluginCapabilities, err)
	}
	if ready, err := c.Probe(ctx); err == nil {
		v.Ready = &ready
	} else {
		fail(csiclient.Probe, err)
	}
	if node, err := c.NodeInfo(ctx); err == nil {
		v.Node = &node
	} else {
		fail(csiclient.NodeGetInfo, err)
	}
	if caps, err := c.NodeCapabilities(ctx); err == nil {
		v.NodeCapabilities = &caps
	} else {
		fail(csiclient.NodeGetCapabilities, err)
	}
	if v.PluginCapabilities != nil && v.PluginCapabilities.ControllerService {
		if caps, err := c.ControllerCapabilities(ctx); err == nil {
			v.ControllerCaps = &caps
		} else {
			fail(csiclient.ControllerGetCapabilities, err)
		}
	}
	if len(v.Errors) == 0 {
		v.Errors = nil
	}
	switch {
	case v.Info == nil:
		return v, fmt.Errorf("plugin at %q did not say who it is: %s", sock, v.Errors[csiclient.GetPluginInfo])
	case v.Ready == nil:
		return v, fmt.Errorf("plugin at %q did not answer Probe: %s", sock, v.Errors[csiclient.Probe])
	case !*v.Ready:
		return v, fmt.Errorf("plugin at %q says it is not ready", sock)
	}
	return v, nil
}

func printProbe(e *env, v probeView) {
	p := Printable
	tw := tabwriter.NewWriter(e.out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "Socket\t%s\n", p(v.Socket))
	if v.Info != nil {
		fmt.Fprintf(tw, "Name\t%s\n", p(v.Info.Name))
		fmt.Fprintf(tw, "Vendor version\t%s\n", orNone(p(v.Info.VendorVersion)))
		keys := make([]string, 0, len(v.Info.Manifest))
		for k := range v.Info.Manifest {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(tw, "Manifest %s\t%s\n", p(k), p(v.Info.Manifest[k]))
		}
	}
	if v.Ready != nil {
		fmt.Fprintf(tw, "Ready\t%t\n", *v.Ready)
	}
	if v.PluginCapabilities != nil {
		c := v.PluginCapabilities
		fmt.Fprintf(tw, "Plugin capabilities\t%s\n", flags(
			"CONTROLLER_SERVICE", c.ControllerService, "VOLUME_ACCESSIBILITY_CONSTRAINTS", c.VolumeAccessibilityConstraints,
			"GROUP_CONTROLLER_SERVICE", c.GroupControllerService, "SNAPSHOT_METADATA_SERVICE", c.SnapshotMetadataService,
			"ONLINE_EXPANSION", c.OnlineExpansion, "OFFLINE_EXPANSION", c.OfflineExpansion))
	}
	if v.Node != nil {
		fmt.Fprintf(tw, "Node ID\t%s\n", p(v.Node.NodeID))
		if v.Node.MaxVolumes > 0 {
			fmt.Fprintf(tw, "Max volumes\t%d\n", v.Node.MaxVolumes)
		}
		keys := make([]string, 0, len(v.Node.Topology))
		for k := range v.Node.Topology {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(tw, "Topology %s\t%s\n", p(k), p(v.Node.Topology[k]))
		}
	}
	if v.NodeCapabilities != nil {
		c := v.NodeCapabilities
		fmt.Fprintf(tw, "Node capabilities\t%s\n", flags(
			"STAGE_UNSTAGE_VOLUME", c.StageUnstageVolume, "GET_VOLUME_STATS", c.GetVolumeStats, "EXPAND_VOLUME", c.ExpandVolume,
			"VOLUME_CONDITION", c.VolumeCondition, "SINGLE_NODE_MULTI_WRITER", c.SingleNodeMultiWriter,
			"VOLUME_MOUNT_GROUP", c.VolumeMountGroup))
	}
	if v.ControllerCaps != nil {
		c := v.ControllerCaps
		fmt.Fprintf(tw, "Controller capabilities\t%s\n", flags(
			"CREATE_DELETE_VOLUME", c.CreateDeleteVolume, "PUBLISH_UNPUBLISH_VOLUME", c.PublishUnpublishVolume,
			"LIST_VOLUMES", c.ListVolumes, "GET_CAPACITY", c.GetCapacity, "CREATE_DELETE_SNAPSHOT", c.CreateDeleteSnapshot,
			"LIST_SNAPSHOTS", c.ListSnapshots, "CLONE_VOLUME", c.CloneVolume, "PUBLISH_READONLY", c.PublishReadonly,
			"EXPAND_VOLUME", c.ExpandVolume, "LIST_VOLUMES_PUBLISHED_NODES", c.ListVolumesPublishedNodes,
			"VOLUME_CONDITION", c.VolumeCondition, "GET_VOLUME", c.GetVolume, "SINGLE_NODE_MULTI_WRITER", c.SingleNodeMultiWriter,
			"MODIFY_VOLUME", c.ModifyVolume, "GET_SNAPSHOT", c.GetSnapshot))
	}
	methods := make([]string, 0, len(v.Errors))
	for m := range v.Errors {
		methods = append(methods, m)
	}
	sort.Strings(methods)
	for _, m := range methods {
		fmt.Fprintf(tw, "%s\t%s\n", m, p(v.Errors[m]))
	}
	_ = tw.Flush()
}

// flags lists the names whose value is true, "none" when none is.
func flags(pairs ...any) string {
	var on []string
	for i := 0; i+1 < len(pairs); i += 2 {
		if pairs[i+1].(bool) {
			on = append(on, pairs[i].(string))
		}
	}
	if len(on) == 0 {
		return "none"
	}
	return strings.Join(on, ", ")
}
