package fingerprint

import (
	"cmp"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/nomad/plugins/shared/structs"
)

// PluginType is what a plugin is used for on this node.
type PluginType string

// Plugin types, as in a job's csi_plugin block.
const (
	TypeNode       PluginType = "node"
	TypeController PluginType = "controller"
	TypeMonolith   PluginType = "monolith"
)

// Valid reports whether t is one of the plugin types.
func (t PluginType) Valid() bool {
	return t == TypeNode || t == TypeController || t == TypeMonolith
}

// Source says how the driver learnt of a plugin socket.
type Source string

// Plugin sources.
const (
	// SourceTask is a plugin the driver launched as a task; its id is the
	// one the job declared.
	SourceTask Source = "task"
	// SourceSocketDir is a socket found in plugin_socket_dirs; its id is
	// the name the plugin gives in GetPluginInfo.
	SourceSocketDir Source = "socket_dir"
)

// AttrPrefix starts every attribute Build makes.
const AttrPrefix = "driver.csi."

// PluginStatus is what is known of one plugin socket: how it was found,
// whether it is healthy, and what it last said about itself. The volume
// code reads NodeService, Node, NodeCaps and ControllerCaps from here.
type PluginStatus struct {
	// ID is the plugin id: the declared one for a task plugin, the
	// GetPluginInfo name for a discovered socket ("" until it answered
	// once). It is kept as given; attribute keys use SanitizeID.
	ID     string
	Type   PluginType
	Socket string
	Source Source
	// TaskID is the task serving a SourceTask plugin.
	TaskID string

	Healthy bool
	// HealthDescription says why the plugin is unhealthy; "" when healthy.
	HealthDescription string
	// Since is when the plugin last became healthy or unhealthy.
	Since time.Time
	// Conflict is set on a discovered socket whose id is already served by
	// a task plugin or by another socket (the one with the smallest path).
	// Such a socket is never healthy, does not appear under
	// driver.csi.plugin.<id>, and is listed in driver.csi.conflicting_sockets.
	Conflict string

	// Known is true once the plugin answered GetPluginInfo, its
	// capabilities and NodeGetInfo; the fields below are then its last
	// known answers, kept while it is unreachable.
	Known             bool
	Info              PluginInfo
	PluginCaps        PluginCapabilities
	NodeService       bool
	Node              NodeInfo
	NodeCaps          NodeCapabilities
	ControllerService bool
	ControllerCaps    ControllerCapabilities
}

// SanitizeID turns a plugin id into one segment of an attribute key:
// ASCII letters, digits, '_' and '-' are kept and every other byte becomes
// '_', so "hostpath.csi.k8s.io" is "hostpath_csi_k8s_io". The id itself is
// kept, unchanged, in driver.csi.plugin.<key>.id and in driver.csi.plugins.
func SanitizeID(id string) string {
	if id == "" {
		return "_"
	}
	b := []byte(id)
	for i, c := range b {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_', c == '-':
		default:
			b[i] = '_'
		}
	}
	return string(b)
}

// attributeKeys gives each id its key segment. An id that needs no
// sanitizing always keeps itself as key; a sanitized id whose key is taken
// by another id gets "_<fnv32a of the id in hex>" appended, so two plugins
// never share attributes.
func attributeKeys(ids []string) map[string]string {
	keys := make(map[string]string, len(ids))
	taken := make(map[string]bool, len(ids))
	for _, id := range ids {
		if SanitizeID(id) == id {
			keys[id] = id
			taken[id] = true
		}
	}
	for _, id := range ids {
		if _, ok := keys[id]; ok {
			continue
		}
		k := SanitizeID(id)
		if taken[k] {
			h := fnv.New32a()
			_, _ = h.Write([]byte(id))
			k = fmt.Sprintf("%s_%08x", k, h.Sum32())
		}
		keys[id] = k
		taken[k] = true
	}
	return keys
}

// Build turns plugin records into the node attributes listed in the
// package documentation. Records without an id (a discovered socket that
// never answered) are left out; of two records with the same id the task
// plugin, else the smaller socket path, wins and the other counts as
// conflicting. What was last known of an unreachable plugin stays, with
// healthy=false.
func Build(plugins []PluginStatus) map[string]*structs.Attribute {
	// About 45 attributes per plugin with node and controller services.
	attrs := make(map[string]*structs.Attribute, 2+45*len(plugins))
	sorted := slices.Clone(plugins)
	slices.SortFunc(sorted, comparePlugins)

	var owners []PluginStatus
	var conflicts []string
	seen := map[string]bool{}
	for _, p := range sorted {
		switch {
		case p.Conflict != "" || (p.ID != "" && seen[p.ID]):
			conflicts = append(conflicts, p.Socket)
		case p.ID != "":
			seen[p.ID] = true
			owners = append(owners, p)
		}
	}
	if len(conflicts) > 0 {
		slices.Sort(conflicts)
		attrs[AttrPrefix+"conflicting_sockets"] = structs.NewStringAttribute(strings.Join(conflicts, ","))
	}
	if len(owners) == 0 {
		return attrs
	}

	ids := make([]string, len(owners))
	for i, p := range owners {
		ids[i] = p.ID
	}
	attrs[AttrPrefix+"plugins"] = structs.NewStringAttribute(strings.Join(ids, ","))
	keys := attributeKeys(ids)
	for _, p := range owners {
		addPlugin(attrs, AttrPrefix+"plugin."+keys[p.ID]+".", p)
	}
	return attrs
}

// comparePlugins orders by id, task plugins first, then by socket.
func comparePlugins(a, b PluginStatus) int {
	if c := cmp.Compare(a.ID, b.ID); c != 0 {
		return c
	}
	if (a.Source == SourceTask) != (b.Source == SourceTask) {
		if a.Source == SourceTask {
			return -1
		}
		return 1
	}
	return cmp.Compare(a.Socket, b.Socket)
}

func addPlugin(attrs map[string]*structs.Attribute, prefix string, p PluginStatus) {
	str := func(name, v string) {
		if v != "" {
			attrs[prefix+name] = structs.NewStringAttribute(v)
		}
	}
	flag := func(name string, v bool) { attrs[prefix+name] = structs.NewBoolAttribute(v) }

	str("id", p.ID)
	flag("healthy", p.Healthy)
	if !p.Healthy {
		desc := p.HealthDescription
		if desc == "" {
			desc = "plugin has not been probed yet"
		}
		str("health_description", desc)
	}
	str("socket", p.Socket)
	str("source", string(p.Source))
	str("type", string(p.Type))
	if !p.Known {
		return
	}
	str("vendor", p.Info.Name)
	str("version", p.Info.VendorVersion)

	pc := p.PluginCaps
	flag("controller_service", pc.ControllerService)
	flag("volume_accessibility_constraints", pc.VolumeAccessibilityConstraints)
	flag("group_controller_service", pc.GroupControllerService)
	flag("snapshot_metadata_service", pc.SnapshotMetadataService)
	flag("online_expansion", pc.OnlineExpansion)
	flag("offline_expansion", pc.OfflineExpansion)

	flag("node_service", p.NodeService)
	if p.NodeService {
		str("node_id", p.Node.NodeID)
		if p.Node.MaxVolumes > 0 {
			attrs[prefix+"max_volumes"] = structs.NewIntAttribute(p.Node.MaxVolumes, "")
		}
		for k, v := range p.Node.Topology {
			attrs[prefix+"topology."+k] = structs.NewStringAttribute(v)
		}
		nc := p.NodeCaps
		flag("stage_unstage", nc.StageUnstageVolume)
		flag("get_volume_stats", nc.GetVolumeStats)
		flag("expand", nc.ExpandVolume)
		flag("volume_condition", nc.VolumeCondition)
		flag("single_node_multi_writer", nc.SingleNodeMultiWriter)
		flag("volume_mount_group", nc.VolumeMountGroup)
	}

	if p.ControllerService {
		cc := p.ControllerCaps
		flag("create_delete_volume", cc.CreateDeleteVolume)
		flag("controller_publish", cc.PublishUnpublishVolume)
		flag("controller_publish_readonly", cc.PublishReadonly)
		flag("list_volumes", cc.ListVolumes)
		flag("list_volumes_published_nodes", cc.ListVolumesPublishedNodes)
		flag("get_capacity", cc.GetCapacity)
		flag("create_delete_snapshot", cc.CreateDeleteSnapshot)
		flag("list_snapshots", cc.ListSnapshots)
		flag("get_snapshot", cc.GetSnapshot)
		flag("clone_volume", cc.CloneVolume)
		flag("controller_expand", cc.ExpandVolume)
		flag("controller_volume_condition", cc.VolumeCondition)
		flag("controller_get_volume", cc.GetVolume)
		flag("controller_single_node_multi_writer", cc.SingleNodeMultiWriter)
		flag("controller_modify_volume", cc.ModifyVolume)
	}
}
