package csihook

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math/rand/v2"
	"os"
	"sort"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// Repaired is one task volume whose dead mount was published again on the
// host: the driver attaches HostPath afresh at Destination inside the
// running task, whose own copy of the mount is still the dead one.
type Repaired struct {
	TaskID      string
	Name        string
	PluginID    string
	VolumeID    string
	HostPath    string
	Destination string
	ReadOnly    bool
}

// RepairStale finds the published volumes of pluginID ("" for every
// plugin) whose publish target or staging mount is dead (mounter Stale:
// ENOTCONN, ESTALE or EIO on a path the mount table lists, as a FUSE-backed
// plugin leaves behind when its daemon dies), or whose publish target is
// no mount any more (unmounted by the plugin or an operator), and sets
// them up again:
// NodeUnpublishVolume of every dead target, NodeUnstageVolume and
// NodeStageVolume when the staging mount is dead too, and
// NodePublishVolume again, journalled like Setup. A dead mount the plugin
// cannot take away is detached lazily (nothing can reach it any more). It
// returns the task volumes published again and an error joining the
// failures of the others, which the next call tries again. Healthy mounts
// are never touched; a plugin not healthy is not called (its volumes wait
// for the next call). A task volume whose repaired mount is dead again
// before a call found it alive waits before its next repair, longer at
// each relapse (holdRelapses); so does one whose repair the plugin
// refused, longer at each failure in a row (repairCallFailed).
func (m *Manager) RepairStale(ctx context.Context, pluginID string) ([]Repaired, error) {
	return m.repairStale(ctx, pluginID, false)
}

// repairStale is RepairStale; a retry (RepairStaleRetry after its first
// attempt) is not held back by the failed repairs of its own attempts.
func (m *Manager) repairStale(ctx context.Context, pluginID string, retry bool) ([]Repaired, error) {
	var (
		keys []volKey
		seen = map[volKey]bool{}
	)
	m.mu.Lock()
	// The plugins' returns this pass can deal with: those before it began.
	returns := maps.Clone(m.returned)
	for _, recs := range m.tasks {
		for _, tr := range recs {
			k := tr.key()
			if !m.repairCandidateLocked(tr) || seen[k] || (pluginID != "" && tr.PluginID != pluginID) {
				continue
			}
			seen[k] = true
			keys = append(keys, k)
		}
	}
	m.mu.Unlock()
	sort.Slice(keys, func(i, j int) bool { return keys[i].String() < keys[j].String() })

	var (
		out    []Repaired
		errs   []error
		failed = map[string]bool{}
	)
	for _, k := range keys {
		rep, err := m.repairVolume(ctx, k, retry)
		out = append(out, rep...)
		if err != nil {
			errs = append(errs, err)
			failed[k.plugin] = true
		}
	}
	// A plugin whose volumes this pass all found alive or repaired has
	// had its return dealt with: a mount of it found dead later did not
	// die with that restart. Not a return that came during the pass: the
	// pass may have found the plugin's volumes alive before it.
	m.mu.Lock()
	for p, n := range returns {
		if (pluginID == "" || p == pluginID) && !failed[p] && m.returned[p] == n {
			delete(m.returned, p)
		}
	}
	m.mu.Unlock()
	return out, errors.Join(errs...)
}

// RepairStaleRetry is RepairStale tried again, at most attempts times in
// all, with backoff between BackgroundRetryBase and BackgroundRetryMax,
// while some volume fails to be repaired: a plugin that just came back may
// answer Unavailable for a moment. The attempts after the first are not
// held back by the failures of the attempts before (holdRelapses). Every
// repaired volume of every attempt
// is returned; the error is the last attempt's. A plugin that is not
// healthy ends the retries at once.
func (m *Manager) RepairStaleRetry(ctx context.Context, pluginID string, attempts int) ([]Repaired, error) {
	var out []Repaired
	for i := 0; ; i++ {
		rep, err := m.repairStale(ctx, pluginID, i > 0)
		out = append(out, rep...)
		// A plugin not healthy is not waited for here: its return is
		// what starts the next repair.
		if err == nil || i+1 >= attempts || permanent(err) || errors.Is(err, ErrPluginNotFound) {
			return out, err
		}
		t := time.NewTimer(backoff(i, m.cfg.BackgroundRetryBase, m.cfg.BackgroundRetryMax, rand.Float64))
		select {
		case <-ctx.Done():
			t.Stop()
			return out, errors.Join(err, ctx.Err())
		case <-m.ctx.Done():
			t.Stop()
			return out, err
		case <-t.C:
		}
	}
}

// repairVolume repairs the dead mounts of one volume under its lock.
func (m *Manager) repairVolume(ctx context.Context, k volKey, retry bool) ([]Repaired, error) {
	// The volume's paths are checked before its lock, which its teardown
	// and setups wait for: each check may take up to staleCheckTimeout on
	// a hung mount. A path found alive is left alone in this pass (should
	// it die meanwhile, the next pass finds it); one found dead, or not
	// checked yet (published meanwhile), is checked again under the lock
	// before anything is done to it: another repair, or a new publish, may
	// have made it healthy since.
	alive, err := m.checkAhead(k)
	if err != nil {
		return nil, err
	}
	check := func(path string, publish, mount bool) (bool, error) {
		if alive[path] {
			return false, nil
		}
		return m.checkTarget(path, publish, mount)
	}
	unlock, err := m.locks.lock(ctx, k.String())
	if err != nil {
		return nil, fmt.Errorf("gave up waiting for another operation on volume_id %q (plugin %q) to finish: %w", k.volume, k.plugin, err)
	}
	defer unlock()
	vol, ok := m.vol(k)
	if !ok {
		return nil, nil
	}
	var recs []taskRecord
	m.mu.Lock()
	for _, byName := range m.tasks {
		for _, tr := range byName {
			if tr.key() == k && m.repairCandidateLocked(tr) {
				recs = append(recs, tr)
			}
		}
	}
	m.mu.Unlock()
	sort.Slice(recs, func(i, j int) bool { return recs[i].TaskID+recs[i].Name < recs[j].TaskID+recs[j].Name })

	stagingDead := false
	if vol.Stage == phaseStaged {
		if stagingDead, err = check(vol.StagingPath, false, false); err != nil {
			return nil, fmt.Errorf("failed to check the staging mount %q of volume_id %q: %w", vol.StagingPath, vol.VolumeID, err)
		}
	}
	var dead []taskRecord
	deadTarget := map[string]bool{}
	for _, tr := range recs {
		// A publish target that is no mount any more is dead too: a
		// plugin that unmounted its targets when it restarted, an
		// operator's umount, or a repair that took the dead publish away
		// and failed before it published again (the plugin died again, a
		// commit failed). The task's copy of it is then dead or an empty
		// directory, and the driver's unpublish of it later would find
		// nothing. Only publish targets: a plugin may stage without a
		// mount (staging_target_path is the plugin's, CSI spec), nor
		// publish targets the plugin published without a mount
		// (Unmounted).
		stale, err := check(tr.Target, true, !tr.Unmounted)
		if err != nil {
			return nil, fmt.Errorf("failed to check the mount %q of volume %q: %w", tr.Target, tr.Name, err)
		}
		// Every publish of a dead staging is a bind of it: dead too. One
		// an earlier repair unmounted is published again whatever it is.
		if stale || stagingDead || tr.State != phasePublished {
			deadTarget[tr.Target] = deadTarget[tr.Target] || stale
			dead = append(dead, tr)
			continue
		}
		// One that is alive again without a repair (a daemon that
		// reconnected while the repair failed) has what the failed
		// repair remembers of it forgotten, so that its next death is
		// told as the first was.
		m.mu.Lock()
		m.forgetRepairLocked(tr.ref())
		m.mu.Unlock()
	}
	// A plugin that is not healthy (its process died, or is starting
	// again) is no plugin that keeps losing its mounts: no relapse is
	// counted, nor told, while it is away, and its return ends any
	// back-off (ResetRepairBackoff). It is not called either (below).
	held := false
	if _, err := m.lookupHealthy(vol.PluginID); err == nil {
		dead, held = m.holdRelapses(dead, stagingDead, retry)
	}
	if len(dead) == 0 && (!stagingDead || held) {
		return nil, nil
	}
	// A volume whose last stage the plugin refused (an earlier repair's,
	// say) is staged again before its dead targets are published: a
	// publish needs it. Its live targets are left alone.
	restage := stagingDead || (vol.Stage == phaseStageRefused && len(dead) > 0)
	if vol.Stage == phaseStageRefused {
		// Staged with the secrets of a task it is repaired for, as a
		// setup stages it with its own request's (setupVolume): those
		// this process holds of the refused stage may be what the plugin
		// refused, another job's wrong token, and sent again would keep
		// the volume refused for these tasks until they restart.
		for _, tr := range dead {
			if len(tr.Secrets) > 0 {
				vol.Secrets = tr.Secrets
				break
			}
		}
	}
	// A volume set up with secrets is staged and published again with
	// them, or not at all: after a restart the driver has none (they are
	// kept only while a call needs them), and a call without them would
	// fail or, worse, publish with less than the job gave.
	for _, tr := range dead {
		if (tr.HadSecrets && len(tr.Secrets) == 0) || (restage && vol.HadSecrets && len(vol.Secrets) == 0) {
			return nil, m.repairFailed(dead, fmt.Errorf("volume %q needs its secrets to be staged or published again, and the driver no longer holds them (it keeps them only while a call needs them, and restarted since): restart the task to set the volume up again", tr.Name))
		}
	}
	info, err := m.lookupHealthy(vol.PluginID)
	if err != nil {
		return nil, err
	}
	// Through another server of the id the dead mounts would be detached
	// and not set up again; left dead, they are found again once the
	// volume's own server is back.
	o := op{method: MethodNodePublishVolume, pluginID: vol.PluginID, volumeID: vol.VolumeID}
	if restage {
		o.method = MethodNodeStageVolume
	}
	if len(dead) > 0 {
		o.taskID, o.name = dead[0].TaskID, dead[0].Name
	}
	if err := m.serverRefusal(o, vol, info); err != nil {
		return nil, m.repairFailed(dead, err)
	}
	m.logger.Warn("dead volume mounts found; repairing", "plugin_id", vol.PluginID, "volume_id", vol.VolumeID,
		"staging_dead", stagingDead, "dead_targets", len(dead))

	// The task records stay "published" meanwhile: should the driver stop
	// half way, recovery and teardown unpublish them as they would any
	// published volume, which is harmless on a path already unmounted.
	// A task is told once that its volume is stale: a repair that
	// failed leaves it repairing, and the passes after it (the driver's
	// periodic check) try again without a word until one succeeds or
	// fails another way (repairFailed).
	tell := map[taskRef]bool{}
	m.mu.Lock()
	restarted := m.returned[vol.PluginID] != 0
	for _, tr := range dead {
		st := m.repairs[tr.ref()]
		// A relapse was told when its back-off began (holdRelapses).
		tell[tr.ref()] = !st.repairing && st.relapses == 0
		st.repairing = true
		m.repairs[tr.ref()] = st
	}
	m.mu.Unlock()
	// The tasks of an allocation sharing one publish (allocShare) each
	// have a record naming its target: it is taken and published again
	// once, and every one of them binds it afresh.
	taken := map[string]bool{}
	groupFirst(dead)
	for _, tr := range dead {
		if tell[tr.ref()] {
			// The publish target when it was found dead, else the
			// staging mount it is a bind of.
			path := tr.Target
			if stagingDead && !deadTarget[tr.Target] {
				path = vol.StagingPath
			}
			m.event(tr.TaskID, staleEvent(tr, path, restarted), annotations(tr.Name, tr.PluginID, tr.VolumeID))
		}
		if taken[tr.Target] {
			continue
		}
		taken[tr.Target] = true
		if err := m.takeDeadPublish(ctx, tr); err != nil {
			return nil, m.repairCallFailed(dead, err)
		}
	}
	var pending []journalOp
	if stagingDead {
		if err := m.takeDeadStaging(ctx, vol); err != nil {
			return nil, m.repairCallFailed(dead, err)
		}
	}
	if restage {
		name, taskID := "", ""
		if len(dead) > 0 {
			name, taskID = dead[0].Name, dead[0].TaskID
		}
		if vol, pending, err = m.ensureVolume(ctx, taskID, name, info, vol, true, nil, nil); err != nil {
			return nil, m.repairCallFailed(dead, err)
		}
	}
	var (
		out  []Repaired
		errs []error
	)
	published := map[string]bool{}
	for _, tr := range dead {
		if !published[tr.Target] || tr.State != phasePublished {
			tr.mustMount = !tr.Unmounted
			if err := m.ensurePublished(ctx, info, vol, tr, "", pending, nil); err != nil {
				errs = append(errs, m.repairCallFailed([]taskRecord{tr}, err))
				continue
			}
			pending = nil
			published[tr.Target] = true
		}
		// Only a check that finds the fresh mount alive ends its
		// back-off: until then it is remembered as repaired.
		m.mu.Lock()
		st := m.repairs[tr.ref()]
		st.repairing, st.failure, st.repaired = false, "", true
		st.failures, st.retryAt = 0, time.Time{}
		m.repairs[tr.ref()] = st
		m.mu.Unlock()
		out = append(out, Repaired{TaskID: tr.TaskID, Name: tr.Name, PluginID: tr.PluginID, VolumeID: tr.VolumeID,
			HostPath: tr.Target, Destination: tr.Destination, ReadOnly: tr.ReadOnly})
	}
	if len(pending) > 0 {
		if err := m.commitLazy(pending...); err != nil {
			errs = append(errs, err)
		}
	}
	return out, errors.Join(errs...)
}

// staleEvent tells a task that its volume's mount at path was found dead
// or gone. The plugin's restart is named only when the driver saw one
// (restarted: the plugin became healthy again since a pass last checked
// all its volumes); a mount unmounted by an operator, or by a plugin that
// stayed up, was simply gone.
func staleEvent(tr taskRecord, path string, restarted bool) string {
	if restarted {
		return fmt.Sprintf("Volume %q is stale (its mount at %s was gone after plugin %q restarted); repairing", tr.Name, path, tr.PluginID)
	}
	return fmt.Sprintf("Volume %q is stale (its mount at %s was gone); repairing", tr.Name, path)
}

// checkAhead checks the staging path and the published targets of volume
// k, without its lock, and returns those found alive.
func (m *Manager) checkAhead(k volKey) (map[string]bool, error) {
	staging := ""
	var recs []taskRecord
	m.mu.Lock()
	if v, ok := m.vols[k]; ok && v.Stage == phaseStaged {
		staging = v.StagingPath
	}
	for _, byName := range m.tasks {
		for _, tr := range byName {
			if tr.key() == k && tr.State == phasePublished {
				recs = append(recs, tr)
			}
		}
	}
	m.mu.Unlock()
	sort.Slice(recs, func(i, j int) bool { return recs[i].TaskID+recs[i].Name < recs[j].TaskID+recs[j].Name })
	alive := map[string]bool{}
	if staging != "" {
		dead, err := m.stale(staging)
		if err != nil {
			return nil, fmt.Errorf("failed to check the staging mount %q of volume_id %q: %w", staging, k.volume, err)
		}
		alive[staging] = !dead
	}
	for _, tr := range recs {
		dead, err := m.checkTarget(tr.Target, true, !tr.Unmounted)
		if err != nil {
			return nil, fmt.Errorf("failed to check the mount %q of volume %q: %w", tr.Target, tr.Name, err)
		}
		alive[tr.Target] = !dead
	}
	return alive, nil
}

// holdRelapses counts the relapses among dead (task volumes whose
// repaired mount died again before a check saw it alive) and returns the
// task volumes to repair in this pass: not those whose back-off runs
// still. The first wait of each relapse is RepairBackoffBase, each further
// one twice as long, up to RepairBackoffMax. The task is told once, when
// its back-off begins; each pass that holds a volume back logs it at
// Debug. One mount repaired is repaired for every record on it, so none
// of them is held back while another is repaired: the tasks of an
// allocation share one publish (allocShare), and every publish of a dead
// staging is restaged with it (held reports that none is repaired). For
// those no wait begins, and no relapse is counted or told.
func (m *Manager) holdRelapses(dead []taskRecord, stagingDead, retry bool) (repair []taskRecord, held bool) {
	type hold struct {
		tr        taskRecord
		st        repairState
		wait      time.Duration
		firstTime bool
	}
	now := m.now()
	// A volume waits after a relapse, and after a repair call that failed
	// (repairCallFailed) unless this pass is a retry of that repair.
	waiting := func(st repairState) bool {
		return now.Before(st.notBefore) || !retry && now.Before(st.retryAt)
	}
	m.mu.Lock()
	states := map[taskRef]repairState{}
	waits := map[taskRef]time.Duration{}
	freed := map[string]bool{} // targets repaired in this pass
	anyFreed := false
	for _, tr := range dead {
		st := m.repairs[tr.ref()]
		if st.repaired {
			st.repaired = false
			st.relapses++
			waits[tr.ref()] = m.relapseWait(st.relapses)
			st.notBefore = now.Add(waits[tr.ref()])
		}
		states[tr.ref()] = st
		if !waiting(st) {
			freed[tr.Target], anyFreed = true, true
		}
	}
	var holds []hold
	for _, tr := range dead {
		st := states[tr.ref()]
		if waiting(st) && !freed[tr.Target] && !(stagingDead && anyFreed) {
			wait := waits[tr.ref()]
			holds = append(holds, hold{tr, st, wait, wait > 0 && st.relapses == 1})
			m.repairs[tr.ref()] = st
			continue
		}
		repair = append(repair, tr)
		if _, relapsed := waits[tr.ref()]; relapsed {
			// Repaired with another record's mount: the relapse
			// is not counted, only the repair it had is spent.
			st := m.repairs[tr.ref()]
			st.repaired = false
			m.putRepairLocked(tr.ref(), st)
		}
	}
	m.mu.Unlock()
	for _, h := range holds {
		tr := h.tr
		if h.firstTime {
			m.event(tr.TaskID, fmt.Sprintf("Volume %q died again soon after its repair (its mount at %s was gone again; plugin %q stayed healthy): it is repaired again in %v, and less often (up to every %v) while this goes on; check the plugin, or restart the task",
				tr.Name, tr.Target, tr.PluginID, h.wait, m.cfg.RepairBackoffMax), annotations(tr.Name, tr.PluginID, tr.VolumeID))
		}
		if now.Before(h.st.notBefore) {
			m.logger.Debug("dead volume mount not repaired in this pass: it died again soon after its last repair",
				"task_id", tr.TaskID, "volume", tr.Name, "plugin_id", tr.PluginID, "volume_id", tr.VolumeID,
				"relapses", h.st.relapses, "repair_in", h.st.notBefore.Sub(now))
		} else {
			m.logger.Debug("dead volume mount not repaired in this pass: its last repairs failed",
				"task_id", tr.TaskID, "volume", tr.Name, "plugin_id", tr.PluginID, "volume_id", tr.VolumeID,
				"failures", h.st.failures, "repair_in", h.st.retryAt.Sub(now))
		}
	}
	return repair, len(holds) > 0
}

// relapseWait is the back-off after the n-th relapse in a row (n >= 1).
func (m *Manager) relapseWait(n int) time.Duration {
	d := m.cfg.RepairBackoffBase
	for i := 1; i < n && d < m.cfg.RepairBackoffMax; i++ {
		d *= 2
	}
	return min(d, m.cfg.RepairBackoffMax)
}

// ResetRepairBackoff ends the back-off of the task volumes of pluginID:
// a plugin back after its process died is a new one, whose first repair
// of them is not held back by its predecessor's relapses (Nomad's restart
// policy paces a plugin that crash-loops). The driver calls it when a
// plugin becomes healthy again, before the repair that follows; the tasks
// whose mounts that repair (or any pass before all the plugin's volumes
// are dealt with) finds dead are told they died with its restart.
func (m *Manager) ResetRepairBackoff(pluginID string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for ref, st := range m.repairs {
		if tr, ok := m.tasks[ref.taskID][ref.name]; !ok || tr.PluginID != pluginID {
			continue
		}
		st.repaired, st.relapses, st.notBefore = false, 0, time.Time{}
		st.failures, st.retryAt = 0, time.Time{}
		m.putRepairLocked(ref, st)
	}
	m.returns++
	m.returned[pluginID] = m.returns
}

// repairCallFailed is repairFailed of a repair whose call to the plugin
// failed (not one refused before any call): while the plugin stays healthy,
// each such failure in a row doubles the wait before the volume's next
// repair, as a relapse does (RepairBackoffBase up to RepairBackoffMax), so
// that a plugin that keeps refusing (its backend gone) is not asked again
// at every periodic check for ever. A plugin that went away meanwhile
// begins no wait: its return starts the next repair (ResetRepairBackoff).
// The retries of one repair (RepairStaleRetry) are not held back.
func (m *Manager) repairCallFailed(dead []taskRecord, err error) error {
	now := m.now()
	for _, tr := range dead {
		if _, lerr := m.lookupHealthy(tr.PluginID); lerr != nil {
			continue
		}
		m.mu.Lock()
		st := m.repairs[tr.ref()]
		st.failures++
		st.retryAt = now.Add(m.relapseWait(st.failures))
		m.repairs[tr.ref()] = st
		m.mu.Unlock()
	}
	return m.repairFailed(dead, err)
}

// repairFailed reports a failed repair to each task it leaves with a dead
// mount, and returns err.
func (m *Manager) repairFailed(dead []taskRecord, err error) error {
	for _, tr := range dead {
		msg := fmt.Sprintf("Repair of stale volume %q failed: %s", tr.Name, repairSummary(err))
		if m.repairFailureNew(tr, failureKind(err)) {
			m.event(tr.TaskID, msg, annotations(tr.Name, tr.PluginID, tr.VolumeID))
		} else {
			m.logger.Debug("repair failed as before", "task_id", tr.TaskID, "volume", tr.Name, "error", repairSummary(err))
		}
	}
	return err
}

// repairFailureNew records kind (failureKind) as the last failed repair
// of tr's volume and reports whether it differs from the one before.
func (m *Manager) repairFailureNew(tr taskRecord, kind string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := m.repairs[tr.ref()]
	if st.failure == kind {
		return false
	}
	st.failure = kind
	m.repairs[tr.ref()] = st
	return true
}

// failureKind is what tells one way a repair fails from another: the call
// that failed, its code and its hint (what the operator is told to do).
// Not the plugin's message, which may change with each answer (a request
// id, a time, an attempt count) while the failure stays the same. The
// hint tells the driver's own findings apart from a plugin's answer of
// the same call and code: a volume waiting for its own server
// (serverRefusal) after the plugin answered Unavailable, a plugin that
// answered OK without mounting. A failure of no call is its text.
func failureKind(err error) string {
	if oes := opErrors(err); len(oes) > 0 {
		return oes[0].Method + "\x00" + oes[0].Code.String() + "\x00" + oes[0].Hint
	}
	return err.Error()
}

// takeDeadPublish unpublishes a dead publish target: through the plugin,
// and by a lazy detach when the plugin could not take it away.
func (m *Manager) takeDeadPublish(ctx context.Context, tr taskRecord) error {
	o := op{method: MethodNodeUnpublishVolume, taskID: tr.TaskID, name: tr.Name, pluginID: tr.PluginID,
		volumeID: tr.VolumeID, path: tr.Target, notFoundOK: true, secrets: []map[string]string{tr.Secrets}}
	_, node, _, err := m.pluginClients(o)
	if err == nil {
		err = m.call(ctx, o, func(ctx context.Context) error {
			_, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: tr.VolumeID, TargetPath: tr.Target})
			return err
		})
	}
	return m.detachIfStill(tr.Target, err)
}

// takeDeadStaging unstages a dead staging mount, detaching it lazily when
// the plugin could not.
func (m *Manager) takeDeadStaging(ctx context.Context, vol volRecord) error {
	o := op{method: MethodNodeUnstageVolume, pluginID: vol.PluginID, volumeID: vol.VolumeID, nodeID: vol.NodeID,
		path: vol.StagingPath, notFoundOK: true, secrets: []map[string]string{vol.Secrets}}
	_, node, _, err := m.pluginClients(o)
	if err == nil {
		err = m.call(ctx, o, func(ctx context.Context) error {
			_, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.VolumeID, StagingTargetPath: vol.StagingPath})
			return err
		})
	}
	return m.detachIfStill(vol.StagingPath, err)
}

// detachIfStill detaches path lazily when it is still a dead mount after
// the plugin's call (which failed with callErr, or said it was done).
// Only a path that stays mounted and alive after a failed call fails.
func (m *Manager) detachIfStill(path string, callErr error) error {
	if callErr != nil {
		m.logger.Warn("plugin could not take a dead mount away; detaching it", "path", path, "error", callErr)
	}
	stale, err := m.stale(path)
	if err != nil {
		return fmt.Errorf("failed to check the mount %q: %w", path, err)
	}
	if stale {
		if err := m.cfg.Mounter.DetachLazy(path); err != nil {
			return err
		}
		return nil
	}
	if callErr == nil {
		return nil
	}
	mounted, err := m.cfg.Mounter.IsMountPoint(path)
	if err == nil && mounted {
		return callErr
	}
	return nil
}

// repairState is what the repairs of one task volume remember between
// passes (Manager.repairs); the zero value, nothing, is no entry.
type repairState struct {
	// repairing: a repair unmounted the volume (or began to) and has not
	// published it again yet. The task was told it is stale.
	repairing bool
	// failure is how the last repair failed (failureKind), so that a
	// repair failing the same way pass after pass tells the task once
	// (Nomad keeps a task's last ten events).
	failure string
	// recoverTold is the event of a recovery that would not publish the
	// volume again (reconcile), so that another Recover finding the same
	// tells it once. Apart from failure: neither makes the other's next
	// event look new. A Recover that finds the target mounted forgets it.
	recoverTold string
	// repaired: the last repair published the volume again, and no check
	// has seen the fresh mount alive since. Found dead so, it relapsed.
	repaired bool
	// relapses counts the relapses since a check last saw the mount
	// alive; notBefore is when the volume may be repaired again.
	relapses  int
	notBefore time.Time
	// failures counts the repairs in a row whose call to the plugin
	// failed while it stayed healthy (repairCallFailed); retryAt is when
	// the volume may be repaired again after them.
	failures int
	retryAt  time.Time
}

// putRepairLocked records st as what the repairs of ref's volume
// remember, and no entry for the zero state, which remembers nothing. The
// caller holds m.mu.
func (m *Manager) putRepairLocked(ref taskRef, st repairState) {
	if st == (repairState{}) {
		delete(m.repairs, ref)
		return
	}
	m.repairs[ref] = st
}

// forgetRepairLocked forgets what repairs left of a task volume whose
// record is dropped (journalState.dropped): a task that came and went
// leaves nothing behind, however its repairs ended. Every drop holds the
// volume's lock, as a repair does throughout, so no repair of the record
// records anything after it. The caller holds m.mu.
func (m *Manager) forgetRepairLocked(ref taskRef) {
	delete(m.repairs, ref)
}

// repairCandidateLocked reports whether a task volume is looked at by a
// repair: published, or left publishing by a repair that failed (its
// mount is gone: it must be published again). The caller holds m.mu.
func (m *Manager) repairCandidateLocked(tr taskRecord) bool {
	return tr.State == phasePublished || tr.State == phasePublishing && m.repairs[tr.ref()].repairing
}

// staleCheckTimeout bounds one stat of a repair's check: a hung network
// mount must not hold the volume's lock (and its teardown) forever.
var staleCheckTimeout = 5 * time.Second

// stale is checkTarget of a path that may be no mount.
func (m *Manager) stale(path string) (bool, error) { return m.checkTarget(path, false, false) }

// checkTarget is Mounter.Stale of path within staleCheckTimeout; for a
// publish target (publish) also notMounted's check that it is there, and
// a mount at all when its publish left one (mount), within the same time. A stat that does not return is an error, and
// the path is not stat'ed again until it has: at most one stuck stat per
// path.
func (m *Manager) checkTarget(path string, publish, mount bool) (bool, error) {
	if _, busy := m.staleChecks.LoadOrStore(path, true); busy {
		return false, fmt.Errorf("an earlier check of %q has not returned yet (a hung mount?)", path)
	}
	type answer struct {
		dead bool
		err  error
	}
	done := make(chan answer, 1)
	go func() {
		dead, err := m.cfg.Mounter.Stale(path)
		if err == nil && !dead && publish {
			dead, err = notMounted(m.cfg.Mounter, path, mount)
		}
		// Before the answer: a caller that has it may check the path again
		// at once, and must not find this check still running.
		m.staleChecks.Delete(path)
		done <- answer{dead, err}
	}()
	t := time.NewTimer(staleCheckTimeout)
	defer t.Stop()
	select {
	case a := <-done:
		return a.dead, a.err
	case <-t.C:
		return false, fmt.Errorf("checking %q did not return within %v (a hung mount?)", path, staleCheckTimeout)
	}
}

// notMounted reports whether a publish target is no mount (any more): a
// missing path, a path that is not the root of a mount, or a symbolic
// link, which is no publish (ensurePublished refuses it) and is never
// followed to a mount elsewhere. A block volume's target is a file with
// the device bound on it: a mount like a directory's. A target whose
// publish left no mount (mount false: a device node the plugin made
// there) is dead only when missing or a symbolic link.
func notMounted(mnt mounter.Interface, path string, mount bool) (bool, error) {
	if targetIsSymlink(path) {
		return true, nil
	}
	if !mount {
		_, err := os.Lstat(path)
		if errors.Is(err, fs.ErrNotExist) {
			return true, nil
		}
		return false, err
	}
	mounted, err := mnt.IsMountPoint(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, err
	}
	return !mounted, nil
}
