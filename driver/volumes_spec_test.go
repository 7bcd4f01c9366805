package driver

import (
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
)

// The capabilities the CSI spec makes a CO's calls depend on reach the
// volume lifecycle: PUBLISH_READONLY (ControllerPublishVolume.readonly),
// VOLUME_ACCESSIBILITY_CONSTRAINTS (CreateVolume's topology) and ONLINE
// expansion (ControllerExpandVolume of a volume in use).
func TestLifecyclePluginInfo_specCapabilities(t *testing.T) {
	st := fingerprint.PluginStatus{ID: "p", Type: fingerprint.TypeMonolith, Known: true, NodeService: true, ControllerService: true,
		Node: fingerprint.NodeInfo{NodeID: "n", Topology: map[string]string{"zone": "a"}}}
	info := lifecyclePluginInfo(st)
	must.False(t, info.PublishReadonly)
	must.False(t, info.AccessibilityConstraints)
	must.False(t, info.OnlineExpansion)
	must.False(t, info.OfflineExpansion)

	st.ControllerCaps.PublishReadonly = true
	st.PluginCaps.VolumeAccessibilityConstraints = true
	st.PluginCaps.OnlineExpansion = true
	st.PluginCaps.OfflineExpansion = true
	info = lifecyclePluginInfo(st)
	must.True(t, info.PublishReadonly)
	must.True(t, info.AccessibilityConstraints)
	must.True(t, info.OnlineExpansion)
	must.True(t, info.OfflineExpansion)
	must.Eq(t, map[string]string{"zone": "a"}, info.Topology)

	// A node plugin is never asked for its controller capabilities.
	st.ControllerService = false
	must.False(t, lifecyclePluginInfo(st).PublishReadonly)
}
