package fingerprint

import (
	"testing"

	"github.com/hashicorp/nomad/plugins/shared/structs"
	"github.com/shoenig/test/must"
)

func TestSanitizeID(t *testing.T) {
	cases := []struct{ id, want string }{
		{"hostpath", "hostpath"},
		{"host-path_2", "host-path_2"},
		{"hostpath.csi.k8s.io", "hostpath_csi_k8s_io"},
		{"a/b c:d", "a_b_c_d"},
		{"é", "__"},
		{"", "_"},
	}
	for _, tc := range cases {
		t.Run(tc.id, func(t *testing.T) {
			must.Eq(t, tc.want, SanitizeID(tc.id))
		})
	}
}

func TestAttributeKeys_collisions(t *testing.T) {
	keys := attributeKeys([]string{"a.b", "a_b", "c.d", "c:d"})
	// An id that needs no sanitizing keeps its key whatever else exists.
	must.Eq(t, "a_b", keys["a_b"])
	must.StrHasPrefix(t, "a_b_", keys["a.b"])
	// Of two sanitized ids with the same key, the first keeps it.
	must.Eq(t, "c_d", keys["c.d"])
	must.StrHasPrefix(t, "c_d_", keys["c:d"])
	must.MapLen(t, 4, keys)
	seen := map[string]bool{}
	for _, k := range keys {
		must.False(t, seen[k])
		seen[k] = true
	}
}

// attrValues flattens attributes to strings for comparison.
func attrValues(attrs map[string]*structs.Attribute) map[string]string {
	out := make(map[string]string, len(attrs))
	for k, v := range attrs {
		out[k] = v.GoString()
	}
	return out
}

func TestBuild(t *testing.T) {
	node := PluginStatus{
		ID: "hostpath", Type: TypeNode, Socket: "/csi/hp.sock", Source: SourceTask, TaskID: "t1",
		Healthy: true, Known: true,
		Info:        PluginInfo{Name: "hostpath.csi.k8s.io", VendorVersion: "1.2.3"},
		PluginCaps:  PluginCapabilities{VolumeAccessibilityConstraints: true, OnlineExpansion: true},
		NodeService: true,
		Node:        NodeInfo{NodeID: "n1", MaxVolumes: 16, Topology: map[string]string{"topology.hostpath.csi/node": "n1"}},
		NodeCaps:    NodeCapabilities{StageUnstageVolume: true, GetVolumeStats: true},
	}
	controller := PluginStatus{
		ID: "ebs", Type: TypeController, Socket: "/csi/ebs.sock", Source: SourceTask, TaskID: "t2",
		Healthy: true, Known: true,
		Info:              PluginInfo{Name: "ebs.csi.aws.com", VendorVersion: "v1"},
		PluginCaps:        PluginCapabilities{ControllerService: true, OfflineExpansion: true},
		ControllerService: true,
		ControllerCaps:    ControllerCapabilities{CreateDeleteVolume: true, PublishUnpublishVolume: true, ListVolumes: true},
	}
	mono := PluginStatus{
		ID: "nfs.csi.k8s.io", Type: TypeMonolith, Socket: "/plugins/nfs/csi.sock", Source: SourceSocketDir,
		Healthy: true, Known: true,
		Info:              PluginInfo{Name: "nfs.csi.k8s.io", VendorVersion: "4.0"},
		PluginCaps:        PluginCapabilities{ControllerService: true},
		NodeService:       true,
		Node:              NodeInfo{NodeID: "n1"},
		NodeCaps:          NodeCapabilities{VolumeMountGroup: true},
		ControllerService: true,
		ControllerCaps:    ControllerCapabilities{GetCapacity: true},
	}
	downAfterUp := node
	downAfterUp.Healthy = false
	downAfterUp.HealthDescription = "probe failed: connection refused"

	cases := []struct {
		name    string
		plugins []PluginStatus
		// want holds attributes that must be there with these values.
		want map[string]string
		// absent holds attributes that must not be there.
		absent []string
		count  int
	}{
		{
			name:  "no plugins",
			want:  map[string]string{},
			count: 0,
		},
		{
			name:    "node plugin with topology and max volumes",
			plugins: []PluginStatus{node},
			want: map[string]string{
				"driver.csi.plugins":                                             "hostpath",
				"driver.csi.plugin.hostpath.id":                                  "hostpath",
				"driver.csi.plugin.hostpath.healthy":                             "true",
				"driver.csi.plugin.hostpath.vendor":                              "hostpath.csi.k8s.io",
				"driver.csi.plugin.hostpath.version":                             "1.2.3",
				"driver.csi.plugin.hostpath.type":                                "node",
				"driver.csi.plugin.hostpath.source":                              "task",
				"driver.csi.plugin.hostpath.socket":                              "/csi/hp.sock",
				"driver.csi.plugin.hostpath.node_id":                             "n1",
				"driver.csi.plugin.hostpath.max_volumes":                         "16",
				"driver.csi.plugin.hostpath.topology.topology.hostpath.csi/node": "n1",
				"driver.csi.plugin.hostpath.node_service":                        "true",
				"driver.csi.plugin.hostpath.controller_service":                  "false",
				"driver.csi.plugin.hostpath.volume_accessibility_constraints":    "true",
				"driver.csi.plugin.hostpath.online_expansion":                    "true",
				"driver.csi.plugin.hostpath.offline_expansion":                   "false",
				"driver.csi.plugin.hostpath.stage_unstage":                       "true",
				"driver.csi.plugin.hostpath.get_volume_stats":                    "true",
				"driver.csi.plugin.hostpath.expand":                              "false",
				"driver.csi.plugin.hostpath.volume_condition":                    "false",
				"driver.csi.plugin.hostpath.single_node_multi_writer":            "false",
				"driver.csi.plugin.hostpath.volume_mount_group":                  "false",
			},
			absent: []string{
				"driver.csi.plugin.hostpath.health_description",
				"driver.csi.plugin.hostpath.controller_publish",
				"driver.csi.conflicting_sockets",
			},
			count: 24,
		},
		{
			name:    "controller plugin has controller capabilities and no node attributes",
			plugins: []PluginStatus{controller},
			want: map[string]string{
				"driver.csi.plugins":                          "ebs",
				"driver.csi.plugin.ebs.type":                  "controller",
				"driver.csi.plugin.ebs.controller_service":    "true",
				"driver.csi.plugin.ebs.node_service":          "false",
				"driver.csi.plugin.ebs.offline_expansion":     "true",
				"driver.csi.plugin.ebs.create_delete_volume":  "true",
				"driver.csi.plugin.ebs.controller_publish":    "true",
				"driver.csi.plugin.ebs.list_volumes":          "true",
				"driver.csi.plugin.ebs.get_capacity":          "false",
				"driver.csi.plugin.ebs.controller_expand":     "false",
				"driver.csi.plugin.ebs.controller_get_volume": "false",
			},
			absent: []string{
				"driver.csi.plugin.ebs.node_id",
				"driver.csi.plugin.ebs.max_volumes",
				"driver.csi.plugin.ebs.stage_unstage",
			},
		},
		{
			name:    "monolith found in a socket dir gets a sanitized key",
			plugins: []PluginStatus{mono},
			want: map[string]string{
				"driver.csi.plugins":                                  "nfs.csi.k8s.io",
				"driver.csi.plugin.nfs_csi_k8s_io.id":                 "nfs.csi.k8s.io",
				"driver.csi.plugin.nfs_csi_k8s_io.type":               "monolith",
				"driver.csi.plugin.nfs_csi_k8s_io.source":             "socket_dir",
				"driver.csi.plugin.nfs_csi_k8s_io.node_id":            "n1",
				"driver.csi.plugin.nfs_csi_k8s_io.volume_mount_group": "true",
				"driver.csi.plugin.nfs_csi_k8s_io.get_capacity":       "true",
				"driver.csi.plugin.nfs_csi_k8s_io.controller_service": "true",
			},
			absent: []string{"driver.csi.plugin.nfs_csi_k8s_io.max_volumes"},
		},
		{
			name:    "unreachable plugin keeps what was last known",
			plugins: []PluginStatus{downAfterUp},
			want: map[string]string{
				"driver.csi.plugins":                            "hostpath",
				"driver.csi.plugin.hostpath.healthy":            "false",
				"driver.csi.plugin.hostpath.health_description": "probe failed: connection refused",
				"driver.csi.plugin.hostpath.vendor":             "hostpath.csi.k8s.io",
				"driver.csi.plugin.hostpath.version":            "1.2.3",
				"driver.csi.plugin.hostpath.node_id":            "n1",
			},
		},
		{
			name: "never reached plugin is listed unhealthy without details",
			plugins: []PluginStatus{{
				ID: "late", Type: TypeNode, Socket: "/csi/late.sock", Source: SourceTask,
				HealthDescription: `socket "/csi/late.sock" does not exist`,
			}},
			want: map[string]string{
				"driver.csi.plugins":                        "late",
				"driver.csi.plugin.late.id":                 "late",
				"driver.csi.plugin.late.healthy":            "false",
				"driver.csi.plugin.late.health_description": `socket "/csi/late.sock" does not exist`,
				"driver.csi.plugin.late.type":               "node",
				"driver.csi.plugin.late.socket":             "/csi/late.sock",
				"driver.csi.plugin.late.source":             "task",
			},
			absent: []string{"driver.csi.plugin.late.vendor", "driver.csi.plugin.late.node_service"},
			count:  7,
		},
		{
			name: "conflicting and unidentified sockets are not listed as plugins",
			plugins: []PluginStatus{
				node,
				{ID: "hostpath", Socket: "/plugins/b.sock", Source: SourceSocketDir, Conflict: `plugin id "hostpath" is already served by task "t1"`},
				{ID: "hostpath", Socket: "/plugins/a.sock", Source: SourceSocketDir, Healthy: true},
				{Socket: "/plugins/mute.sock", Source: SourceSocketDir},
				controller,
			},
			want: map[string]string{
				"driver.csi.plugins":                 "ebs,hostpath",
				"driver.csi.conflicting_sockets":     "/plugins/a.sock,/plugins/b.sock",
				"driver.csi.plugin.hostpath.socket":  "/csi/hp.sock",
				"driver.csi.plugin.hostpath.source":  "task",
				"driver.csi.plugin.ebs.healthy":      "true",
				"driver.csi.plugin.hostpath.healthy": "true",
			},
		},
		{
			name: "ids that sanitize alike get distinct keys",
			plugins: []PluginStatus{
				{ID: "a.b", Socket: "/x/1.sock", Source: SourceTask, Type: TypeNode, Healthy: true},
				{ID: "a_b", Socket: "/x/2.sock", Source: SourceTask, Type: TypeNode},
			},
			want: map[string]string{
				"driver.csi.plugins":                "a.b,a_b",
				"driver.csi.plugin.a_b.id":          "a_b",
				"driver.csi.plugin.a_b.healthy":     "false",
				"driver.csi.plugin.a_b_108bf50c.id": "a.b",
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := attrValues(Build(tc.plugins))
			for k, v := range tc.want {
				must.MapContainsKey(t, got, k)
				must.Eq(t, v, got[k], must.Sprintf("attribute %s", k))
			}
			for _, k := range tc.absent {
				must.MapNotContainsKey(t, got, k)
			}
			if tc.count > 0 || len(tc.want) == 0 {
				must.MapLen(t, tc.count, got, must.Sprintf("%v", got))
			}
		})
	}
}

func TestBuild_doesNotReorderInput(t *testing.T) {
	in := []PluginStatus{{ID: "b", Source: SourceTask}, {ID: "a", Source: SourceTask}}
	_ = Build(in)
	must.Eq(t, "b", in[0].ID)
}

func TestBuild_attributeTypes(t *testing.T) {
	attrs := Build([]PluginStatus{{
		ID: "hp", Type: TypeNode, Socket: "/s.sock", Source: SourceTask, Known: true, Healthy: true,
		NodeService: true, Node: NodeInfo{NodeID: "n", MaxVolumes: 3},
	}})
	healthy, ok := attrs["driver.csi.plugin.hp.healthy"].GetBool()
	must.True(t, ok)
	must.True(t, healthy)
	maxVols, ok := attrs["driver.csi.plugin.hp.max_volumes"].GetInt()
	must.True(t, ok)
	must.Eq(t, int64(3), maxVols)
	nodeID, ok := attrs["driver.csi.plugin.hp.node_id"].GetString()
	must.True(t, ok)
	must.Eq(t, "n", nodeID)
	stage, ok := attrs["driver.csi.plugin.hp.stage_unstage"].GetBool()
	must.True(t, ok)
	must.False(t, stage)
}
