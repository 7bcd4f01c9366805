package csihook

import (
	"context"
	"errors"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/dustin/go-humanize"
	"google.golang.org/grpc/codes"
)

// Expansion. A volume this node created remembers the create.capacity_min
// it was created or last expanded with (createdRecord.Requested) and the
// size the plugin answered (Capacity). A later request for it with a larger
// capacity_min grows it instead of calling CreateVolume again (which a
// plugin answers with AlreadyExists for another size):
//
//  1. ControllerExpandVolume when the plugin has the controller capability
//     EXPAND_VOLUME and its answered capacity is below the request; the
//     new size is journalled with whether the node must expand too;
//  2. once the volume is published for the task, NodeExpandVolume when the
//     node capability EXPAND_VOLUME is there (online: the file system is
//     mounted); a plugin without it grows the file system at its next
//     NodeStageVolume, as the CSI spec leaves to it. One that answers
//     FailedPrecondition (cannot grow it while staged or published),
//     which the spec says not to retry, is not asked again while the
//     volume stays staged: the task starts and is told, and the call is
//     made again once the volume was released and is staged anew. A
//     plugin that expands only offline (VolumeExpansion OFFLINE without
//     ONLINE) gets no ControllerExpandVolume while the volume is in use on
//     this node (checkOffline).
//
// The journal keeps the request and the owed node expansion, so that a
// restart neither expands again nor forgets the node's part. A smaller
// capacity_min is refused before any call: volumes do not shrink.
//
// What a hostile job can do with it: grow a volume it created on this
// node up to what the plugin allows (create.capacity_max and the plugin's
// own limits bound it, as for CreateVolume); it cannot shrink one, and a
// volume another namespace owns is refused before (checkNamespace).

// resizeOf says whether a request grows a volume this node created, and
// refuses one that would shrink it or that the plugin cannot grow.
func (m *Manager) resizeOf(req VolumeRequest, info PluginInfo) (bool, error) {
	if req.Create == nil || req.Create.CapacityMin <= 0 {
		return false, nil
	}
	c, ok := m.journal.created(req.PluginID, req.VolumeID)
	if !ok || c.Requested <= 0 {
		return false, nil
	}
	want := req.Create.CapacityMin
	switch {
	case want < c.Requested:
		return false, invalidf("volume %q: create.capacity_min %s is smaller than the %s volume %q was created or last expanded with: volumes cannot shrink; set create.capacity_min to at least %s",
			req.Name, size(want), size(c.Requested), req.VolumeID, size(c.Requested))
	case want == c.Requested && !c.NodeExpand:
		return false, nil
	case !info.ControllerExpand && !info.NodeExpand:
		return false, invalidf("volume %q: CSI plugin %q cannot expand volumes (no EXPAND_VOLUME capability): keep create.capacity_min at %s",
			req.Name, req.PluginID, size(c.Requested))
	}
	if err := m.checkOffline(req, info, c); err != nil {
		return false, err
	}
	return true, nil
}

// checkOffline refuses a growth that needs ControllerExpandVolume from a
// plugin that expands only offline while the volume is attached, staged or
// published on this node: the CSI spec allows the call then only after
// the volume was released (ControllerUnpublish, else NodeUnstage, else
// NodeUnpublish). "Only offline" is VolumeExpansion OFFLINE without
// ONLINE: a plugin that advertises neither (kubernetes-csi's NFS driver)
// is called as before, and says FailedPrecondition itself if it must.
// Checked in preflight and again under the volume's lock.
func (m *Manager) checkOffline(req VolumeRequest, info PluginInfo, c createdRecord) error {
	want := req.Create.CapacityMin
	offlineOnly := info.OfflineExpansion && !info.OnlineExpansion
	if !info.ControllerExpand || !offlineOnly || want <= c.Requested || (c.Capacity != 0 && c.Capacity >= want) {
		return nil
	}
	if _, inUse := m.vol(volKey{req.PluginID, c.VolumeID}); !inUse {
		return nil
	}
	return &conflictError{msg: fmt.Sprintf("volume %q: CSI plugin %q expands volumes only offline (no ONLINE volume expansion) and volume_id %q is in use on node %q: stop the tasks using it, or keep create.capacity_min at %s",
		req.Name, req.PluginID, c.VolumeID, m.cfg.NodeName, size(c.Requested))}
}

func size(n int64) string {
	return fmt.Sprintf("%q (%d bytes)", humanize.IBytes(uint64(n)), n)
}

// expandController grows a created volume to the request's capacity_min
// with ControllerExpandVolume (when the plugin has it and the volume is
// smaller) and journals the new size and whether the node must expand.
// The caller holds the volume's lock.
func (m *Manager) expandController(ctx context.Context, taskID string, req VolumeRequest, info PluginInfo, o op, volumeID string) error {
	c, ok := m.journal.created(req.PluginID, req.VolumeID)
	if !ok {
		return nil
	}
	want := req.Create.CapacityMin
	if want <= c.Requested {
		return nil // only the node's part is owed
	}
	if err := m.checkOffline(req, info, c); err != nil {
		return err
	}
	ann := annotations(req.Name, req.PluginID, volumeID)
	node := info.NodeExpand
	if info.ControllerExpand && (c.Capacity == 0 || c.Capacity < want) {
		o.method, o.volumeID = MethodControllerExpandVolume, volumeID
		_, _, ctrl, err := m.pluginClients(o)
		if err != nil {
			return err
		}
		m.event(taskID, fmt.Sprintf("Expanding volume %q from %s to %s", req.Name, humanize.IBytes(uint64(max(c.Capacity, c.Requested))), humanize.IBytes(uint64(want))), ann)
		var resp *csi.ControllerExpandVolumeResponse
		err = m.call(ctx, o, func(ctx context.Context) error {
			var err error
			resp, err = ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
				VolumeId:         volumeID,
				CapacityRange:    &csi.CapacityRange{RequiredBytes: want, LimitBytes: req.Create.CapacityMax},
				Secrets:          req.Secrets,
				VolumeCapability: capability(req.AccessMode, attachment(req), req.FSType, req.MountFlags),
			})
			return err
		})
		if err != nil {
			return err
		}
		c.Capacity = resp.GetCapacityBytes()
		node = node && resp.GetNodeExpansionRequired()
	}
	c.Requested, c.NodeExpand = want, node
	if err := m.journal.commit(createdPut(c)); err != nil {
		return err
	}
	m.logger.Info("volume expanded by its controller", "task_id", taskID, "volume", req.Name, "plugin_id", req.PluginID,
		"volume_id", volumeID, "capacity_bytes", c.Capacity, "node_expansion", node)
	if !node && !info.NodeExpand && attachment(req) == AttachmentFileSystem {
		m.event(taskID, fmt.Sprintf("Volume %q grows on this node at its next staging: plugin %q cannot expand it online (no node EXPAND_VOLUME)", req.Name, req.PluginID), ann)
	}
	return nil
}

// expandNode calls NodeExpandVolume for a published volume whose node
// expansion is owed, then journals it done. The caller holds the volume's
// lock.
func (m *Manager) expandNode(ctx context.Context, taskID string, req VolumeRequest, info PluginInfo, o op, vol volRecord, tr taskRecord) error {
	if req.Create == nil || !info.NodeExpand {
		return nil
	}
	c, ok := m.journal.created(req.PluginID, req.VolumeID)
	if !ok || !c.NodeExpand || c.VolumeID != vol.VolumeID || m.isExpandHeld(vol.key()) {
		return nil
	}
	o.method, o.volumeID, o.path = MethodNodeExpandVolume, vol.VolumeID, tr.Target
	_, node, _, err := m.pluginClients(o)
	if err != nil {
		return err
	}
	var resp *csi.NodeExpandVolumeResponse
	err = m.call(ctx, o, func(ctx context.Context) error {
		var err error
		resp, err = node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{
			VolumeId: vol.VolumeID, VolumePath: tr.Target, StagingTargetPath: vol.stagingTarget(),
			CapacityRange:    &csi.CapacityRange{RequiredBytes: c.Requested, LimitBytes: req.Create.CapacityMax},
			VolumeCapability: withGroup(capability(tr.AccessMode, tr.AttachmentMode, tr.FSType, tr.MountFlags), tr.MountGroup),
			Secrets:          tr.Secrets,
		})
		return err
	})
	var oe *OpError
	if errors.As(err, &oe) && oe.Code == codes.FailedPrecondition {
		// The file system cannot grow while staged or published, and the
		// CSI spec says not to retry: the task starts on the volume as
		// it is, and the call is not made again while the volume stays
		// staged. The node's part stays owed: once the volume was
		// released, its next staging asks again (kubelet's in-use
		// expansion error holds the same way, while mounted).
		m.setExpandHeld(vol.key(), true)
		m.event(taskID, fmt.Sprintf("Volume %q was not grown on this node (%s: %s): it is grown once the volume is staged again", req.Name, oe.Code, oe.Message),
			annotations(req.Name, req.PluginID, vol.VolumeID))
		return nil
	}
	if err != nil {
		return err
	}
	c.NodeExpand = false
	c.Capacity = max(c.Capacity, resp.GetCapacityBytes())
	if err := m.journal.commit(createdPut(c)); err != nil {
		return err
	}
	m.event(taskID, fmt.Sprintf("Expanded volume %q to %s", req.Name, humanize.IBytes(uint64(max(c.Capacity, c.Requested)))), annotations(req.Name, req.PluginID, vol.VolumeID))
	return nil
}

func (m *Manager) isExpandHeld(k volKey) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.expandHeld[k]
}

func (m *Manager) setExpandHeld(k volKey, held bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if held {
		m.expandHeld[k] = true
	} else {
		delete(m.expandHeld, k)
	}
}
