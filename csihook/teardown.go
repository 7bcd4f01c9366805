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
	"strings"
	"syscall"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// Teardown, the reverse of Setup: each task volume is unpublished
// (unpublishLocked); a volume no other task uses any more is unstaged and
// detached (releaseLocked). What fails for a reason that may pass is
// retried in the background; what was dropped from the task's records but
// not released is kept in unreleased until a retry releases it.

// Teardown unpublishes every volume of the task, then unstages and
// detaches those no other task on this node uses, in the reverse order of
// Setup. A task without volumes is success. When a step fails for a reason
// that may pass (the plugin is down, busy or slow), the rest is retried in
// the background until it succeeds, reported through Events, and the
// returned error says so.
func (m *Manager) Teardown(ctx context.Context, taskID string) error {
	err := m.teardownTask(ctx, taskID)
	if err == nil {
		return nil
	}
	if permanent(err) {
		m.event(taskID, fmt.Sprintf("%s: not retrying; the journal keeps the volume for the next driver start", summary(err)), nil)
		return fmt.Errorf("failed to tear down the volumes of task %q: %w", taskID, err)
	}
	m.scheduleTeardown(taskID, err)
	return fmt.Errorf("failed to tear down the volumes of task %q, retrying in the background: %w", taskID, err)
}

// teardownTask unpublishes the task's volumes and releases those nobody
// else uses, then tries again the releases that failed in an earlier
// attempt after the task's record was gone.
func (m *Manager) teardownTask(ctx context.Context, taskID string) error {
	var errs []error
	earlier := m.unreleasedOf(taskID)
	for _, tr := range m.taskRecs(taskID) {
		if err := m.teardownVolume(ctx, tr.TaskID, tr.Name); err != nil {
			errs = append(errs, err)
		}
	}
	for k, name := range earlier {
		if err := m.releaseAgain(ctx, taskID, name, k); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		m.removeIfEmpty(m.taskDir(taskID))
	}
	return errors.Join(errs...)
}

func (m *Manager) teardownVolume(ctx context.Context, taskID, name string) error {
	tr, ok := m.taskRec(taskID, name)
	if !ok {
		return nil
	}
	unlock, err := m.locks.lock(ctx, tr.key().String())
	if err != nil {
		return lockWaitError(name, tr.VolumeID, tr.PluginID, err)
	}
	defer unlock()
	if tr, ok = m.taskRec(taskID, name); !ok {
		return nil
	}
	drop, unpublished, err := m.unpublishLocked(ctx, tr)
	if err != nil {
		return err
	}
	steps, err := m.releaseLocked(ctx, taskID, name, tr.key(), drop)
	steps.unpublished = unpublished
	// Done or not, the task hears what was done: a step that failed
	// has its own event, and the retry tells what it does.
	m.tornDown(taskID, name, tr.PluginID, tr.VolumeID, steps)
	if err != nil {
		if _, ok := m.taskRec(taskID, name); !ok {
			// The drop went out with the volume's "unstaging" or
			// "unpublishing": remember the volume for the retry.
			m.setUnreleased(taskID, tr.key(), name)
		}
		return err
	}
	return nil
}

// keptStaged reports whether the volume stays staged for the tasks that
// still use it, as a teardown beside them tells: not one whose last stage
// the plugin refused, which holds no stage it told of.
func (v volRecord) keptStaged() bool {
	return v.Stage != phaseNone && v.Stage != phaseStageRefused
}

// tornSteps are the calls one volume's teardown made, told in one event
// when it is done: an event is a write to Nomad's state and a sync to its
// servers, and a node stopping hundreds of tasks at once pays for each.
// A step that fails has an event of its own (OpError.Event), with the
// retry's.
type tornSteps struct {
	unpublished, unstaged, detached bool
	// kept: other tasks on this node still use the volume, so it stays
	// staged.
	kept bool
}

// message is the event of a finished teardown, "" when it called nothing.
func (s tornSteps) message(name string) string {
	var done []string
	for _, st := range []struct {
		did  bool
		verb string
	}{{s.unpublished, "unpublished"}, {s.unstaged, "unstaged"}, {s.detached, "detached"}} {
		if st.did {
			done = append(done, st.verb)
		}
	}
	if len(done) == 0 {
		return ""
	}
	verbs := done[0]
	if n := len(done); n > 1 {
		verbs = strings.Join(done[:n-1], ", ") + " and " + done[n-1]
	}
	msg := fmt.Sprintf("%s volume %q", strings.ToUpper(verbs[:1])+verbs[1:], name)
	if s.kept {
		msg += "; it stays staged for other tasks on this node"
	}
	return msg
}

// tornDown sends the one event of a volume's finished teardown.
func (m *Manager) tornDown(taskID, name, pluginID, volumeID string, s tornSteps) {
	if msg := s.message(name); msg != "" {
		m.event(taskID, msg, annotations(name, pluginID, volumeID))
	}
}

// releaseAgain retries the release of a volume a task no longer has a
// record of. Nothing is called when another task uses the volume by now
// or its record is gone.
func (m *Manager) releaseAgain(ctx context.Context, taskID, name string, k volKey) error {
	unlock, err := m.locks.lock(ctx, k.String())
	if err != nil {
		return lockWaitError(name, k.volume, k.plugin, err)
	}
	defer unlock()
	steps, err := m.releaseLocked(ctx, taskID, name, k, nil)
	m.tornDown(taskID, name, k.plugin, k.volume, steps)
	if err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.unreleased[taskID], k)
	if len(m.unreleased[taskID]) == 0 {
		delete(m.unreleased, taskID)
	}
	return nil
}

func (m *Manager) setUnreleased(taskID string, k volKey, name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.unreleased[taskID] == nil {
		m.unreleased[taskID] = map[volKey]string{}
	}
	m.unreleased[taskID][k] = name
}

func (m *Manager) unreleasedOf(taskID string) map[volKey]string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.unreleased[taskID])
}

// unpublishLocked unpublishes one task volume and returns the drop of its
// record, not written yet: it goes out with the next record of the volume
// or on its own (see releaseLocked). Until then the unpublish counts as
// uncertain and the task as a user of the volume. called says whether
// NodeUnpublishVolume was called (not for a volume never published). The
// caller holds the volume's lock.
func (m *Manager) unpublishLocked(ctx context.Context, tr taskRecord) (drop []journalOp, called bool, err error) {
	if m.sharedTarget(tr) {
		// Another task of the allocation uses the same publish (a
		// single-node-writer volume, see allocShare): it stays until the
		// last of them is gone. The drop alone is the task's release.
		m.logger.Info("volume publish kept for other tasks of the allocation", "task_id", tr.TaskID, "volume", tr.Name,
			"plugin_id", tr.PluginID, "volume_id", tr.VolumeID, "target_path", tr.Target)
		return []journalOp{taskDrop(tr.TaskID, tr.Name)}, false, nil
	}
	if tr.State != phasePending && !tr.notCalled {
		o := op{method: MethodNodeUnpublishVolume, taskID: tr.TaskID, name: tr.Name, pluginID: tr.PluginID,
			volumeID: tr.VolumeID, path: tr.Target, notFoundOK: true, secrets: []map[string]string{tr.Secrets}}
		if tr.State != phaseUnpublishing {
			tr.State = phaseUnpublishing
			if err := m.commit(taskPut(tr)); err != nil {
				return nil, false, err
			}
		}
		_, node, _, err := m.pluginClients(o)
		if err != nil {
			return nil, false, err
		}
		err = m.call(ctx, o, func(ctx context.Context) error {
			_, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: tr.VolumeID, TargetPath: tr.Target})
			return err
		})
		if err != nil {
			return nil, false, err
		}
		if err := m.checkGone(o, tr.Target); err != nil {
			return nil, false, err
		}
		m.logger.Info("volume unpublished", "task_id", tr.TaskID, "volume", tr.Name, "plugin_id", tr.PluginID,
			"volume_id", tr.VolumeID, "target_path", tr.Target)
		called = true
		if dir := filepath.Dir(tr.Target); dir != m.taskDir(tr.TaskID) {
			// The publish directory of the allocation's task that
			// published it first, gone before it.
			m.removeIfEmpty(dir)
		}
	}
	return []journalOp{taskDrop(tr.TaskID, tr.Name)}, called, nil
}

// releaseLocked unstages and detaches a volume when no task on this node
// uses it any more, and drops its record. pending are task record drops
// not written yet: they go out with the record before the first call, or
// on their own, and the tasks they drop no longer count as users. The
// result of a call is written with the record of the next call. The
// caller holds the volume's lock. It returns the calls it made, for the
// teardown's event.
func (m *Manager) releaseLocked(ctx context.Context, taskID, name string, k volKey, pending []journalOp) (tornSteps, error) {
	var steps tornSteps
	vol, ok := m.vol(k)
	if !ok || m.usersAfter(k, pending) > 0 {
		steps.kept = ok && vol.keptStaged()
		return steps, m.commitLazy(pending...)
	}
	o := op{taskID: taskID, name: name, pluginID: vol.PluginID, volumeID: vol.VolumeID, nodeID: vol.NodeID,
		notFoundOK: true, secrets: []map[string]string{vol.Secrets}}
	if vol.Stage != phaseNone {
		o.method, o.path = MethodNodeUnstageVolume, vol.StagingPath
		if vol.Stage != phaseUnstaging {
			vol.Stage = phaseUnstaging
			pending = append(pending, volPut(vol))
		}
		if err := m.commit(pending...); err != nil {
			return steps, err
		}
		pending = nil
		_, node, _, err := m.pluginClients(o)
		if err != nil {
			return steps, err
		}
		err = m.call(ctx, o, func(ctx context.Context) error {
			_, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.VolumeID, StagingTargetPath: vol.StagingPath})
			return err
		})
		if err != nil {
			return steps, err
		}
		if err := m.checkGone(o, vol.StagingPath); err != nil {
			return steps, err
		}
		vol.Stage = phaseNone
		pending = append(pending, volPut(vol))
		steps.unstaged = true
	}
	if vol.Controller != phaseNone {
		o.method, o.path = MethodControllerUnpublishVolume, ""
		if vol.NodeID == "" {
			// An empty node id would detach the volume from every node.
			m.logger.Warn("not detaching volume without a node id", "plugin_id", vol.PluginID, "volume_id", vol.VolumeID)
		} else {
			if vol.Controller != phaseUnpublishing {
				vol.Controller = phaseUnpublishing
				pending = append(pending, volPut(vol))
			}
			if err := m.commit(pending...); err != nil {
				return steps, err
			}
			pending = nil
			_, _, ctrl, err := m.pluginClients(o)
			if err != nil {
				return steps, err
			}
			err = m.call(ctx, o, func(ctx context.Context) error {
				_, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{
					VolumeId: vol.VolumeID, NodeId: vol.NodeID, Secrets: vol.Secrets,
				})
				return err
			})
			if err != nil {
				return steps, err
			}
			steps.detached = true
		}
	}
	if err := m.commitLazy(append(pending, volDrop(k))...); err != nil {
		return steps, err
	}
	m.setVerified(k, false)
	m.setExpandHeld(k, false)
	m.removeIfEmpty(filepath.Dir(vol.StagingPath))
	m.logger.Info("volume released on this node", "task_id", taskID, "plugin_id", vol.PluginID, "volume_id", vol.VolumeID)
	return steps, nil
}

// checkGone makes sure the plugin really took its mount away from path
// after it said so, then removes what the plugin left of path when it is
// empty. A path still mounted is an Internal failure, retried like others.
func (m *Manager) checkGone(o op, path string) error {
	mounted, err := m.mountedAt(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, syscall.ENOTDIR) {
		// A path the check cannot read is not taken for gone. A dead mount
		// (a FUSE daemon gone: ENOTCONN) that the plugin left after saying
		// it was done is detached: nothing can reach it any more. Anything
		// else keeps the records, tried again, rather than forgetting a
		// volume that may still be mounted.
		dead, serr := m.stale(path)
		if serr != nil || !dead {
			if serr != nil {
				err = errors.Join(err, serr)
			}
			return o.internal(fmt.Sprintf("the plugin reported success but whether %q is still mounted cannot be told: %v", path, err),
				hint(o.method, codes.Internal, o.volumeID, o.pluginID, ""))
		}
		if derr := m.cfg.Mounter.DetachLazy(path); derr != nil {
			return o.internal(fmt.Sprintf("the plugin reported success but left a dead mount at %q: %v", path, derr),
				hint(o.method, codes.Internal, o.volumeID, o.pluginID, ""))
		}
		m.logger.Warn("detached a dead mount the plugin left after reporting success", "method", o.method,
			"plugin_id", o.pluginID, "volume_id", o.volumeID, "path", path, "error", err)
		mounted, err = false, nil
	}
	if err == nil && mounted {
		return o.internal(fmt.Sprintf("the plugin reported success but %q is still mounted", path),
			hint(o.method, codes.Internal, o.volumeID, o.pluginID, ""))
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		m.logger.Warn("left a path the plugin did not remove", "path", path, "error", err)
	}
	return nil
}

// mountedAt is Mounter.IsMountPoint of path, except that a symbolic link
// the plugin left there is never followed: whatever it names (a dead mount
// elsewhere, a loop, "/") says nothing of path, and only a mount listed at
// path itself by name would keep it.
func (m *Manager) mountedAt(path string) (bool, error) {
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
		return m.cfg.Mounter.IsMountPoint(path)
	}
	table, err := m.cfg.Mounter.List()
	if err != nil {
		return false, err
	}
	clean := filepath.Clean(path)
	return slices.ContainsFunc(table, func(mp mounter.MountPoint) bool { return mp.Path == clean }), nil
}
