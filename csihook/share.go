package csihook

import (
	"fmt"
	"strings"
)

// Sharing rules: who may use a volume of this node. A volume belongs to
// the namespace that created it here or first had it published, and is
// claimed by the namespace setting it up meanwhile (checkNamespace,
// claimNamespace, ownerRecord); tasks sharing a volume must ask for the access mode,
// attachment mode and file system type it is staged with, and a
// single-node-writer volume serves one task (checkShare).

// Owner returns the Nomad namespace a volume of this node belongs to, if
// one is recorded or claims it with the volume's record.
func (m *Manager) Owner(pluginID, volumeID string) (string, bool) {
	return m.journal.owner(pluginID, volumeID)
}

type namespaceError struct{ msg string }

func (e *namespaceError) Error() string        { return e.msg }
func (e *namespaceError) Is(target error) bool { return target == ErrOtherNamespace }

// checkNamespace refuses a request of a namespace other than the one the
// volume belongs to on this node, unless the operator allows it.
func (m *Manager) checkNamespace(req VolumeRequest, volumeID string) error {
	if req.Namespace == "" || m.cfg.AllowCrossNamespace {
		return nil
	}
	owner, ok := m.journal.owner(req.PluginID, volumeID)
	if !ok || owner == req.Namespace {
		return nil
	}
	id := fmt.Sprintf("volume_id %q", volumeID)
	if volumeID != req.VolumeID {
		id = fmt.Sprintf("volume_id %q (created on this node as %q)", volumeID, req.VolumeID)
	}
	return &namespaceError{fmt.Sprintf("volume %q: %s of CSI plugin %q belongs to namespace %q on node %q (the namespace that created or first used it, or is setting it up), not to namespace %q: run the job in namespace %q, or have the operator set allow_cross_namespace_volumes = true in the driver's plugin config",
		req.Name, id, req.PluginID, owner, m.cfg.NodeName, req.Namespace, owner)}
}

// claimNamespace returns the namespace a setup of the request claims the
// volume for with its record: the request's, when the volume has no owner
// and no claim; "" otherwise.
func (m *Manager) claimNamespace(req VolumeRequest, volumeID string) string {
	if req.Namespace == "" {
		return ""
	}
	if _, ok := m.journal.owner(req.PluginID, volumeID); ok {
		return ""
	}
	return req.Namespace
}

// claimOwner returns the op that records the request's namespace as the
// volume's owner, or nothing when it has one or the request has no
// namespace. It is for a volume the request created: its namespace owns
// it from then on, used or not.
func (m *Manager) claimOwner(req VolumeRequest, volumeID string) []journalOp {
	ns := m.claimNamespace(req, volumeID)
	if ns == "" {
		return nil
	}
	return []journalOp{ownerPut(ownerRecord{PluginID: req.PluginID, VolumeID: volumeID, Namespace: ns})}
}

type conflictError struct{ msg string }

func (e *conflictError) Error() string        { return e.msg }
func (e *conflictError) Is(target error) bool { return target == ErrConflict }

// checkShare refuses a request that cannot share a volume with the tasks
// already using it on this node: another access mode, attachment mode or
// file system type than it is staged with, or a second task on a
// single-node-writer volume.
func (m *Manager) checkShare(taskID string, req VolumeRequest, volumeID string) error {
	k := volKey{req.PluginID, volumeID}
	m.mu.Lock()
	defer m.mu.Unlock()
	others := m.otherUsersLocked(k, taskID)
	if len(others) == 0 {
		return nil
	}
	other := others[0].taskID
	if v, ok := m.vols[k]; ok && (v.AccessMode != req.AccessMode || v.AttachmentMode != attachment(req) || v.FSType != req.FSType) {
		return &conflictError{fmt.Sprintf("volume %q: volume_id %q is in use on this node with access_mode = %q, attachment_mode = %q, fs_type = %q: use the same values or stop task %q",
			req.Name, volumeID, v.AccessMode, v.AttachmentMode, v.FSType, other)}
	}
	if err := m.checkGroupShareLocked(taskID, req, k); err != nil {
		return err
	}
	if req.AccessMode == AccessSingleNodeWriter {
		return &conflictError{fmt.Sprintf("volume %q: volume_id %q is single-node-writer and task %q already has it published writable on this node: stop that task first or use a multi-node access mode",
			req.Name, volumeID, other)}
	}
	if req.AccessMode == AccessMultiNodeSingleWriter && !req.ReadOnly {
		// Nomad: "the scheduler only allows one allocation to have
		// read/write access". The CSI spec's limit is about nodes, so
		// on this node only the driver can keep a second allocation
		// from writing; tasks of one allocation share its claim.
		alloc := allocOf(taskID)
		for _, ref := range others {
			t := m.tasks[ref.taskID][ref.name]
			if t.ReadOnly || allocOf(ref.taskID) == alloc {
				continue
			}
			return &conflictError{fmt.Sprintf("volume %q: volume_id %q is multi-node-single-writer and task %q of allocation %q has it published writable on this node, and one allocation may write it: set read_only = true to read it, stop that allocation first, or use access_mode = %q",
				req.Name, volumeID, ref.taskID, allocOf(ref.taskID), AccessMultiNodeMultiWriter)}
		}
	}
	return nil
}

// allocOf returns the allocation of a Nomad task ID (allocation
// ID/task name/invocation), or the ID itself when it has no such form.
func allocOf(taskID string) string {
	alloc, rest, ok := strings.Cut(taskID, "/")
	if !ok || alloc == "" || !strings.Contains(rest, "/") {
		return taskID
	}
	return alloc
}
