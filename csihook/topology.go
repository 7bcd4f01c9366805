package csihook

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// Topology and limits. A plugin's NodeGetInfo says which topology segments
// this node is in and how many volumes it may have here:
//
//   - CreateVolume asks for a volume accessible from this node: the node's
//     segments are both the requisite and the preferred topology. A volume
//     the plugin answers with that is accessible only elsewhere is refused
//     before anything is staged or published (the created record is kept,
//     so the volume is not created again; nothing uses it);
//   - max_volumes_per_node is enforced per plugin: a task that would bring
//     more of the plugin's volumes onto this node than that is refused
//     before any call, naming the limit.
//
// A hostile job controls neither: topology and the limit come from the
// plugin, and the job can only be refused by them.

// accessibility is the node's topology as CreateVolume's requirement, or
// nil when the plugin gave none or lacks VOLUME_ACCESSIBILITY_CONSTRAINTS
// (the CSI spec forbids the field then).
func accessibility(info PluginInfo) *csi.TopologyRequirement {
	if len(info.Topology) == 0 || !info.AccessibilityConstraints {
		return nil
	}
	t := &csi.Topology{Segments: maps.Clone(info.Topology)}
	return &csi.TopologyRequirement{Requisite: []*csi.Topology{t}, Preferred: []*csi.Topology{{Segments: maps.Clone(info.Topology)}}}
}

// checkAccessible refuses a created volume that the plugin says is not
// accessible from this node: no topology it lists is one this node is in
// (topology keys compared without regard to case).
// A volume without accessible topology is accessible everywhere, and so
// is one of a plugin without VOLUME_ACCESSIBILITY_CONSTRAINTS, which has
// no topology to speak of (CSI spec).
func (m *Manager) checkAccessible(req VolumeRequest, info PluginInfo, vol *csi.Volume) error {
	topo := vol.GetAccessibleTopology()
	if len(topo) == 0 || len(info.Topology) == 0 || !info.AccessibilityConstraints {
		return nil
	}
	// Keys are case-insensitive (CSI spec, message Topology: "Keys MUST
	// be case-insensitive"); values are compared as they are.
	node := make(map[string]string, len(info.Topology))
	for k, v := range info.Topology {
		node[strings.ToLower(k)] = v
	}
	var seen []string
	for _, t := range topo {
		match := true
		for k, v := range t.GetSegments() {
			if nv, ok := node[strings.ToLower(k)]; !ok || nv != v {
				match = false
				break
			}
		}
		if match {
			return nil
		}
		seen = append(seen, segments(t.GetSegments()))
	}
	return &OpError{Method: MethodCreateVolume, Volume: req.Name, VolumeID: vol.GetVolumeId(), PluginID: req.PluginID, Code: codes.FailedPrecondition,
		// The plugin's list is cut as its error messages are, leaving
		// room for the node's own segments.
		Message: cleanBounded(fmt.Sprintf("the plugin created the volume accessible from %s, which does not include node %q (%s)",
			cleanBounded(strings.Join(seen, " or "), MaxErrorMessage/2, req.Secrets), m.cfg.NodeName, segments(info.Topology)),
			MaxErrorMessage, req.Secrets),
		Hint: fmt.Sprintf("volume %q cannot be used on this node: check the create parameters and the topology of plugin %q, or place the job on a node in the volume's topology", req.VolumeID, req.PluginID)}
}

func segments(s map[string]string) string {
	keys := slices.Sorted(maps.Keys(s))
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, k+"="+s[k])
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

// checkVolumeLimit refuses requests that would bring more volumes of their
// plugins onto this node than the plugins' max_volumes_per_node. Volumes
// already on the node, and those the requests share, count once.
//
// Volumes another setup reserved count as there, and the requests' own are
// reserved (by plan) until releaseReserved, so that two starts at once
// cannot both take the last place.
func (m *Manager) checkVolumeLimit(plans []plan) error {
	// The journal takes mu: resolve before.
	ids := make([]string, len(plans))
	for i, p := range plans {
		if p.info.MaxVolumes > 0 {
			ids[i], _ = m.resolve(p.req)
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	byPlugin := map[string]map[string]bool{}
	limits := map[string]int64{}
	var names []string
	for i, p := range plans {
		if p.info.MaxVolumes <= 0 {
			continue
		}
		id := ids[i]
		k := volKey{p.req.PluginID, id}
		if _, ok := m.vols[k]; ok || m.reserved[k] > 0 {
			continue
		}
		if byPlugin[p.req.PluginID] == nil {
			byPlugin[p.req.PluginID] = map[string]bool{}
		}
		byPlugin[p.req.PluginID][id] = true
		limits[p.req.PluginID] = p.info.MaxVolumes
		names = append(names, p.req.Name)
	}
	var errs []string
	for plugin, vols := range byPlugin {
		have := int64(0)
		for k := range m.vols {
			if k.plugin == plugin {
				have++
			}
		}
		for k, n := range m.reserved {
			if _, ok := m.vols[k]; !ok && n > 0 && k.plugin == plugin {
				have++
			}
		}
		if max := limits[plugin]; have+int64(len(vols)) > max {
			errs = append(errs, fmt.Sprintf("CSI plugin %q may have at most %d volumes on node %q (max_volumes_per_node from NodeGetInfo); %d are there and this task needs %d more: stop a task using one, or place the job on another node",
				plugin, max, m.cfg.NodeName, have, len(vols)))
		}
	}
	if len(errs) == 0 {
		if m.reserved == nil {
			m.reserved = map[volKey]int{}
		}
		for i, p := range plans {
			if p.info.MaxVolumes > 0 {
				k := volKey{p.req.PluginID, ids[i]}
				m.reserved[k]++
				plans[i].reserved = &k
			}
		}
		return nil
	}
	sort.Strings(errs)
	return &conflictError{msg: fmt.Sprintf("volumes %s: %s", strings.Join(names, ", "), strings.Join(errs, "; "))}
}

// releaseReserved ends the reservations checkVolumeLimit made for plans.
func (m *Manager) releaseReserved(plans []plan) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range plans {
		if p.reserved == nil {
			continue
		}
		if k := *p.reserved; m.reserved[k] <= 1 {
			delete(m.reserved, k)
		} else {
			m.reserved[k]--
		}
	}
}
