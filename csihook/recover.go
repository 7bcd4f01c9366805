package csihook

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// scheduleTeardown retries a task's teardown in the background until it
// succeeds, starting after a backoff since cause just failed.
func (m *Manager) scheduleTeardown(taskID string, cause error) {
	m.background("task:"+taskID, taskID, cause, func(ctx context.Context) error {
		return m.teardownTask(ctx, taskID)
	}, func() {
		// After the attempt's events: Released may take the task's
		// event target away.
		if m.cfg.Released != nil {
			m.cfg.Released(taskID)
		}
	})
}

// background runs attempt until it succeeds, Close is called or it fails
// permanently, one worker per key. With a nil cause the first attempt runs
// at once; otherwise an event reports cause and the wait before the next.
// succeeded, when set, runs once an attempt succeeded and its event went
// out.
func (m *Manager) background(key, taskID string, cause error, attempt func(ctx context.Context) error, succeeded func()) {
	m.mu.Lock()
	if m.closed || m.workers[key] {
		m.mu.Unlock()
		return
	}
	m.workers[key] = true
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer func() {
			m.mu.Lock()
			delete(m.workers, key)
			m.mu.Unlock()
			m.wg.Done()
		}()
		err := cause
		for i := 0; ; i++ {
			if err != nil {
				if permanent(err) {
					m.event(taskID, fmt.Sprintf("%s: not retrying; the journal keeps the volume for the next driver start", summary(err)), nil)
					m.logger.Error("giving up on volume cleanup", "task_id", taskID, "error", err)
					return
				}
				d := backoff(i, m.cfg.BackgroundRetryBase, m.cfg.BackgroundRetryMax, rand.Float64)
				m.event(taskID, fmt.Sprintf("%s: retrying in %s", summary(err), roundDuration(d)), nil)
				t := time.NewTimer(d)
				select {
				case <-m.ctx.Done():
					t.Stop()
					return
				case <-t.C:
				}
			}
			ctx, cancel := context.WithTimeout(m.ctx, m.cfg.RPCTimeout*defaultRollbackTimeoutFactor)
			err = attempt(ctx)
			cancel()
			if err == nil {
				if cause != nil || i > 0 {
					m.event(taskID, "Volume cleanup succeeded", nil)
				}
				if succeeded != nil {
					succeeded()
				}
				return
			}
			if m.ctx.Err() != nil {
				return
			}
		}
	}()
}

func roundDuration(d time.Duration) time.Duration {
	if d >= time.Second {
		return d.Round(time.Second)
	}
	return d.Round(10 * time.Millisecond)
}

// Recover settles the journal against the tasks alive after a driver
// start: it checks published targets against the mount table, tears down
// the volumes of tasks that are gone, settles calls a crash left uncertain
// (re-issuing NodeStage for a volume still in use, unstaging one that is
// not; a NodeStage the plugin refused is not re-issued), and re-publishes live task volumes whose mount is missing. The
// work runs in the background, one worker per volume, retrying until the
// plugins answer; WaitIdle waits for it. The error reports only a mount
// table that cannot be read.
func (m *Manager) Recover(live func(taskID string) bool) error {
	mounts, listErr := m.cfg.Mounter.List()
	mounted := map[string]bool{}
	for _, mp := range mounts {
		mounted[mp.Path] = true
	}
	m.mu.Lock()
	keys := map[volKey]bool{}
	for k := range m.vols {
		keys[k] = true
	}
	repair := map[volKey]map[string]bool{}
	known := map[string]bool{}
	// Events of a volume's worker go to a task that is gone, if any.
	owner := map[volKey]string{}
	for _, recs := range m.tasks {
		for _, t := range recs {
			keys[t.key()] = true
			if owner[t.key()] == "" && !live(t.TaskID) {
				owner[t.key()] = t.TaskID
			}
			known[t.Target] = true
			// A target its plugin published without a mount (Unmounted)
			// is lost only when gone or a symbolic link.
			lost := !mounted[t.Target]
			if t.Unmounted {
				lost, _ = notMounted(m.cfg.Mounter, t.Target, false)
			}
			if listErr == nil && t.State == phasePublished && !lost && live(t.TaskID) {
				// Mounted again since a Recover told the task it was
				// not: a later loss is told as the first was.
				m.forgetRecoverToldLocked(t.ref())
			}
			if listErr == nil && t.State == phasePublished && lost && live(t.TaskID) {
				if repair[t.key()] == nil {
					repair[t.key()] = map[string]bool{}
				}
				repair[t.key()][t.TaskID+"\x00"+t.Name] = true
				m.logger.Warn("published volume is not mounted", "task_id", t.TaskID, "volume", t.Name,
					"volume_id", t.VolumeID, "target_path", t.Target)
			}
		}
	}
	for _, v := range m.vols {
		known[v.StagingPath] = true
	}
	m.mu.Unlock()

	// Mounts under our root that no record knows cannot be undone through
	// a plugin; say so rather than guess.
	for _, mp := range mounts {
		for _, dir := range []string{filepath.Join(m.cfg.Root, "publish"), filepath.Join(m.cfg.Root, "staging")} {
			if mounter.PathWithin(mp.Path, dir) && mp.Path != dir && !known[mp.Path] {
				m.logger.Warn("mount under the volume root has no journal record", "path", mp.Path)
			}
		}
	}

	for k := range keys {
		k, fix := k, repair[k]
		if fix == nil {
			fix = map[string]bool{}
		}
		var last volUser
		m.background("vol:"+k.String(), owner[k], nil, func(ctx context.Context) error {
			return m.reconcile(ctx, k, live, fix, &last)
		}, nil)
	}
	if listErr != nil {
		return fmt.Errorf("failed to check volume mounts: %w", listErr)
	}
	return nil
}

// recoverTellNew records msg as what a recovery told tr's task of its
// volume (repairState.recoverTold) and reports whether it differs from
// what it told before.
func (m *Manager) recoverTellNew(tr taskRecord, msg string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := m.repairs[tr.ref()]
	if st.recoverTold == msg {
		return false
	}
	st.recoverTold = msg
	m.repairs[tr.ref()] = st
	return true
}

// forgetRecoverToldLocked forgets what a recovery told of ref's volume,
// and nothing a repair remembers. The caller holds m.mu.
func (m *Manager) forgetRecoverToldLocked(ref taskRef) {
	st, ok := m.repairs[ref]
	if !ok || st.recoverTold == "" {
		return
	}
	st.recoverTold = ""
	m.putRepairLocked(ref, st)
}

// volUser is a task's volume by the task's id and the volume's name in it.
type volUser struct{ taskID, name string }

// reconcile brings one volume in line with the live tasks. It is
// idempotent, so a failed attempt is simply run again. repair names the
// live task volumes (task id NUL name) whose target lost its mount; only
// this volume's worker touches it. last is the task the worker's release
// goes under, kept across attempts: an attempt that unpublished the last
// task's volume dropped its record, and the retry of the release still
// tells that task, by the volume's name.
func (m *Manager) reconcile(ctx context.Context, k volKey, live func(string) bool, repair map[string]bool, last *volUser) error {
	unlock, err := m.locks.lock(ctx, k.String())
	if err != nil {
		return err
	}
	defer unlock()

	var (
		errs        []error
		keep        []taskRecord
		unpublished []taskRecord
	)
	m.mu.Lock()
	var recs []taskRecord
	for _, ts := range m.tasks {
		for _, t := range ts {
			if t.key() == k {
				recs = append(recs, t)
			}
		}
	}
	m.mu.Unlock()
	for _, t := range recs {
		*last = volUser{t.TaskID, t.Name}
		if live(t.TaskID) && t.State != phaseUnpublishing {
			keep = append(keep, t)
			continue
		}
		m.logger.Info("cleaning up volume of a task that is gone", "task_id", t.TaskID, "volume", t.Name,
			"plugin_id", t.PluginID, "volume_id", t.VolumeID, "state", t.State)
		drop, called, err := m.unpublishLocked(ctx, t)
		if err == nil {
			err = m.commit(drop...)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if called {
			unpublished = append(unpublished, t)
		}
		if len(m.taskRecs(t.TaskID)) == 0 {
			m.removeIfEmpty(m.taskDir(t.TaskID))
		}
	}
	// The release goes under the last task seen, in this attempt or an
	// earlier one (none: no task, the volume by its id).
	anyTID, name := last.taskID, last.name
	if name == "" {
		name = k.volume
	}
	// Each task's event tells its own unpublish; the last task's, whose id
	// the release goes under, tells the release with it. A failure has its
	// own event, with the step that failed.
	release := len(keep) == 0 && len(errs) == 0
	isStaged := false
	if vol, ok := m.vol(k); ok {
		isStaged = vol.keptStaged()
	}
	var lastUnpublished bool
	for _, t := range unpublished {
		if release && t.TaskID == anyTID && t.Name == name {
			lastUnpublished = true
			continue
		}
		m.tornDown(t.TaskID, t.Name, t.PluginID, t.VolumeID, tornSteps{unpublished: true, kept: len(keep) > 0 && isStaged})
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if release {
		steps, err := m.releaseLocked(ctx, anyTID, name, k, nil)
		// Done or not: what was done is told (the failure has its own
		// event, and the retry tells what it does).
		steps.unpublished = lastUnpublished
		m.tornDown(anyTID, name, k.plugin, k.volume, steps)
		return err
	}

	// Live users remain: settle uncertain steps forward.
	first := keep[0]
	vol, ok := m.vol(k)
	if !ok {
		m.logger.Warn("volume record missing for live task volume; rebuilding it", "plugin_id", k.plugin, "volume_id", k.volume)
		vol = volRecord{PluginID: first.PluginID, VolumeID: first.VolumeID, StagingPath: m.StagingPath(first.PluginID, first.VolumeID),
			AccessMode: first.AccessMode, AttachmentMode: first.AttachmentMode, FSType: first.FSType,
			MountFlags: first.MountFlags, VolumeContext: first.VolumeContext, Secrets: first.Secrets}
		if err := m.commit(volPut(vol)); err != nil {
			return err
		}
	}
	var fix []taskRecord
	for _, t := range keep {
		if t.State != phasePublished || repair[t.TaskID+"\x00"+t.Name] {
			fix = append(fix, t)
		}
	}
	// The log keeps secrets only while a call needs them (see
	// volRecord.needsSecrets): a call made again here takes those of a
	// record that still has them.
	for _, t := range keep {
		if len(vol.Secrets) == 0 && len(t.Secrets) > 0 {
			vol.Secrets = t.Secrets
		}
	}
	if vol.Stage == phaseStageRefused && vol.Controller != phasePublishing && len(fix) == 0 {
		// The plugin refused the volume's last NodeStageVolume: nothing
		// is uncertain, and staging it again would repeat what was
		// refused. The live tasks keep their mounts, and the last
		// teardown unstages it.
		return nil
	}
	// A stage made again (a live task lost its mount, or a staged
	// volume's staging path is no mount after the restart) and a publish
	// made again take the secrets the volume was set up with, or are not
	// made, as a repair's are not (see repairVolume): the journal keeps
	// them only while a call needs them, and a NodeStageVolume or
	// NodePublishVolume without them would be refused (a refused stage
	// then leaves the volume refused for its other tasks) or, worse, set
	// the volume up with less than the job gave. The live tasks keep what
	// they have; the next setup of the volume stages it with its own
	// request's secrets.
	//
	// A staged volume is staged again when a live task lost its mount or
	// its staging path is no mount (stagingHeld, whose check ensureVolume
	// then goes by, see restage below); a refused one when a live task
	// lost its mount.
	restaged := len(fix) > 0 && (vol.Stage == phaseStaged || vol.Stage == phaseStageRefused) ||
		vol.Stage == phaseStaged && !m.stagingHeld(vol)
	lacks := restaged && vol.HadSecrets && len(vol.Secrets) == 0
	for _, t := range fix {
		if t.HadSecrets && len(t.Secrets) == 0 && len(vol.Secrets) == 0 {
			lacks = true
		}
	}
	if lacks {
		why := "staging or publishing it again needs its secrets"
		if vol.Stage == phaseStageRefused {
			why = fmt.Sprintf("plugin %q refused to stage it before the restart, and staging it again needs its secrets", k.plugin)
		}
		for _, t := range fix {
			msg := fmt.Sprintf("Volume %q is not mounted after a driver restart and is not published again: %s, which the driver no longer holds: restart the task to set the volume up again",
				t.Name, why)
			// Told once, as a repair failing the same way is: another
			// Recover of the same journal in this process finds nothing
			// new to tell. What is remembered goes with the task's
			// record, or once a check (a Recover's, a repair's) finds
			// its mount there again.
			if m.recoverTellNew(t, msg) {
				m.event(t.TaskID, msg, annotations(t.Name, t.PluginID, t.VolumeID))
			}
		}
		m.logger.Warn("not staging or publishing a volume again: its secrets are no longer held",
			"plugin_id", k.plugin, "volume_id", k.volume, "stage", vol.Stage, "tasks", len(fix))
		return nil
	}
	info, _ := m.cfg.Lookup(k.plugin)
	if !info.Healthy && (len(fix) > 0 || vol.Controller == phasePublishing || vol.Stage == phaseStaging) {
		// What the calls send depends on the plugin's capabilities
		// (ControllerPublishVolume's readonly needs PUBLISH_READONLY;
		// whether to attach or stage at all), which a plugin not probed
		// yet since a restart does not show: they are made once it is
		// healthy.
		o := op{method: MethodNodePublishVolume, taskID: first.TaskID, name: first.Name, pluginID: k.plugin, volumeID: k.volume}
		if vol.Controller == phasePublishing {
			o.method = MethodControllerPublishVolume
		} else if vol.Stage == phaseStaging {
			o.method = MethodNodeStageVolume
		}
		return unreachable(o, fmt.Sprintf("CSI plugin %q is not healthy yet, so its capabilities are not known", k.plugin))
	}
	// A staged volume staged again goes with restage, as stagingHeld
	// found it: ensureVolume does not ask the mount table again. One
	// stagingHeld found held is recorded as verified only here, as it is
	// used: an attempt that stopped above (the plugin not healthy yet)
	// leaves no mark, and the next one looks at the mount again. A
	// refused one is staged again whatever restage says.
	restage := restaged && vol.Stage == phaseStaged
	if restage && len(fix) == 0 {
		m.logger.Info("staging from before a restart not found mounted; staging again", "plugin_id", vol.PluginID,
			"volume_id", vol.VolumeID, "staging_path", vol.StagingPath)
	}
	if vol.Stage == phaseStaged && !restaged {
		m.setVerified(vol.key(), true)
	}
	var staged []journalOp
	if vol, staged, err = m.ensureVolume(ctx, first.TaskID, first.Name, info, vol, restage, nil, nil); err != nil {
		return err
	}
	if err := m.commit(staged...); err != nil {
		return err
	}
	// The tasks of an allocation sharing one publish (allocShare) have
	// one record each: the publish is made again once, for the first.
	republished := map[string]bool{}
	groupFirst(fix)
	for _, t := range fix {
		if t.State == phasePublished && republished[t.Target] {
			continue
		}
		m.event(t.TaskID, fmt.Sprintf("Re-publishing volume %q after a driver restart", t.Name), annotations(t.Name, t.PluginID, t.VolumeID))
		if len(t.Secrets) == 0 {
			t.Secrets = vol.Secrets
		}
		if err := m.ensurePublished(ctx, info, vol, t, "", nil, nil); err != nil {
			errs = append(errs, err)
			continue
		}
		republished[t.Target] = true
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	// Repairs are done; a later attempt must not repeat them.
	for _, t := range fix {
		delete(repair, t.TaskID+"\x00"+t.Name)
	}
	return nil
}
