package fingerprint

import (
	"fmt"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/safetext"
)

// Bounds on a plugin's answers. gRPC alone bounds an answer to 4 MiB, and
// what a plugin says about itself becomes node attributes, which Nomad
// sends to its servers with every node update, and the health description,
// which goes to the agent's log and into task events. Fields the CSI spec
// bounds are held to the spec: a plugin beyond it is unhealthy, with the
// reason. Opaque fields are cut.
const (
	// MaxNameLength is the longest GetPluginInfo name (CSI spec: 63
	// characters or less).
	MaxNameLength = 63
	// MaxNodeIDBytes is the longest NodeGetInfo node_id (CSI spec: SHALL
	// NOT exceed 256 bytes).
	MaxNodeIDBytes = 256
	// MaxTopologyKeyBytes is the longest accessible_topology key: a name
	// of 63 characters after an optional prefix of 63 and a '/' (CSI spec).
	MaxTopologyKeyBytes = 63 + 1 + 63
	// MaxTopologyValueBytes is the longest accessible_topology value (CSI
	// spec: SHALL NOT exceed 63 characters).
	MaxTopologyValueBytes = 63
	// MaxTopologySegments is the most accessible_topology segments a plugin
	// may give: each is a node attribute. The CSI spec sets no number;
	// plugins give one to three.
	MaxTopologySegments = 64
	// MaxVersionLength bounds the vendor_version kept, in runes: it is
	// opaque (CSI spec), so a longer one is cut, not refused.
	MaxVersionLength = 256
	// MaxHealthDescription bounds a health description in runes; it holds
	// the plugin's own error messages.
	MaxHealthDescription = 1024
)

// shown is how an answer that is refused appears in the reason: cleaned
// and cut, never the whole of it.
func shown(s string) string { return fmt.Sprintf("%q", safetext.Bounded(s, 80)) }

// checkPluginInfo holds a GetPluginInfo answer to the spec and cuts its
// opaque vendor_version.
func checkPluginInfo(info PluginInfo) (PluginInfo, error) {
	switch {
	case info.Name == "":
		return info, fmt.Errorf("GetPluginInfo returned an empty name")
	case len(info.Name) > MaxNameLength:
		return info, fmt.Errorf("GetPluginInfo returned a name of %d bytes (%s); the CSI spec allows at most %d characters",
			len(info.Name), shown(info.Name), MaxNameLength)
	}
	info.VendorVersion = safetext.Bounded(info.VendorVersion, MaxVersionLength)
	return info, nil
}

// checkNodeInfo holds a NodeGetInfo answer to the spec.
func checkNodeInfo(ni NodeInfo) error {
	if len(ni.NodeID) > MaxNodeIDBytes {
		return fmt.Errorf("NodeGetInfo returned a node_id of %d bytes (%s); the CSI spec allows at most %d",
			len(ni.NodeID), shown(ni.NodeID), MaxNodeIDBytes)
	}
	if len(ni.Topology) > MaxTopologySegments {
		return fmt.Errorf("NodeGetInfo returned %d accessible topology segments; at most %d are taken",
			len(ni.Topology), MaxTopologySegments)
	}
	for k, v := range ni.Topology {
		switch {
		case k == "" || len(k) > MaxTopologyKeyBytes:
			return fmt.Errorf("NodeGetInfo returned an accessible topology key of %d bytes (%s); the CSI spec allows 1 to %d",
				len(k), shown(k), MaxTopologyKeyBytes)
		case len(v) > MaxTopologyValueBytes:
			return fmt.Errorf("NodeGetInfo returned a value of %d bytes for accessible topology key %s; the CSI spec allows at most %d",
				len(v), shown(k), MaxTopologyValueBytes)
		}
	}
	return nil
}

// boundReason cuts a health description.
func boundReason(s string) string { return safetext.Bounded(s, MaxHealthDescription) }
