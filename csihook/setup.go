package csihook

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// Setup, in the order a volume goes: preflight checks every request of the
// task (plugin capabilities, sizes, the sharing rules of share.go, the
// node's volume limit) before any call; each
// volume is then created or resolved by name, controller-published and
// staged once per node (ensureVolume), and published for the task
// (ensurePublished), each step journalled before and after its call.

// Setup makes every requested volume available for the task and returns
// the host paths to bind into it, in request order. It is all or nothing:
// on failure the volumes it set up are torn down again (in the background
// if the plugin does not let that finish). Calling it again for a task
// already set up returns the same paths without calling the plugins.
func (m *Manager) Setup(ctx context.Context, taskID string, reqs []VolumeRequest) ([]Published, error) {
	if taskID == "" {
		return nil, invalidf("task id must not be empty")
	}
	if err := validate(reqs); err != nil {
		return nil, err
	}
	m.awaitPlugins(ctx, taskID, reqs)
	plans, err := m.preflight(taskID, reqs)
	if err != nil {
		return nil, err
	}
	// The volumes counted against max_volumes_per_node stay reserved
	// until this setup ends: by then they are in the journal, or gone.
	defer m.releaseReserved(plans)
	out := make([]Published, 0, len(plans))
	for _, p := range plans {
		pub, err := m.setupVolume(ctx, taskID, p)
		if err == nil {
			out = append(out, pub)
			continue
		}
		var oe *OpError
		if errors.As(err, &oe) {
			m.event(taskID, oe.Event(), annotations(p.req.Name, p.req.PluginID, oe.VolumeID))
		} else {
			m.event(taskID, fmt.Sprintf("Setting up volume %q failed: %v", p.req.Name, err), annotations(p.req.Name, p.req.PluginID, p.req.VolumeID))
		}
		rctx, cancel := m.rollbackContext(ctx)
		rbErr := m.teardownTask(rctx, taskID)
		cancel()
		if rbErr != nil {
			m.scheduleTeardown(taskID, rbErr)
			return nil, fmt.Errorf("%w (undoing the task's other volumes failed and is retried in the background: %v)", err, rbErr)
		}
		return nil, err
	}
	return out, nil
}

// sameVolumeTwice refuses req when another block of the task, in seen,
// resolves to the plugin's same volume id under another volume_id (one
// created here, named once by the name it was created with and once by the
// id the plugin answered), on the terms validate holds one volume named
// twice to.
func sameVolumeTwice(seen map[volKey]VolumeRequest, req VolumeRequest, id string) error {
	k := volKey{req.PluginID, id}
	first, ok := seen[k]
	if !ok {
		seen[k] = req
		return nil
	}
	if first.VolumeID == req.VolumeID {
		// The same name twice: validate's.
		return nil
	}
	if first.AccessMode != req.AccessMode || attachment(first) != attachment(req) || first.FSType != req.FSType || req.AccessMode == AccessSingleNodeWriter {
		return invalidf("volume %s: volume_id %s of plugin %q is also volume %s (volume_id %s): both are the plugin's volume %q, created on this node; name it one way, in one volume block",
			Quoted(req.Name), Quoted(req.VolumeID), req.PluginID, Quoted(first.Name), Quoted(first.VolumeID), id)
	}
	return nil
}

// preflight looks up every plugin and checks capabilities and sharing
// before anything is written or called, so that a request that cannot
// work leaves nothing behind.
func (m *Manager) preflight(taskID string, reqs []VolumeRequest) ([]plan, error) {
	var (
		errs  []error
		plans []plan
	)
	// The task's blocks by the plugin's id they resolve to: a volume this
	// node created is also named by the id the plugin answered, which
	// validate, going by names, cannot see.
	byID := map[volKey]VolumeRequest{}
	for i, req := range reqs {
		info, err := m.lookupHealthy(req.PluginID)
		if err != nil {
			errs = append(errs, fmt.Errorf("volume %q: %w", req.Name, err))
			continue
		}
		if info.ControllerOnly {
			errs = append(errs, invalidf("volume %q: CSI plugin %q is a controller plugin: it does not run the CSI Node service, so it cannot stage or publish volumes; set plugin_id to a plugin of type node or monolith",
				req.Name, req.PluginID))
			continue
		}
		req = withMountGroup(req, info)
		if attachment(req) == AttachmentBlockDevice && !info.Block {
			errs = append(errs, invalidf("volume %q: CSI plugin %q does not serve attachment_mode = %q: use %q or another plugin",
				req.Name, req.PluginID, AttachmentBlockDevice, AttachmentFileSystem))
		}
		if req.Create != nil && !info.CreateDelete {
			errs = append(errs, invalidf("volume %q: CSI plugin %q cannot create volumes (no CREATE_DELETE_VOLUME capability): remove the create block and create volume %q another way",
				req.Name, req.PluginID, req.VolumeID))
		} else if _, err := m.resizeOf(req, info); err != nil {
			errs = append(errs, err)
		}
		id, _ := m.resolve(req)
		nsErr := m.checkNamespace(req, id)
		if nsErr != nil {
			errs = append(errs, nsErr)
		}
		if err := sameVolumeTwice(byID, req, id); err != nil {
			errs = append(errs, err)
		}
		// Another namespace's volume is refused for that alone: how it
		// is shared is its owner's, and would name the owner's task.
		if nsErr == nil {
			if err := m.checkShare(taskID, req, id); err != nil {
				errs = append(errs, err)
			}
		}
		plans = append(plans, plan{seq: i, req: req, info: info})
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if err := m.checkVolumeLimit(plans); err != nil {
		return nil, err
	}
	return plans, nil
}

func (m *Manager) setupVolume(ctx context.Context, taskID string, p plan) (Published, error) {
	req, info := p.req, p.info
	o := op{taskID: taskID, name: req.Name, pluginID: req.PluginID, volumeID: req.VolumeID,
		nodeID: info.NodeID, secrets: []map[string]string{req.Secrets}}
	volumeID, vctx := m.resolve(req)
	// Preflight refused what cannot be done; a task that grew the volume
	// since can make this request a shrink, refused the same way.
	grow, err := m.resizeOf(req, info)
	if err != nil {
		return Published{}, err
	}
	if req.Create != nil && !grow {
		if volumeID, vctx, err = m.create(ctx, taskID, req, info, o); err != nil {
			return Published{}, err
		}
		o.volumeID = volumeID
	}
	k := volKey{req.PluginID, volumeID}
	// A volume nobody holds is taken without waiting, whatever the
	// context says: the wait below, with the lock free and the context
	// ended (the task's earlier volumes spent the setup's time), would
	// take either by chance, and tell of another operation on the volume
	// that nobody runs.
	unlock, free := m.locks.tryLock(k.String())
	if !free {
		unlock, err = m.locks.lock(ctx, k.String())
	}
	if err != nil {
		return Published{}, lockWaitError(req.Name, volumeID, req.PluginID, err)
	}
	defer unlock()
	if err := ctx.Err(); err != nil {
		what := "ran out of time"
		if !errors.Is(err, context.DeadlineExceeded) {
			what = "was canceled"
		}
		return Published{}, fmt.Errorf("the setup %s before volume %q (volume_id %q, plugin %q) was set up: %w",
			what, req.Name, volumeID, req.PluginID, err)
	}
	// Checked again under the volume's lock: a task of another namespace
	// may have claimed the volume since preflight.
	if err := m.checkNamespace(req, volumeID); err != nil {
		return Published{}, err
	}
	if err := m.checkShare(taskID, req, volumeID); err != nil {
		return Published{}, err
	}
	if grow {
		if err := m.expandController(ctx, taskID, req, info, o, volumeID); err != nil {
			return Published{}, err
		}
	}

	target := m.TargetPath(taskID, req.Name)
	tr, ok := m.taskRec(taskID, req.Name)
	if ok && tr.key() != k {
		return Published{}, invalidf("volume %q: task %q already uses this name for volume_id %q", req.Name, taskID, tr.VolumeID)
	}
	// A single-node-writer volume another task of the allocation uses is
	// that task's publish, shared (checkShare let only the allocation's
	// tasks be users).
	var holder taskRecord
	if ok {
		target = tr.Target
	} else if req.AccessMode == AccessSingleNodeWriter && m.users(k) > 0 {
		h, found := m.allocShare(taskID, req.Name, k)
		if !found {
			return Published{}, &conflictError{msg: fmt.Sprintf("volume %q: volume_id %q is single-node-writer and is being published or unpublished on this node for another task of this allocation: wait for that to finish and start the task again",
				req.Name, volumeID), unsettled: true}
		}
		// The context goes with NodePublishVolume, which the sharing
		// task does not make: another one would be silently the first
		// task's.
		if !maps.Equal(h.VolumeContext, vctx) {
			return Published{}, &conflictError{msg: fmt.Sprintf("volume %q: volume_id %q is single-node-writer and published once on this node for the tasks of an allocation, and task %q of this allocation uses it with another context: use the same context in every task of the allocation",
				req.Name, volumeID, h.TaskID)}
		}
		holder, target = h, h.Target
	}
	pub := Published{Name: req.Name, HostPath: target, Destination: req.Destination,
		ReadOnly: req.ReadOnly || !writerMode(req.AccessMode), Block: attachment(req) == AttachmentBlockDevice}

	if ok && tr.State == phasePublished && m.published(tr) {
		m.logger.Debug("volume already published", "task_id", taskID, "volume", req.Name, "volume_id", volumeID, "target_path", target)
		return pub, nil
	}

	vol, ok := m.vol(k)
	if ok && m.users(k) == 0 && (vol.AccessMode != req.AccessMode || vol.AttachmentMode != attachment(req) || vol.FSType != req.FSType || vol.MountGroup != req.MountGroup) {
		// Left over with another capability and nobody using it: take it
		// down before staging it anew.
		steps, err := m.releaseLocked(ctx, taskID, req.Name, k, nil)
		if msg := steps.message(req.Name); msg != "" {
			m.event(taskID, msg+"; it was left staged with another access mode, attachment, file system or mount group, and is staged anew",
				annotations(req.Name, req.PluginID, volumeID))
		}
		if err != nil {
			return Published{}, err
		}
		ok = false
	}
	if ok && (len(vol.Secrets) == 0 || vol.Stage == phaseStageRefused) {
		// The log keeps secrets only while a call needs them: loaded
		// after a restart, a staged volume has none, and staging it
		// again takes the request's. A volume whose last stage the
		// plugin refused is staged with the request's too, not with
		// those this process still holds of the refused stage: they may
		// be what the plugin refused (an expired token, another job's
		// wrong one), and would keep the volume refused for every job
		// that uses it after.
		vol.Secrets = req.Secrets
	}
	// New records go out in one batch with the first record of a call,
	// before that call: nothing is called for the volume until then. A
	// namespace using a volume nobody owns claims it with its record, and
	// owns it once a publish succeeded (ensurePublished); a setup that
	// fails drops the record, and the claim with it (see ownerRecord).
	//
	// A record other tasks use (one written before namespaces claimed
	// volumes) outlives a failed setup: it is not claimed, and the
	// request's namespace owns the volume only once its publish
	// succeeded.
	var pending []journalOp
	claim := m.claimNamespace(req, volumeID)
	if ok && m.users(k) > 0 {
		claim = ""
	}
	if !ok {
		vol = volRecord{
			PluginID: req.PluginID, VolumeID: volumeID, StagingPath: m.StagingPath(req.PluginID, volumeID),
			AccessMode: req.AccessMode, AttachmentMode: attachment(req), FSType: req.FSType,
			MountFlags: req.MountFlags, VolumeContext: vctx, Secrets: req.Secrets, Server: info.Server,
			MountGroup: req.MountGroup, HadSecrets: len(req.Secrets) > 0, Namespace: claim,
		}
		pending = append(pending, volPut(vol))
	} else if (vol.Server == "" && info.Server != "") || claim != "" {
		// Recorded before servers were kept: what serves the id now set
		// it up as far as anyone can tell. Recorded before namespaces
		// claimed volumes: this one claims it.
		if vol.Server == "" {
			vol.Server = info.Server
		}
		if claim != "" {
			vol.Namespace = claim
		}
		pending = append(pending, volPut(vol))
	}
	if existing, ok := m.taskRec(taskID, req.Name); ok {
		tr = existing
	} else if holder.TaskID != "" && m.published(holder) {
		// Shared: the task's record names the publish, which it keeps
		// until the last task of the allocation using it is gone. No
		// call is made; the record is durable before the task binds it.
		tr = m.newTaskRecord(taskID, p, target, pub, vctx, volumeID)
		tr.State, tr.Unmounted = phasePublished, holder.Unmounted
		if err := m.commit(append(pending, taskPut(tr))...); err != nil {
			return Published{}, err
		}
		// What the task's own publish would have done for its group
		// (ensurePublished), the task that published it running as
		// another user.
		if tr.ApplyGroup != "" {
			if err := applyVolumeGroup(target, tr.ApplyGroup); err != nil {
				return Published{}, fmt.Errorf("volume %q: mount_group = true: %w", tr.Name, err)
			}
		}
		with := fmt.Sprintf("task %q of this allocation", holder.TaskID)
		if holder.TaskID == taskID {
			with = fmt.Sprintf("volume %q of this task", holder.Name)
		}
		m.event(taskID, fmt.Sprintf("Published volume %q at %s, sharing its publish for %s", req.Name, req.Destination, with),
			annotations(req.Name, req.PluginID, volumeID))
		if err := m.expandNode(ctx, taskID, req, info, o, vol, tr); err != nil {
			return Published{}, err
		}
		return pub, nil
	} else {
		tr = m.newTaskRecord(taskID, p, target, pub, vctx, volumeID)
		// The intent to publish goes out with the volume's first
		// record, so that no commit waits between the calls.
		tr.State, tr.notCalled = phasePublishing, true
		// Once written the task counts as a user: nobody unstages under
		// it.
		pending = append(pending, taskPut(tr))
	}
	// The directory the volume is published in is made while the calls
	// before NodePublishVolume run (the CO makes it, CSI spec), once the
	// task's record is in the journal.
	parent := &dirAhead{m: m, dir: filepath.Dir(target)}
	defer parent.settle()
	if vol, pending, err = m.ensureVolume(ctx, taskID, req.Name, info, vol, false, pending, parent); err != nil {
		return Published{}, err
	}
	err = m.ensurePublished(ctx, info, vol, tr, req.Namespace, pending, parent)
	if m.notStaged(err, vol, tr) {
		// Staged again (idempotent for the plugin: the same path,
		// capability and secrets), then published once more.
		m.logger.Info("plugin says the volume is not staged; staging it again", "task_id", taskID, "plugin_id", vol.PluginID,
			"volume_id", vol.VolumeID, "staging_path", vol.StagingPath)
		if vol, pending, err = m.ensureVolume(ctx, taskID, req.Name, info, vol, true, nil, parent); err == nil {
			err = m.ensurePublished(ctx, info, vol, tr, req.Namespace, pending, parent)
		}
	}
	if err != nil {
		return Published{}, err
	}
	if err := m.expandNode(ctx, taskID, req, info, o, vol, tr); err != nil {
		return Published{}, err
	}
	return pub, nil
}

// newTaskRecord is the record of a task's volume published at target.
func (m *Manager) newTaskRecord(taskID string, p plan, target string, pub Published, vctx map[string]string, volumeID string) taskRecord {
	req := p.req
	return taskRecord{
		TaskID: taskID, Name: req.Name, Seq: p.seq, PluginID: req.PluginID, VolumeID: volumeID,
		Target: target, Destination: req.Destination, ReadOnly: pub.ReadOnly,
		AccessMode: req.AccessMode, AttachmentMode: attachment(req), FSType: req.FSType,
		MountFlags: req.MountFlags, VolumeContext: vctx, Secrets: req.Secrets, HadSecrets: len(req.Secrets) > 0,
		MountGroup: req.MountGroup, ApplyGroup: req.applyGroup,
		// The task's invocation file is flushed by this record's
		// commit.
		Invocation: true,
	}
}

// publishedAt reports whether a publish target is mounted, and no
// symbolic link.
func (m *Manager) publishedAt(target string) bool {
	if targetIsSymlink(target) {
		return false
	}
	mounted, err := m.cfg.Mounter.IsMountPoint(target)
	return err == nil && mounted
}

// published is publishedAt of tr's target; one its plugin published
// without a mount (Unmounted) only has to be there and no symbolic link,
// as RepairStale finds it alive.
func (m *Manager) published(tr taskRecord) bool {
	if !tr.Unmounted {
		return m.publishedAt(tr.Target)
	}
	dead, err := notMounted(m.cfg.Mounter, tr.Target, false)
	return err == nil && !dead
}

// create calls CreateVolume named after the request's volume id and returns
// the plugin's id and volume context (merged over the request's).
func (m *Manager) create(ctx context.Context, taskID string, req VolumeRequest, info PluginInfo, o op) (string, map[string]string, error) {
	o.method = MethodCreateVolume
	_, _, ctrl, err := m.pluginClients(o)
	if err != nil {
		return "", nil, err
	}
	m.event(taskID, fmt.Sprintf("Creating volume %q", req.Name), annotations(req.Name, req.PluginID, req.VolumeID))
	creq := &csi.CreateVolumeRequest{
		Name:               req.VolumeID,
		VolumeCapabilities: []*csi.VolumeCapability{capability(req.AccessMode, attachment(req), req.FSType, req.MountFlags)},
		Parameters:         maps.Clone(req.Create.Parameters),
		Secrets:            req.Secrets,
		// The node's topology, when the plugin has one (topology.go).
		AccessibilityRequirements: accessibility(info),
	}
	if req.Create.CapacityMin > 0 || req.Create.CapacityMax > 0 {
		creq.CapacityRange = &csi.CapacityRange{RequiredBytes: req.Create.CapacityMin, LimitBytes: req.Create.CapacityMax}
	}
	var resp *csi.CreateVolumeResponse
	err = m.call(ctx, o, func(ctx context.Context) error {
		var err error
		resp, err = ctrl.CreateVolume(ctx, creq)
		return err
	})
	if err != nil {
		return "", nil, err
	}
	id := resp.GetVolume().GetVolumeId()
	if id == "" {
		return "", nil, &OpError{Method: o.method, Volume: req.Name, VolumeID: req.VolumeID, PluginID: req.PluginID,
			Code: codes.Internal, Message: "the plugin answered without a volume id", Hint: hint(o.method, codes.Internal, req.VolumeID, req.PluginID, "")}
	}
	if n := len(id); n > MaxIDBytes {
		return "", nil, answerTooLarge(o, "volume_id", n, MaxIDBytes, "bytes")
	}
	if n := mapBytes(resp.GetVolume().GetVolumeContext()); n > MaxMapBytes {
		return "", nil, answerTooLarge(o, "volume_context", n, MaxMapBytes, "bytes of keys and values together")
	}
	vctx := maps.Clone(req.Context)
	if vctx == nil {
		vctx = map[string]string{}
	}
	maps.Copy(vctx, resp.GetVolume().GetVolumeContext())
	m.logger.Info("volume created", "task_id", taskID, "volume", req.Name, "plugin_id", req.PluginID, "volume_id", id)
	rec := createdRecord{PluginID: req.PluginID, Name: req.VolumeID, VolumeID: id, VolumeContext: resp.GetVolume().GetVolumeContext(),
		Requested: req.Create.CapacityMin, Capacity: resp.GetVolume().GetCapacityBytes()}
	// The namespace that created the volume owns it from now on, used or
	// not (unless another owns the id the plugin answered with, which
	// Setup then refuses).
	if err := m.journal.commit(append(m.claimOwner(req, id), createdPut(rec))...); err != nil {
		return "", nil, err
	}
	if err := m.checkAccessible(req, info, resp.GetVolume()); err != nil {
		return "", nil, err
	}
	return id, vctx, nil
}

// resolve returns the plugin's id and the volume context for a request:
// for a volume this node created under the request's volume_id, the id and
// context the plugin gave it (the request's context merged under the
// plugin's); otherwise the request's own.
func (m *Manager) resolve(req VolumeRequest) (string, map[string]string) {
	vctx := maps.Clone(req.Context)
	c, ok := m.journal.created(req.PluginID, req.VolumeID)
	if !ok {
		return req.VolumeID, vctx
	}
	if vctx == nil {
		vctx = map[string]string{}
	}
	maps.Copy(vctx, c.VolumeContext)
	return c.VolumeID, vctx
}

// ensureVolume brings a volume to controller-published (when the plugin
// needs it) and staged (when the plugin stages), journalling each step
// before and after its call. With restage, a staged volume is staged again
// (idempotent for the plugin) to repair a lost staging mount. The caller
// holds the volume's lock.
//
// pending are journal writes not made yet; they go out in one batch with
// the record of the first call, before it. The result of the last call is
// not written either: it is returned with pending (or pending itself when
// nothing was called), for the caller to write with its next record or on
// its own. Until then that call counts as uncertain, which recovery
// settles by calling again; nothing is lost but a repeated call.
//
// parent, when not nil, is the task's publish directory, started aside as
// soon as a commit here put pending (the task's record) in the journal.
func (m *Manager) ensureVolume(ctx context.Context, taskID, name string, info PluginInfo, vol volRecord, restage bool, pending []journalOp, parent *dirAhead) (volRecord, []journalOp, error) {
	o := op{taskID: taskID, name: name, pluginID: vol.PluginID, volumeID: vol.VolumeID, nodeID: vol.NodeID,
		secrets: []map[string]string{vol.Secrets}}
	ann := annotations(name, vol.PluginID, vol.VolumeID)
	vc := capability(vol.AccessMode, vol.AttachmentMode, vol.FSType, vol.MountFlags)
	stageVC := withGroup(capability(vol.AccessMode, vol.AttachmentMode, vol.FSType, vol.MountFlags), vol.MountGroup)
	needCtrl := info.ControllerPublish || vol.Controller != phaseNone
	needStage := info.StageUnstage || vol.Stage != phaseNone
	if vol.Stage == phaseStaged && !restage {
		if !m.stagingHeld(vol) {
			m.logger.Info("staging from before a restart not found mounted; staging again", "plugin_id", vol.PluginID,
				"volume_id", vol.VolumeID, "staging_path", vol.StagingPath)
			restage = true
		} else {
			m.setVerified(vol.key(), true)
		}
	}
	if (!needCtrl || vol.Controller == phasePublished) && (!needStage || (vol.Stage == phaseStaged && !restage)) {
		return vol, pending, nil
	}
	// The secrets the volume was attached with, which the
	// ControllerUnpublishVolume of its last teardown takes: a stage made
	// with others (a setup's or a repair's of a refused volume, see
	// setupVolume) that the plugin refuses leaves the record with these,
	// not with what was refused.
	var attachedWith map[string]string
	attached := false
	if cur, ok := m.vol(vol.key()); ok && cur.Controller == phasePublished && vol.Controller == phasePublished {
		attachedWith, attached = cur.Secrets, true
	}
	o.method = MethodNodeStageVolume
	info, node, ctrl, err := m.pluginClients(o)
	if err != nil {
		return vol, pending, err
	}

	if needCtrl && vol.Controller != phasePublished {
		if vol.NodeID == "" {
			vol.NodeID = info.NodeID
		}
		if vol.NodeID == "" {
			o.method = MethodNodeGetInfo
			err := m.call(ctx, o, func(ctx context.Context) error {
				resp, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
				vol.NodeID = resp.GetNodeId()
				return err
			})
			if err != nil {
				return vol, pending, err
			}
			if vol.NodeID == "" {
				return vol, pending, &OpError{Method: o.method, Volume: name, VolumeID: vol.VolumeID, PluginID: vol.PluginID,
					Code: codes.Internal, Message: "the plugin answered without a node id", Hint: hint(o.method, codes.Internal, vol.VolumeID, vol.PluginID, "")}
			}
		}
		o.nodeID = vol.NodeID
		vol.Controller = phasePublishing
		if err := m.commit(append(pending, volPut(vol))...); err != nil {
			return vol, nil, err
		}
		pending = nil
		parent.start()
		m.event(taskID, fmt.Sprintf("Attaching volume %q", name), ann)
		o.method = MethodControllerPublishVolume
		var pctx map[string]string
		err := m.call(ctx, o, func(ctx context.Context) error {
			resp, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
				VolumeId: vol.VolumeID, NodeId: vol.NodeID, VolumeCapability: vc,
				// "CO MUST set this field to false if SP does not have the
				// PUBLISH_READONLY controller capability" (CSI spec); the
				// node calls still publish a reader-only volume read-only.
				Readonly: info.PublishReadonly && !writerMode(vol.AccessMode), Secrets: vol.Secrets, VolumeContext: vol.VolumeContext,
			})
			pctx = resp.GetPublishContext()
			return err
		})
		if err != nil {
			return vol, nil, err
		}
		// Refused before it is kept; the record still says publishing,
		// so the rollback detaches the volume again.
		if n := mapBytes(pctx); n > MaxMapBytes {
			return vol, nil, answerTooLarge(o, "publish_context", n, MaxMapBytes, "bytes of keys and values together")
		}
		vol.PublishContext, vol.Controller = pctx, phasePublished
		attachedWith, attached = vol.Secrets, true
		pending = []journalOp{volPut(vol)}
	}

	if needStage && (vol.Stage != phaseStaged || restage) {
		// The CO makes the staging directory (CSI spec): beside the
		// record's commit, which does not need it. Should the host crash
		// in between, a record without its directory is a volume recovery
		// unstages (a no-op for the plugin), a directory without its
		// record an empty directory, as a crash before the commit always
		// left.
		made := m.makeDirAside(vol.StagingPath)
		was := vol.Stage
		vol.Stage = phaseStaging
		err := m.commit(append(pending, volPut(vol))...)
		if merr := made(); err == nil && merr != nil {
			// Committed, and never called: the volume's record goes back
			// to where it was, so that the caller's undo makes no call
			// for a stage that never was.
			err = fmt.Errorf("failed to create staging directory %q for volume %q: %w", vol.StagingPath, name, merr)
			vol.Stage = was
			if cerr := m.commit(volPut(vol)); cerr != nil {
				err = errors.Join(err, cerr)
			}
			return vol, nil, err
		}
		if err != nil {
			return vol, nil, err
		}
		pending = nil
		parent.start()
		m.event(taskID, fmt.Sprintf("Staging volume %q", name), ann)
		o.method, o.path = MethodNodeStageVolume, vol.StagingPath
		err = m.call(ctx, o, func(ctx context.Context) error {
			_, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
				VolumeId: vol.VolumeID, PublishContext: vol.PublishContext, StagingTargetPath: vol.StagingPath,
				VolumeCapability: stageVC, Secrets: vol.Secrets, VolumeContext: vol.VolumeContext,
			})
			return err
		})
		if err != nil && stageRefused(err) {
			// The plugin said no: it holds no stage it told of, and
			// nothing is re-issued for it (see phaseStageRefused). The
			// record says so at once, and the journal drops its
			// secrets (an attached volume's record keeps those it was
			// attached with, for its detach): left staging, it kept
			// them until the last teardown, and recovery staged again
			// with them what was refused. The volume's other tasks
			// keep their mounts, and the last teardown still unstages
			// it. An outcome the driver cannot know stays staging, for
			// recovery to settle.
			vol.Stage = phaseStageRefused
			if attached {
				vol.Secrets = attachedWith
			}
			m.setVerified(vol.key(), false)
			if cerr := m.commit(volPut(vol)); cerr != nil {
				err = errors.Join(err, cerr)
			}
		}
		if err != nil {
			return vol, nil, err
		}
		vol.Stage = phaseStaged
		pending = []journalOp{volPut(vol)}
		m.setVerified(vol.key(), true)
	}
	return vol, pending, nil
}

// stagingHeld reports whether a staged volume's staging path is known to
// be there: verified by this process, or a mount point now. ensureVolume
// stages again a staged volume for which it is not. A mount found here is
// not recorded as verified: the caller that goes on to use the volume at
// once does that (ensureVolume, reconcile just before it), so that a
// caller that stops before (a recovery waiting for its plugin) leaves no
// mark a later attempt would trust after the mount is gone. The caller
// holds the volume's lock.
func (m *Manager) stagingHeld(vol volRecord) bool {
	if m.isVerified(vol.key()) {
		return true
	}
	ok, err := m.cfg.Mounter.IsMountPoint(vol.StagingPath)
	return err == nil && ok
}

func (m *Manager) isVerified(k volKey) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.verified[k]
}

func (m *Manager) setVerified(k volKey, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if ok {
		m.verified[k] = true
	} else {
		delete(m.verified, k)
	}
}

// ensurePublished publishes a task's volume at its target, journalling
// before and after the call; pending go out with the record before it.
// namespace is the publishing task's ("" when not known): with the
// result, the volume's claim, or else namespace, becomes its owner when
// it has none. The caller holds the volume's lock.
//
// parent, when not nil, is the target's parent, made aside since the
// task's record went out (see dirAhead); nil makes it here.
func (m *Manager) ensurePublished(ctx context.Context, info PluginInfo, vol volRecord, tr taskRecord, namespace string, pending []journalOp, parent *dirAhead) error {
	o := op{method: MethodNodePublishVolume, taskID: tr.TaskID, name: tr.Name, pluginID: tr.PluginID,
		volumeID: tr.VolumeID, nodeID: vol.NodeID, path: tr.Target, secrets: []map[string]string{tr.Secrets}}
	_, node, _, err := m.pluginClients(o)
	if err != nil {
		return err
	}
	if parent == nil {
		parent = &dirAhead{m: m, dir: filepath.Dir(tr.Target)}
	}
	// The intent is durable already when it went out with the volume's
	// first record; the results before this call then go out with this
	// call's. The record comes before the directory: a crash never leaves
	// a directory the journal does not name.
	cur, ok := m.taskRec(tr.TaskID, tr.Name)
	committed := ok && cur.State == phasePublishing
	if committed {
		tr = cur
	} else {
		tr.State, tr.notCalled = phasePublishing, true
		if err := m.commit(append(pending, taskPut(tr))...); err != nil {
			return err
		}
		pending = nil
	}
	// The CO makes the parent; the plugin makes the target (CSI spec).
	if err := parent.made(); err != nil {
		return fmt.Errorf("failed to create the publish directory of volume %q: %w", tr.Name, err)
	}
	m.markCalled(tr.TaskID, tr.Name)
	tr.notCalled = false
	err = m.call(ctx, o, func(ctx context.Context) error {
		_, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: tr.VolumeID, PublishContext: vol.PublishContext, StagingTargetPath: vol.stagingTarget(),
			TargetPath: tr.Target, VolumeCapability: withGroup(capability(tr.AccessMode, tr.AttachmentMode, tr.FSType, tr.MountFlags), tr.MountGroup),
			Readonly: publishReadOnly(tr), Secrets: tr.Secrets, VolumeContext: tr.VolumeContext,
		})
		return err
	})
	if err != nil {
		return m.publishedElsewhere(err, tr)
	}
	// Creating target_path is the plugin's job (CSI spec); a plugin that
	// answers OK without it did not publish anything, and the task must
	// not start on an empty directory of ours.
	mounted, err := m.cfg.Mounter.IsMountPoint(tr.Target)
	if errors.Is(err, fs.ErrNotExist) {
		return o.internal(fmt.Sprintf("the plugin reported success but did not create the target path %q, which the CSI spec leaves to the plugin", tr.Target),
			fmt.Sprintf("plugin %q did not publish the volume on this node (a mock plugin does not); check the plugin's logs, "+
				"or use a plugin that mounts volumes at target_path", o.pluginID))
	}
	if targetIsSymlink(tr.Target) {
		return symlinkTargetError(o, tr.Target)
	}
	// A publish without a mount (a device node made there) is the
	// plugin's to make: what it is, not whether it is a mount, says it
	// is alive later (RepairStale).
	if err == nil && !mounted && tr.mustMount {
		// A repair: the target had a mount that died, and an empty
		// directory is no repair. Which kind a target is was decided at
		// its first publish (or a driver restart's), not here, so that a
		// plugin answering OK without mounting cannot leave a task on an
		// empty directory that is never checked again.
		return o.internal(fmt.Sprintf("the plugin reported success but left no mount at %q, where it had mounted the volume before", tr.Target),
			fmt.Sprintf("check plugin %q's logs: it published the volume again without mounting it", o.pluginID))
	}
	tr.Unmounted, tr.mustMount = err == nil && !mounted, false
	if tr.ApplyGroup != "" {
		if err := applyVolumeGroup(tr.Target, tr.ApplyGroup); err != nil {
			return fmt.Errorf("volume %q: mount_group = true: %w", tr.Name, err)
		}
	}
	tr.State = phasePublished
	// The volume is published: a namespace's claim of it becomes its
	// owner record, in the batch written anyway. Lazy is enough: the
	// claim is on disk since before the first call, and the teardown's
	// first commit, synced, comes before anything drops it. A volume
	// shared unclaimed (recorded before namespaces claimed volumes) is
	// owned by the namespace publishing it; a crash before this batch is
	// synced leaves it as unowned as it was.
	pending = append(pending, m.journal.confirmOwner(tr.key(), namespace)...)
	if err := m.commitLazy(append(pending, taskPut(tr))...); err != nil {
		return err
	}
	m.event(tr.TaskID, fmt.Sprintf("Published volume %q at %s", tr.Name, tr.Destination), annotations(tr.Name, tr.PluginID, tr.VolumeID))
	return nil
}

// publishedElsewhere words a FAILED_PRECONDITION answer to NodePublishVolume
// of a volume that another task (or another block of the task) of this
// node has published, where the CSI spec has a plugin refuse the second
// publish that way, to be waited out until the volume is unpublished:
//
//   - in a single-node access mode: the CO may publish a volume at more
//     than one target path of a node only in a MULTI_NODE_... (or
//     SINGLE_NODE_MULTI_WRITER) mode. Nomad shares a
//     single-node-reader-only volume between the allocations of a node,
//     as the driver does, and most plugins publish it again;
//   - with another volume capability (mount_flags: access mode, attachment
//     and file system are held equal by checkShare): "COs SHOULD NOT call
//     NodePublishVolume a second time with a different
//     volume_capability".
//
// The task hears which task holds the volume and what to change, instead
// of "see the plugin's logs".
func (m *Manager) publishedElsewhere(err error, tr taskRecord) error {
	var oe *OpError
	if !errors.As(err, &oe) || oe.Code != codes.FailedPrecondition {
		return err
	}
	holder, multi, found := m.publishHolder(tr)
	if !found {
		return err
	}
	what := fmt.Sprintf("task %q", holder.TaskID)
	stop := fmt.Sprintf("stop task %q first", holder.TaskID)
	if holder.TaskID == tr.TaskID {
		what = fmt.Sprintf("volume %q of this task", holder.Name)
		stop = "name the volume in one volume block of the task"
	}
	if multi {
		// The other task's flags are its own: not shown.
		oe.Hint = fmt.Sprintf("volume %q is published on this node for %s with other mount_flags, and plugin %q does not publish it again with another volume capability (CSI spec): "+
			"use the same mount_options.mount_flags as %s, or %s", tr.VolumeID, what, tr.PluginID, what, stop)
		return oe
	}
	instead := AccessMultiNodeReaderOnly
	if writerMode(tr.AccessMode) {
		instead = AccessMultiNodeMultiWriter
	}
	oe.Hint = fmt.Sprintf("volume %q is published on this node for %s already, and plugin %q publishes a volume of access_mode = %q at one path per node (CSI spec): "+
		"%s, or use access_mode = %q if the storage allows it", tr.VolumeID, what, tr.PluginID, tr.AccessMode, stop, instead)
	return oe
}

// publishHolder finds the task (or block) whose publish of tr's volume on
// this node explains a FAILED_PRECONDITION answer to tr's publish: any
// publish in a single-node access mode, one with other mount_flags in a
// MULTI_NODE_... mode. multi says which.
func (m *Manager) publishHolder(tr taskRecord) (holder taskRecord, multi, found bool) {
	switch tr.AccessMode {
	case AccessMultiNodeReaderOnly, AccessMultiNodeSingleWriter, AccessMultiNodeMultiWriter:
		multi = true
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, ref := range m.byVolume[tr.key()] {
		if ref == (taskRef{tr.TaskID, tr.Name}) {
			continue
		}
		t, ok := m.tasks[ref.taskID][ref.name]
		if ok && t.State == phasePublished && (!multi || !slices.Equal(t.MountFlags, tr.MountFlags)) {
			return t, multi, true
		}
	}
	return taskRecord{}, multi, false
}

// notStaged reports a FAILED_PRECONDITION answer to NodePublishVolume of
// a volume the driver staged, that no other publish on the node explains
// (publishHolder): the CSI spec's "Staging target path not set", whose
// recovery is NodeStageVolume before the publish is retried. A plugin
// restarted without what it kept of its stages answers so while the
// staging mount is still there.
func (m *Manager) notStaged(err error, vol volRecord, tr taskRecord) bool {
	var oe *OpError
	if !errors.As(err, &oe) || oe.Code != codes.FailedPrecondition || oe.Method != MethodNodePublishVolume || vol.Stage != phaseStaged {
		return false
	}
	_, _, held := m.publishHolder(tr)
	return !held
}

// targetIsSymlink reports whether a publish target is a symbolic link (not
// following it). The task's bind of its volume takes what the target path
// names, and a link there would take the task to whatever it points at on
// the host: a plugin that publishes by symlink (into a directory of a
// volume the job writes, say) would let the job choose. The CSI spec has
// the plugin publish at target_path; a link is not a publish.
func targetIsSymlink(target string) bool {
	fi, err := os.Lstat(target)
	return err == nil && fi.Mode()&fs.ModeSymlink != 0
}

func symlinkTargetError(o op, target string) error {
	return o.internal(fmt.Sprintf("the plugin left the target path %q a symbolic link, not a mount", target),
		fmt.Sprintf("a task's volume is what is mounted at target_path, and a symbolic link there could name any path on the host: "+
			"plugin %q must mount the volume at target_path (CSI spec); check the plugin's logs or use another plugin", o.pluginID))
}

// answerTooLarge refuses a plugin's answer larger than the driver keeps of
// a job's own fields (validate.go). What a plugin answers is kept as a job's
// fields are: in the journal (on disk and in memory, read back on every
// start; a created volume's record for good), repeated in every record of
// the volume and its tasks, and the volume id in events and logs. Any job
// can run a plugin, and gRPC lets 4 MiB through in an answer: a volume's
// records would have grown by megabytes each. The CSI spec allows 128
// bytes for an id and 4 KiB for a map, answers included.
func answerTooLarge(o op, field string, n, limit int, what string) error {
	return o.internal(fmt.Sprintf("%s answered a %s of %d %s: the driver keeps at most %d (%s)", o.method, field, n, what, limit, humanBytes(limit)),
		fmt.Sprintf("plugin %q broke the CSI spec's size limits (128 bytes for an id, 4 KiB for a map): fix or replace it", o.pluginID))
}
