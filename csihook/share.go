package csihook

import (
	"fmt"
	"slices"
)

// Sharing rules: who may use a volume of this node. A volume belongs to
// the namespace that created it here or first had it published, and is
// claimed by the namespace setting it up meanwhile (checkNamespace,
// claimNamespace, ownerRecord); tasks sharing a volume must ask for the access mode,
// attachment mode and file system type it is staged with, and a
// single-node-writer volume serves the tasks of one allocation, which
// share its one publish (checkShare, allocShare).

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

type conflictError struct {
	msg string
	// unsettled: the conflict passes by itself (ErrUnsettled).
	unsettled bool
}

func (e *conflictError) Error() string { return e.msg }
func (e *conflictError) Is(target error) bool {
	return target == ErrConflict || (e.unsettled && target == ErrUnsettled)
}

// checkShare refuses a request that cannot share a volume with the tasks
// already using it on this node: another access mode, attachment mode or
// file system type than it is staged with, or a task of a second
// allocation on a single-node-writer volume.
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
		return &conflictError{msg: fmt.Sprintf("volume %q: volume_id %q is in use on this node with access_mode = %q, attachment_mode = %q, fs_type = %q: use the same values or stop task %q",
			req.Name, volumeID, v.AccessMode, v.AttachmentMode, v.FSType, other)}
	}
	if err := m.checkGroupShareLocked(taskID, req, k); err != nil {
		return err
	}
	if req.AccessMode == AccessSingleNodeWriter {
		return m.checkAllocShareLocked(taskID, req, volumeID, others)
	}
	if req.AccessMode == AccessMultiNodeSingleWriter && !req.ReadOnly {
		// Nomad: "the scheduler only allows one allocation to have
		// read/write access". The CSI spec's limit is about nodes, so
		// on this node only the driver can keep a second allocation
		// from writing; tasks of one allocation share its claim.
		if ref, ok := m.otherAllocationLocked(taskID, others, true); ok {
			if m.leavingLocked(taskID, others, true) {
				return unpublishingConflict(req, volumeID, "multi-node-single-writer", ref)
			}
			return &conflictError{msg: fmt.Sprintf("volume %q: volume_id %q is multi-node-single-writer and task %q%s has it published writable on this node, and one allocation may write it: set read_only = true to read it, stop that allocation first, or use access_mode = %q",
				req.Name, volumeID, ref.taskID, ofAlloc(ref.taskID), AccessMultiNodeMultiWriter)}
		}
	}
	return nil
}

// otherAllocationLocked returns the first of others that is a task of
// another allocation than taskID's, only among those that write when
// writers is set. The caller holds m.mu.
func (m *Manager) otherAllocationLocked(taskID string, others []taskRef, writers bool) (taskRef, bool) {
	alloc := allocOf(taskID)
	for _, ref := range others {
		if writers && m.tasks[ref.taskID][ref.name].ReadOnly {
			continue
		}
		if allocOf(ref.taskID) != alloc {
			return ref, true
		}
	}
	return taskRef{}, false
}

// leavingLocked reports whether every one of others that is a task of
// another allocation than taskID's (only those that write, when writers
// is set) is being unpublished: that allocation is stopping, and its
// teardown, retried in the background when it failed, ends its use of
// the volume by itself. The caller holds m.mu.
func (m *Manager) leavingLocked(taskID string, others []taskRef, writers bool) bool {
	alloc := allocOf(taskID)
	for _, ref := range others {
		t := m.tasks[ref.taskID][ref.name]
		if allocOf(ref.taskID) == alloc || (writers && t.ReadOnly) {
			continue
		}
		if t.State != phaseUnpublishing {
			return false
		}
	}
	return true
}

// unpublishingConflict is the refusal of a volume that another
// allocation's task, ref, is still unpublishing (leavingLocked): it passes
// once that is done (ErrUnsettled).
func unpublishingConflict(req VolumeRequest, volumeID, mode string, ref taskRef) error {
	return &conflictError{msg: fmt.Sprintf("volume %q: volume_id %q is %s and task %q%s, which had it published on this node, is still unpublishing it (a failed unpublish is retried in the background): wait for that to finish and start the task again",
		req.Name, volumeID, mode, ref.taskID, ofAlloc(ref.taskID)), unsettled: true}
}

// checkAllocShareLocked refuses a task a single-node-writer volume that
// others use, unless they are all tasks of its allocation holding the
// one publish it can share (allocShare). Nomad claims a volume per
// allocation, and every task of the allocation mounts the claim; the CSI
// spec publishes a SINGLE_NODE_WRITER volume once on a node, so the
// tasks share that publish, with the same capability. The caller holds
// m.mu.
func (m *Manager) checkAllocShareLocked(taskID string, req VolumeRequest, volumeID string, others []taskRef) error {
	// The holder named is one that writes, if the other allocation has
	// one: its readers share the publish with it.
	ref, ok := m.otherAllocationLocked(taskID, others, true)
	has := "already has it published writable on this node"
	if !ok {
		ref, ok = m.otherAllocationLocked(taskID, others, false)
		has = "already has it published on this node (read-only in that task; the one publish serves that task's allocation)"
	}
	if ok && m.leavingLocked(taskID, others, false) {
		return unpublishingConflict(req, volumeID, "single-node-writer", ref)
	}
	if ok {
		return &conflictError{msg: fmt.Sprintf("volume %q: volume_id %q is single-node-writer and task %q%s %s: stop that allocation first (its tasks share the volume), or use a multi-node access mode",
			req.Name, volumeID, ref.taskID, ofAlloc(ref.taskID), has)}
	}
	// Whether the publish can be shared yet is for the setup to see,
	// under the volume's lock: another task of the allocation may be
	// publishing it meanwhile (Nomad starts a group's tasks together).
	holder := m.tasks[others[0].taskID][others[0].name]
	if !slices.Equal(holder.MountFlags, req.MountFlags) {
		return &conflictError{msg: fmt.Sprintf("volume %q: volume_id %q is single-node-writer and published once on this node for the tasks of an allocation, and task %q of this allocation uses it with other mount_flags: use the same mount_options.mount_flags in every task of the allocation",
			req.Name, volumeID, holder.TaskID)}
	}
	// A plugin with VOLUME_MOUNT_GROUP made the volume writable by the
	// group it was staged and published with (the publishing task's):
	// a task of another group sharing that publish would get none of its
	// own, which only its own publish could send.
	if v, ok := m.vols[volKey{req.PluginID, volumeID}]; ok && req.MountGroup != "" && v.MountGroup != req.MountGroup {
		return &conflictError{msg: fmt.Sprintf("volume %q: volume_id %q is single-node-writer and published once on this node for the tasks of an allocation, by CSI plugin %q %s; this task runs as group %s, which the plugin applies only when it publishes: run the tasks of the allocation that use the volume with the same group",
			req.Name, volumeID, req.PluginID, groupOrNone(v.MountGroup), req.MountGroup)}
	}
	return nil
}

// groupOrNone words the volume_mount_group a volume was published with
// for a message.
func groupOrNone(g string) string {
	if g == "" {
		return "with no group (for a task running as root)"
	}
	return "for group " + g
}

// allocShare returns the published record of volume k that a task of
// taskID's allocation holds under another name than taskID's name (another
// task, or another block of the task), whose publish the block can share:
// a single-node-writer volume is published once for the tasks of an
// allocation, and once for two blocks of a task naming it. Every task sharing it has a record of its own naming the
// same target; the target is unpublished with the last of them
// (sharedTarget).
func (m *Manager) allocShare(taskID, name string, k volKey) (taskRecord, bool) {
	alloc := allocOf(taskID)
	return m.otherRecord(k, taskRef{taskID, name}, func(t taskRecord) bool {
		return allocOf(t.TaskID) == alloc && t.AccessMode == AccessSingleNodeWriter && t.State == phasePublished
	})
}

// otherRecord returns the first record of volume k other than self's
// (another task, or another block of self's task) that match accepts.
func (m *Manager) otherRecord(k volKey, self taskRef, match func(taskRecord) bool) (taskRecord, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, ref := range m.byVolume[k] {
		if t, ok := m.tasks[ref.taskID][ref.name]; ok && ref != self && match(t) {
			return t, true
		}
	}
	return taskRecord{}, false
}

// publishReadOnly reports whether the publish a task record names is
// read-only (NodePublishVolume's readonly). The record's ReadOnly is the
// task's view: its bind of the publish (Published.ReadOnly). The two are
// one but for single-node-writer, whose one publish on the node serves
// every task of the allocation (allocShare): it is read/write whichever
// task makes it, again or first, so that a writer sharing a reader's
// publish can write, and a task with read_only = true binds it read-only.
// Records written before read_only was allowed with single-node-writer
// never had both, and read as before.
func publishReadOnly(tr taskRecord) bool {
	return tr.ReadOnly && tr.AccessMode != AccessSingleNodeWriter
}

// sharedTarget reports whether a record other than tr names tr's
// target: the publish serves another task of the allocation still, and
// is not unpublished with tr.
func (m *Manager) sharedTarget(tr taskRecord) bool {
	_, ok := m.otherRecord(tr.key(), taskRef{tr.TaskID, tr.Name}, func(t taskRecord) bool { return t.Target == tr.Target })
	return ok
}

// ofAlloc words the allocation of a task ID for a message: ` of allocation
// "x"`, or nothing when the ID names none.
func ofAlloc(taskID string) string {
	if alloc, _, _, ok := SplitTaskID(taskID); ok {
		return fmt.Sprintf(" of allocation %q", alloc)
	}
	return ""
}

// groupFirst orders the records of a volume whose publish is made again
// (recovery, repair) so that, of the tasks of an allocation sharing one
// publish, one that runs as a group comes before one that runs as root:
// the publish is made once, for the first record of its target, and is
// then made with the group (sent to a plugin with VOLUME_MOUNT_GROUP, or
// given by the driver), as the task of that group needs it; a task
// running as root needs none. The order is otherwise kept.
func groupFirst(recs []taskRecord) {
	slices.SortStableFunc(recs, func(a, b taskRecord) int {
		ga, gb := effectiveGroup(a.MountGroup, a.ApplyGroup) != "", effectiveGroup(b.MountGroup, b.ApplyGroup) != ""
		switch {
		case ga && !gb:
			return -1
		case gb && !ga:
			return 1
		}
		return 0
	})
}
