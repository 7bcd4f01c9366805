package driver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
)

// volumeRequests turns a task's volume blocks into the volume lifecycle's
// requests, in a stable order, checking what needs no plugin.
func volumeRequests(vols map[string]VolumeConfig) ([]csihook.VolumeRequest, error) {
	names := make([]string, 0, len(vols))
	for name := range vols {
		names = append(names, name)
	}
	sort.Strings(names)
	reqs := make([]csihook.VolumeRequest, 0, len(names))
	for _, name := range names {
		v := vols[name]
		req := csihook.VolumeRequest{
			Name:            name,
			PluginID:        v.PluginID,
			VolumeID:        v.VolumeID,
			Destination:     v.Destination,
			ReadOnly:        v.ReadOnly,
			AccessMode:      v.AccessMode,
			AttachmentMode:  v.AttachmentMode,
			Context:         v.Context,
			Secrets:         v.Secrets,
			ApplyMountGroup: v.MountGroup,
		}
		if req.AccessMode == "" {
			req.AccessMode = csihook.AccessSingleNodeWriter
		}
		if req.AttachmentMode == "" {
			req.AttachmentMode = csihook.AttachmentFileSystem
		}
		if mo := v.MountOptions; mo != nil {
			req.FSType = mo.FSType
			req.MountFlags = mo.MountFlags
		}
		if c := v.Create; c != nil {
			cr := &csihook.CreateRequest{Parameters: c.Parameters}
			var err error
			if cr.CapacityMin, err = parseSize(name, "capacity_min", c.CapacityMin); err != nil {
				return nil, err
			}
			if cr.CapacityMax, err = parseSize(name, "capacity_max", c.CapacityMax); err != nil {
				return nil, err
			}
			if cr.CapacityMax > 0 && cr.CapacityMin > cr.CapacityMax {
				return nil, fmt.Errorf("volume %q: create capacity_min %q is larger than capacity_max %q", name, c.CapacityMin, c.CapacityMax)
			}
			req.Create = cr
		}
		reqs = append(reqs, req)
	}
	return reqs, nil
}

// parseSize reads a size such as "10GiB"; "" is 0.
func parseSize(volume, field, s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	n, err := humanize.ParseBytes(s)
	if err != nil || n > 1<<62 {
		return 0, fmt.Errorf("volume %q: create %s %q is not a size: write it as Nomad does, such as \"10GiB\" or \"512MiB\"", volume, field, s)
	}
	return int64(n), nil
}

// volumeManager holds the volume lifecycle of this driver, made on first
// use (it locks its journal, so it is made once per driver process).
type volumeManager struct {
	mu      sync.Mutex
	manager *csihook.Manager
	// deferred holds the tasks whose teardown was asked for while the
	// journal could not be opened: recoverVolumes tears them down once it
	// opens.
	deferred map[string]bool
}

// The pace at which recoverVolumes tries to open the journal again while
// it cannot (another process holds it, its directory is unreadable).
var (
	journalRetryBase = time.Second
	journalRetryMax  = time.Minute
)

// openVolumesRetrying returns the volume lifecycle, trying to make it again
// with capped exponential backoff until it succeeds, or nil once the
// driver shuts down.
func (d *Driver) openVolumesRetrying() *csihook.Manager {
	wait := journalRetryBase
	for {
		m, err := d.volumes()
		if err == nil {
			return m
		}
		d.logger.Warn("cannot recover volumes yet; trying again", "error", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-d.ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		wait = min(2*wait, journalRetryMax)
	}
}

// deferTeardown keeps a task's teardown for when the journal opens, or
// returns the volume lifecycle when it is open by now.
func (d *Driver) deferTeardown(taskID string) *csihook.Manager {
	d.vols.mu.Lock()
	defer d.vols.mu.Unlock()
	if d.vols.manager != nil {
		return d.vols.manager
	}
	if d.vols.deferred == nil {
		d.vols.deferred = map[string]bool{}
	}
	d.vols.deferred[taskID] = true
	return nil
}

// runDeferredTeardowns tears down, each in the background, the volumes of
// the tasks whose teardown waited for the journal to open.
func (d *Driver) runDeferredTeardowns() {
	d.vols.mu.Lock()
	ids := d.vols.deferred
	d.vols.deferred = nil
	d.vols.mu.Unlock()
	for id := range ids {
		d.goBackground(func() {
			if err := d.teardownVolumes(id); err != nil {
				d.logger.Warn("volumes not torn down yet; retrying in the background", "task_id", id, "error", err)
				return
			}
			d.logger.Info("tore down the volumes of a task once the journal opened", "task_id", id)
			if _, ok := d.tasks.Get(id); !ok {
				d.eventTargets.Delete(id)
			}
		})
	}
}

// volumes returns the volume lifecycle, making it on first use.
func (d *Driver) volumes() (*csihook.Manager, error) {
	conf := d.currentConfig()
	if conf == nil {
		return nil, errors.New("the driver is not configured yet")
	}
	d.vols.mu.Lock()
	defer d.vols.mu.Unlock()
	if d.vols.manager != nil {
		return d.vols.manager, nil
	}
	if d.ctx.Err() != nil {
		return nil, errors.New("the driver is shutting down")
	}
	if err := os.MkdirAll(conf.stageRoot(), 0o700); err != nil {
		return nil, fmt.Errorf("failed to create the stage root %q: %w", conf.stageRoot(), err)
	}
	dial := d.dialVolume
	if dial == nil {
		dial = func(socket string) (csihook.Client, error) { return csihook.DialUnixPeer(socket, d.socketPeer(socket)) }
	}
	m, err := csihook.New(csihook.Config{
		Root:       conf.stageRoot(),
		JournalDir: JournalDir(conf.RootDir),
		Lookup:     d.lookupPlugin,
		Dial:       dial,
		Mounter:    d.mounter,
		Logger:     d.logger,
		Events:     d.volumeEvent,
		Released:   d.volumesReleased,
		PluginWait: d.pluginWait,
		// Read once: Nomad configures a plugin once per process.
		AllowCrossNamespace: conf.AllowCrossNamespaceVolumes,
		StatsInterval:       conf.volumeStatsInterval(),
		Observe:             d.observeCall,
	})
	if err != nil {
		return nil, fmt.Errorf("failed to open the volume journal: %w", err)
	}
	m.StartStats()
	if iv := conf.volumeStatsInterval(); iv > 0 {
		rootDir := conf.RootDir
		d.goBackground(func() { d.writeStatsFile(m, rootDir, iv) })
	}
	d.vols.manager = m
	return m, nil
}

// recoverVolumes settles the journal after the driver started: volumes of
// tasks that are gone are torn down, interrupted steps of live ones
// finished. A task is live while this driver knows it, a start works on
// it, or Nomad holds its handle and has not said yet what became of it
// (see invocations).
//
// While the journal cannot be opened it is tried again until it opens or
// the driver shuts down; teardowns asked for meanwhile run once it opens.
func (d *Driver) recoverVolumes() {
	m := d.openVolumesRetrying()
	if m == nil {
		return
	}
	defer d.runDeferredTeardowns()
	live := func(taskID string) bool {
		if _, ok := d.tasks.Get(taskID); ok {
			return true
		}
		return d.invocations.alive(taskID)
	}
	if err := m.Recover(live); err != nil {
		d.logger.Warn("failed to recover volumes", "error", err)
	}
}

// lookupPlugin tells the volume lifecycle what the fingerprint knows of a
// plugin.
func (d *Driver) lookupPlugin(id string) (csihook.PluginInfo, error) {
	p := d.currentProber()
	if p == nil {
		return csihook.PluginInfo{}, errors.New("the driver is not configured yet")
	}
	st, ok := p.Get(id)
	if !ok || st.Conflict != "" {
		return csihook.PluginInfo{}, fmt.Errorf("not found; plugins on this node: %s", knownPlugins(p))
	}
	info := lifecyclePluginInfo(st)
	info.Server = d.pluginServer(st)
	return info, nil
}

func lifecyclePluginInfo(st fingerprint.PluginStatus) csihook.PluginInfo {
	return csihook.PluginInfo{
		ID:                st.ID,
		Socket:            st.Socket,
		NodeID:            st.Node.NodeID,
		Healthy:           st.Healthy,
		HealthDescription: st.HealthDescription,
		StageUnstage:      st.NodeCaps.StageUnstageVolume,
		VolumeMountGroup:  st.NodeCaps.VolumeMountGroup,
		ControllerExpand:  st.ControllerService && st.ControllerCaps.ExpandVolume,
		NodeExpand:        st.NodeCaps.ExpandVolume,
		Topology:          st.Node.Topology,
		MaxVolumes:        st.Node.MaxVolumes,
		ControllerPublish: st.ControllerService && st.ControllerCaps.PublishUnpublishVolume,
		PublishReadonly:   st.ControllerService && st.ControllerCaps.PublishReadonly,
		OnlineExpansion:   st.PluginCaps.OnlineExpansion,
		OfflineExpansion:  st.PluginCaps.OfflineExpansion,
		// CSI spec: topology is used only with this capability.
		AccessibilityConstraints: st.PluginCaps.VolumeAccessibilityConstraints,
		VolumeStats:              st.NodeCaps.GetVolumeStats,
		VolumeCondition:          st.NodeCaps.VolumeCondition,
		CreateDelete:             st.ControllerService && st.ControllerCaps.CreateDeleteVolume,
		// A declared controller is never asked for its Node service; a
		// socket's plugin is, and is known to lack it once probed.
		ControllerOnly: st.Type == fingerprint.TypeController || (st.Known && !st.NodeService),
		// CSI has no capability for raw block volumes: the plugin itself
		// refuses a block capability it does not support.
		Block: true,
	}
}

func knownPlugins(p *fingerprint.Prober) string {
	var ids []string
	for _, st := range p.Snapshot() {
		if st.ID != "" && st.Conflict == "" {
			ids = append(ids, st.ID)
		}
	}
	if len(ids) == 0 {
		return "none"
	}
	sort.Strings(ids)
	return strings.Join(ids, ", ")
}

// volumeEvent sends the volume lifecycle's events to the task they concern.
func (d *Driver) volumeEvent(taskID, msg string, annotations map[string]string) {
	cfg, ok := d.eventTargets.Load(taskID)
	if !ok {
		d.logger.Debug("volume event for a task this driver does not know", "task_id", taskID, "message", msg)
		return
	}
	d.emitEvent(cfg.(*drivers.TaskConfig), msg, annotations)
}

// volumesReleased lets go of the event target of a task whose teardown
// the lifecycle finished in the background: nothing more is said to it.
func (d *Driver) volumesReleased(taskID string) {
	if _, ok := d.tasks.Get(taskID); !ok {
		d.eventTargets.Delete(taskID)
	}
}

// setupVolumes stages and publishes a task's volumes and returns the bind
// mounts that put them in the task. On error nothing is left behind.
// writer is who writes them in a task that is not privileged, nil for a
// privileged task: see volumeMounts, and hintUnwritable, which tells the
// task when it will not be able to write a volume.
func (d *Driver) setupVolumes(cfg *drivers.TaskConfig, reqs []csihook.VolumeRequest, writer *volumeWriter) ([]executor.Mount, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	m, err := d.volumes()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(d.ctx, volumeSetupTimeout)
	defer cancel()
	pubs, err := m.Setup(ctx, cfg.ID, reqs)
	if err != nil {
		return nil, err
	}
	isolated := writer != nil
	if isolated {
		d.hintUnwritable(func(msg string, ann map[string]string) { d.emitEvent(cfg, msg, ann) }, reqs, pubs, *writer)
	}
	return volumeMounts(pubs, isolated, isBlockDevice), nil
}

// volumeMounts are the mounts that put published volumes in a task.
//
// In a task that is not privileged every volume is nosuid, and nodev but a
// block-device volume (a device node the task must open; the device filter
// lets in only that one). A hostile job chooses its volume's mount_flags
// ("suid", "dev"), which the driver passes to the plugin as the CSI spec
// wants and most plugins hand to mount(2) as they are; a plugin that binds
// a host directory gives the host filesystem's flags even without them.
// Without these flags the task would hold a volume where a set-uid binary
// or a device node it made works: one layer (no_new_privs, the device
// filter) away from the host, and for whatever else, privileged task or
// host process, reaches the volume. The flags go on the task's copy of the
// mount, whatever the plugin did on the host, and the kernel locks them in
// the task's namespace.
//
// Block says what the job asked for (attachment_mode), not what the plugin
// made: a plugin that ignores the access type publishes a directory for a
// "block-device" volume. Only a volume whose publish target is a block
// device node on the host (isBlock) keeps dev.
func volumeMounts(pubs []csihook.Published, isolated bool, isBlock func(path string) bool) []executor.Mount {
	mounts := make([]executor.Mount, 0, len(pubs))
	for _, p := range pubs {
		mounts = append(mounts, executor.Mount{
			Source:      p.HostPath,
			Target:      p.Destination,
			ReadOnly:    p.ReadOnly,
			Propagation: executor.PropagationPrivate,
			NoSuid:      isolated,
			NoDev:       isolated && !(p.Block && isBlock(p.HostPath)),
		})
	}
	return mounts
}

// isBlockDevice reports whether path is a block device node (not
// following a symlink).
func isBlockDevice(path string) bool {
	var st unix.Stat_t
	return unix.Lstat(path, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK
}

// inOrderOf returns mounts in the order of want's targets: one mount for
// each.
func inOrderOf(want, mounts []executor.Mount) ([]executor.Mount, error) {
	byTarget := make(map[string]executor.Mount, len(mounts))
	for _, m := range mounts {
		byTarget[filepath.Clean(m.Target)] = m
	}
	out := make([]executor.Mount, 0, len(want))
	for _, w := range want {
		m, ok := byTarget[filepath.Clean(w.Target)]
		if !ok {
			return nil, fmt.Errorf("no volume was published for destination %q", w.Target)
		}
		out = append(out, m)
	}
	return out, nil
}

// teardownVolumes unpublishes a task's volumes; on failure the lifecycle
// keeps retrying in the background, and the error says so.
//
// When the journal cannot be opened, the teardown is kept and done once
// recoverVolumes opens it.
func (d *Driver) teardownVolumes(taskID string) error {
	m, err := d.volumes()
	if err != nil {
		if m = d.deferTeardown(taskID); m == nil {
			return fmt.Errorf("%w (the teardown is done once the journal opens)", err)
		}
	}
	ctx, cancel := context.WithTimeout(d.ctx, volumeTeardownTimeout)
	defer cancel()
	return m.Teardown(ctx, taskID)
}

const (
	// volumeSetupTimeout bounds staging and publishing a task's volumes.
	volumeSetupTimeout = 5 * time.Minute
	// volumeTeardownTimeout bounds the first, synchronous teardown
	// attempt; later ones run in the background.
	volumeTeardownTimeout = 2 * time.Minute
)

// checkVolumes reads a task's volume blocks and checks them against each
// other and against the task's other mounts, before any plugin is called.
func (d *Driver) checkVolumes(cfg *drivers.TaskConfig, tc *TaskConfig, spec *executor.Spec) ([]csihook.VolumeRequest, error) {
	if len(tc.Volumes) == 0 {
		return nil, nil
	}
	reqs, err := volumeRequests(tc.Volumes)
	if err != nil {
		return nil, err
	}
	// The task's volumes are its namespace's: within the operator's
	// volume grants (checked first, in StartTask), the first namespace to
	// use a volume on this node owns it (allow_cross_namespace_volumes
	// lets others in).
	ns := jobOf(cfg).namespace
	group, err := specGroup(spec)
	if err != nil {
		return nil, err
	}
	for i := range reqs {
		if rel := tc.Volumes[reqs[i].Name].SecretsFile; rel != "" {
			if reqs[i].Secrets, err = readSecretsFile(cfg.TaskDir().Dir, reqs[i].Name, rel); err != nil {
				return nil, err
			}
		}
		reqs[i].Namespace = ns
		reqs[i].MountGroup = group
		if reqs[i].ApplyMountGroup && group == "" {
			return nil, fmt.Errorf("volume %q: mount_group = true gives the volume the task's group, but the task runs as root (user %q): set the task's user to the user that writes the volume, or drop mount_group", reqs[i].Name, userOrRoot(spec.User))
		}
	}
	m, err := d.volumes()
	if err != nil {
		return nil, err
	}
	if err := m.Validate(reqs); err != nil {
		return nil, err
	}
	for _, r := range reqs {
		dest := filepath.Clean(r.Destination)
		for _, other := range spec.Mounts {
			if other.Target == dest {
				return nil, fmt.Errorf("volume %q: destination %q is also the path of another mount of the task", r.Name, dest)
			}
		}
		if b := insideBidirectional(spec.Mounts, dest); b != "" {
			return nil, fmt.Errorf("volume %q: destination %q lies inside the bidirectional mount %q: the volume's mount would appear on the host there and outlive the task; give it a destination outside %q", r.Name, dest, b, b)
		}
	}
	return reqs, nil
}

// releaseVolumes tears a destroyed task's volumes down. When the plugin
// cannot do it now, the lifecycle keeps retrying in the background and
// reports through the task's events.
func (d *Driver) releaseVolumes(h *taskHandle) {
	id := h.config.ID
	if !h.volumes {
		d.eventTargets.Delete(id)
		return
	}
	if err := d.teardownVolumes(id); err != nil {
		h.logger.Warn("volumes not torn down yet; retrying in the background", "error", err)
		return
	}
	d.eventTargets.Delete(id)
}

// forgetLostTask releases what a task that cannot be recovered held: its
// volumes (torn down in the background when the plugin is not there yet)
// and its state directory.
func (d *Driver) forgetLostTask(logger hclog.Logger, cfg *drivers.TaskConfig, volumes bool) {
	d.invocations.settled(cfg.ID)
	conf := d.currentConfig()
	if conf == nil {
		return
	}
	if volumes {
		d.eventTargets.Store(cfg.ID, cfg)
		if err := d.teardownVolumes(cfg.ID); err != nil {
			logger.Warn("volumes of a lost task not torn down yet; retrying in the background", "error", err)
		}
	}
	_ = os.RemoveAll(conf.taskStateDir(cfg.ID))
}
