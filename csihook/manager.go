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
	"sort"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// Manager stages and publishes CSI volumes for tasks. Its methods are safe
// for concurrent use; operations on one volume are serialised, operations
// on different volumes run in parallel.
type Manager struct {
	cfg     Config
	logger  hclog.Logger
	journal *journal
	locks   *keyLocks

	// dirs orders making our directories under the stage root against
	// removing the empty ones: another volume's release must not remove a
	// plugin's staging directory between MkdirAll making it and making the
	// volume's directory in it. Held only around those file calls.
	dirs sync.Mutex

	// mu guards the maps and closed; it is never held across a call to a
	// plugin, the journal or the mounter.
	mu sync.Mutex
	// reserved counts, per volume, the setups between checkVolumeLimit and
	// their end: volumes about to come to the node count as there.
	reserved map[volKey]int
	vols     map[volKey]volRecord
	tasks    map[string]map[string]taskRecord
	clients  map[string]Client
	workers  map[string]bool
	// verified holds the volumes whose staging this process made or saw
	// mounted; a staged volume loaded from the journal is staged again
	// (idempotent) before use unless its staging path is a mount point,
	// so that after a reboot nothing is published from an empty directory.
	verified map[volKey]bool
	// unreleased holds, per task, the volumes whose unstage or detach
	// failed after the task's record was dropped, by the task's name for
	// each: no record names them for the task any more, so this is what
	// makes a retried teardown of the task try them again.
	unreleased map[string]map[volKey]string
	closed     bool
	// stats is the stats loop (stats.go); nil until StartStats.
	stats *statsLoop
	// repairing holds the task volumes (repairKey) whose repair unmounted
	// them but did not publish them again yet: see repair.go.
	repairing map[string]bool
	// staleChecks holds the paths whose stat by a repair has not returned
	// (a hung network mount): they are not stat'ed again meanwhile.
	staleChecks sync.Map

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// New checks cfg, creates Root and the journal directory, and loads the
// journal, so that Teardown works for tasks set up before a restart. Call
// Recover once the driver knows which tasks are still alive.
func New(cfg Config) (*Manager, error) {
	if cfg.Root == "" || !filepath.IsAbs(cfg.Root) {
		return nil, fmt.Errorf("volume root %q must be an absolute path", cfg.Root)
	}
	cfg.Root = filepath.Clean(cfg.Root)
	if cfg.JournalDir == "" {
		cfg.JournalDir = filepath.Join(cfg.Root, "journal")
	}
	if !filepath.IsAbs(cfg.JournalDir) {
		return nil, fmt.Errorf("journal directory %q must be an absolute path", cfg.JournalDir)
	}
	if cfg.Lookup == nil {
		return nil, errors.New("a plugin lookup function is required")
	}
	if cfg.Dial == nil {
		cfg.Dial = DialUnix
	}
	if cfg.Mounter == nil {
		cfg.Mounter = mounter.New()
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if cfg.NodeName == "" {
		cfg.NodeName, _ = os.Hostname()
	}
	setDefault(&cfg.PluginWait, defaultPluginWait)
	setDefault(&cfg.RPCTimeout, defaultRPCTimeout)
	setDefault(&cfg.RetryBase, defaultRetryBase)
	setDefault(&cfg.RetryMax, defaultRetryMax)
	setDefault(&cfg.BackgroundRetryBase, defaultBackgroundRetryBase)
	setDefault(&cfg.BackgroundRetryMax, defaultBackgroundRetryMax)
	if cfg.RetryAttempts <= 0 {
		cfg.RetryAttempts = defaultRetryAttempts
	}
	for _, dir := range []string{cfg.Root, filepath.Join(cfg.Root, "staging"), filepath.Join(cfg.Root, "publish")} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("failed to create volume directory %q: %w", dir, err)
		}
	}
	logger := cfg.Logger.Named("csihook")
	j, err := openJournal(cfg.JournalDir, logger)
	if err != nil {
		return nil, err
	}
	vols, tasks := j.records()
	m := &Manager{
		cfg:        cfg,
		logger:     logger,
		journal:    j,
		locks:      newKeyLocks(),
		vols:       map[volKey]volRecord{},
		tasks:      map[string]map[string]taskRecord{},
		clients:    map[string]Client{},
		workers:    map[string]bool{},
		verified:   map[volKey]bool{},
		unreleased: map[string]map[volKey]string{},
	}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	for _, v := range vols {
		m.vols[v.key()] = v
	}
	for _, t := range tasks {
		if m.tasks[t.TaskID] == nil {
			m.tasks[t.TaskID] = map[string]taskRecord{}
		}
		m.tasks[t.TaskID][t.Name] = t
	}
	if len(vols)+len(tasks) > 0 {
		logger.Info("loaded volume journal", "volumes", len(vols), "task_volumes", len(tasks))
	}
	return m, nil
}

func setDefault(d *time.Duration, def time.Duration) {
	if *d <= 0 {
		*d = def
	}
}

// Close stops background retries and closes plugin connections. What is
// left to tear down stays in the journal for the next Recover. Call it
// after every Setup and Teardown has returned.
func (m *Manager) Close() {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return
	}
	m.closed = true
	m.mu.Unlock()
	m.cancel()
	m.wg.Wait()
	m.mu.Lock()
	for socket, c := range m.clients {
		c.Close()
		delete(m.clients, socket)
	}
	m.mu.Unlock()
	m.journal.close()
}

// WaitIdle waits until no background retry or recovery is running.
func (m *Manager) WaitIdle(ctx context.Context) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		m.mu.Lock()
		n := len(m.workers)
		m.mu.Unlock()
		if n == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// StagingPath is where a volume of a plugin is staged on this node.
func (m *Manager) StagingPath(pluginID, volumeID string) string {
	dir := pluginID
	if !safeName.MatchString(dir) {
		dir = "h-" + ShortHash(pluginID)
	}
	return filepath.Join(m.cfg.Root, "staging", dir, ShortHash(volumeID))
}

// TargetPath is where a task's volume is published on this node.
func (m *Manager) TargetPath(taskID, name string) string {
	return filepath.Join(m.taskDir(taskID), name)
}

func (m *Manager) taskDir(taskID string) string {
	return filepath.Join(m.cfg.Root, "publish", ShortHash(taskID))
}

// Users returns how many task volumes use a volume on this node.
func (m *Manager) Users(pluginID, volumeID string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.usersLocked(volKey{pluginID, volumeID})
}

func (m *Manager) usersLocked(k volKey) int {
	n := 0
	for _, recs := range m.tasks {
		for _, t := range recs {
			if t.key() == k {
				n++
			}
		}
	}
	return n
}

func (m *Manager) users(k volKey) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.usersLocked(k)
}

// usersAfter is users once the task record drops among ops are applied.
func (m *Manager) usersAfter(k volKey, ops []journalOp) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := m.usersLocked(k)
	for _, o := range ops {
		if t, ok := m.tasks[o.TaskID][o.Name]; ok && o.Op == opDropTask && t.key() == k {
			n--
		}
	}
	return n
}

// Tasks returns the IDs of the tasks this node's journal holds volumes
// for: published ones, and those whose volumes are still to be released,
// sorted.
func (m *Manager) Tasks() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	seen := map[string]bool{}
	for id, recs := range m.tasks {
		if len(recs) > 0 {
			seen[id] = true
		}
	}
	for id, keys := range m.unreleased {
		if len(keys) > 0 {
			seen[id] = true
		}
	}
	return slices.Sorted(maps.Keys(seen))
}

// PluginServers returns who served a plugin id (PluginInfo.Server) when
// the volumes of it recorded on this node were set up, each once, sorted.
// Volumes recorded without a server (set up before servers were kept)
// add nothing. A plugin id with recorded volumes should only be served by
// what set them up, until they are released: their teardown calls, with
// their secrets, go to whoever serves the id.
func (m *Manager) PluginServers(pluginID string) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	seen := map[string]bool{}
	var out []string
	for k, v := range m.vols {
		if k.plugin == pluginID && v.Server != "" && !seen[v.Server] {
			seen[v.Server] = true
			out = append(out, v.Server)
		}
	}
	sort.Strings(out)
	return out
}

// Owner returns the Nomad namespace a volume of this node belongs to, if
// one is recorded.
func (m *Manager) Owner(pluginID, volumeID string) (string, bool) {
	return m.journal.owner(pluginID, volumeID)
}

func (m *Manager) event(taskID, msg string, ann map[string]string) {
	if taskID == "" {
		// Recovery's work on a volume no task of this process knows.
		m.logger.Info("volume event", "event", msg)
		return
	}
	m.logger.Info("task event", "task_id", taskID, "event", msg)
	if m.cfg.Events != nil {
		m.cfg.Events(taskID, msg, ann)
	}
}

func annotations(name, pluginID, volumeID string) map[string]string {
	return map[string]string{"volume": name, "plugin_id": pluginID, "volume_id": volumeID}
}

// commit writes ops to the journal as one batch, then applies them to the
// manager's records. The caller holds the lock of every volume the ops
// name.
func (m *Manager) commit(ops ...journalOp) error {
	if err := m.journal.commit(ops...); err != nil {
		return err
	}
	m.apply(ops)
	return nil
}

// commitLazy is commit without waiting for the disk (journal.commitLazy),
// for the result of a call after which no other call follows in the same
// operation: the last record of a Setup or a release. Its call's "-ing"
// record is durable, so a result lost with a crash of the host leaves the
// call uncertain, and recovery calls again.
func (m *Manager) commitLazy(ops ...journalOp) error {
	if err := m.journal.commitLazy(ops...); err != nil {
		return err
	}
	m.apply(ops)
	return nil
}

func (m *Manager) apply(ops []journalOp) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, o := range ops {
		switch o.Op {
		case opPutVol:
			m.vols[o.Vol.key()] = *o.Vol
		case opDropVol:
			delete(m.vols, volKey{o.PluginID, o.VolumeID})
		case opPutTask:
			if m.tasks[o.Task.TaskID] == nil {
				m.tasks[o.Task.TaskID] = map[string]taskRecord{}
			}
			m.tasks[o.Task.TaskID][o.Task.Name] = *o.Task
		case opDropTask:
			delete(m.tasks[o.TaskID], o.Name)
			if len(m.tasks[o.TaskID]) == 0 {
				delete(m.tasks, o.TaskID)
			}
		}
	}
}

func (m *Manager) vol(k volKey) (volRecord, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	v, ok := m.vols[k]
	return v, ok
}

func (m *Manager) taskRec(taskID, name string) (taskRecord, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t, ok := m.tasks[taskID][name]
	return t, ok
}

// taskRecs returns a task's records, the last set up first.
func (m *Manager) taskRecs(taskID string) []taskRecord {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]taskRecord, 0, len(m.tasks[taskID]))
	for _, t := range m.tasks[taskID] {
		out = append(out, t)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Seq != out[j].Seq {
			return out[i].Seq > out[j].Seq
		}
		return out[i].Name > out[j].Name
	})
	return out
}

// client returns the cached client of a socket, dialling it on first use.
func (m *Manager) client(socket string) (Client, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, errors.New("volume manager is closed")
	}
	if c, ok := m.clients[socket]; ok {
		return c, nil
	}
	c, err := m.cfg.Dial(socket)
	if err != nil {
		return nil, err
	}
	m.pruneClientsLocked()
	m.clients[socket] = c
	return c, nil
}

// pruneClientsLocked closes the cached clients whose socket is gone: a
// plugin task that ended removed it, and a new one dials its own. Run on
// each new dial, so the cache holds no more than the sockets that exist
// plus those dialled since.
func (m *Manager) pruneClientsLocked() {
	for socket, c := range m.clients {
		if _, err := os.Lstat(socket); errors.Is(err, fs.ErrNotExist) {
			_ = c.Close()
			delete(m.clients, socket)
		}
	}
}

type pluginError struct{ msg string }

func (e *pluginError) Error() string        { return e.msg }
func (e *pluginError) Is(target error) bool { return target == ErrPluginNotFound }

// awaitPlugins waits, up to PluginWait and within ctx, until every plugin
// reqs name is healthy, telling the task once per plugin that it waits.
// Whatever the outcome, preflight then judges the plugins.
func (m *Manager) awaitPlugins(ctx context.Context, taskID string, reqs []VolumeRequest) {
	if m.cfg.PluginWait <= 0 {
		return
	}
	deadline := time.NewTimer(m.cfg.PluginWait)
	defer deadline.Stop()
	told := map[string]bool{}
	for _, req := range reqs {
		for {
			_, err := m.lookupHealthy(req.PluginID)
			if err == nil {
				break
			}
			if !told[req.PluginID] {
				told[req.PluginID] = true
				m.event(taskID, fmt.Sprintf("Waiting up to %s for CSI plugin %q: %v", roundDuration(m.cfg.PluginWait), req.PluginID, err), nil)
			}
			select {
			case <-ctx.Done():
				return
			case <-m.ctx.Done():
				return
			case <-deadline.C:
				return
			case <-time.After(pluginPollInterval):
			}
		}
	}
}

// pluginPollInterval is how often awaitPlugins asks again.
const pluginPollInterval = 200 * time.Millisecond

// lookupHealthy finds a plugin for Setup: it must be known and healthy.
func (m *Manager) lookupHealthy(id string) (PluginInfo, error) {
	info, err := m.cfg.Lookup(id)
	switch {
	case err != nil:
		return info, &pluginError{fmt.Sprintf("CSI plugin %q is not running on node %q (%v): start the plugin's job or fix plugin_id", id, m.cfg.NodeName, err)}
	case !info.Healthy:
		desc := info.HealthDescription
		if desc == "" {
			desc = "unhealthy"
		}
		return info, &pluginError{fmt.Sprintf("CSI plugin %q on node %q is not healthy (%s): wait for it to become healthy or check its task", id, m.cfg.NodeName, desc)}
	case info.Socket == "":
		return info, &pluginError{fmt.Sprintf("CSI plugin %q on node %q has no socket yet: wait for it to become healthy", id, m.cfg.NodeName)}
	}
	return info, nil
}

// clients returns the node and controller clients of a plugin for an
// operation, or an Unavailable OpError when the plugin cannot be reached.
// Teardown uses unhealthy plugins too: the call may still work.
func (m *Manager) pluginClients(o op) (PluginInfo, Client, Client, error) {
	info, err := m.cfg.Lookup(o.pluginID)
	if err != nil || info.Socket == "" {
		return info, nil, nil, unreachable(o, fmt.Sprintf("CSI plugin %q is not running on node %q", o.pluginID, m.cfg.NodeName))
	}
	if info.ControllerOnly && nodeMethod(o.method) {
		// Whatever serves the id now does not run the Node service: the
		// volume's staging and publishing never go there.
		return info, nil, nil, unreachable(o, fmt.Sprintf("CSI plugin %q on node %q is a controller plugin without the CSI Node service", o.pluginID, m.cfg.NodeName))
	}
	node, err := m.client(info.Socket)
	if err != nil {
		return info, nil, nil, unreachable(o, fmt.Sprintf("cannot connect to CSI plugin %q at %q: %v", o.pluginID, info.Socket, err))
	}
	ctrl := node
	if info.ControllerSocket != "" {
		if ctrl, err = m.client(info.ControllerSocket); err != nil {
			return info, nil, nil, unreachable(o, fmt.Sprintf("cannot connect to CSI plugin %q at %q: %v", o.pluginID, info.ControllerSocket, err))
		}
	}
	return info, node, ctrl, nil
}

// nodeMethod reports whether a method is one of the CSI Node service.
func nodeMethod(method string) bool {
	switch method {
	case MethodNodeGetInfo, MethodNodeStageVolume, MethodNodeUnstageVolume, MethodNodePublishVolume, MethodNodeUnpublishVolume, MethodNodeExpandVolume:
		return true
	}
	return false
}

type plan struct {
	seq  int
	req  VolumeRequest
	info PluginInfo
	// reserved is the volume checkVolumeLimit reserved for this plan, if
	// any: released by that key, whatever the volume's id becomes.
	reserved *volKey
}

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

// preflight looks up every plugin and checks capabilities and sharing
// before anything is written or called, so that a request that cannot
// work leaves nothing behind.
func (m *Manager) preflight(taskID string, reqs []VolumeRequest) ([]plan, error) {
	var (
		errs  []error
		plans []plan
	)
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
		if err := m.checkNamespace(req, id); err != nil {
			errs = append(errs, err)
		}
		if err := m.checkShare(taskID, req, id); err != nil {
			errs = append(errs, err)
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
	return &namespaceError{fmt.Sprintf("volume %q: %s of CSI plugin %q belongs to namespace %q on node %q (the namespace that created or first used it), not to namespace %q: run the job in namespace %q, or have the operator set allow_cross_namespace_volumes = true in the driver's plugin config",
		req.Name, id, req.PluginID, owner, m.cfg.NodeName, req.Namespace, owner)}
}

// claimOwner returns the op that records the request's namespace as the
// volume's owner, or nothing when it has one or the request has no
// namespace.
func (m *Manager) claimOwner(req VolumeRequest, volumeID string) []journalOp {
	if req.Namespace == "" {
		return nil
	}
	if _, ok := m.journal.owner(req.PluginID, volumeID); ok {
		return nil
	}
	return []journalOp{ownerPut(ownerRecord{PluginID: req.PluginID, VolumeID: volumeID, Namespace: req.Namespace})}
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
	var other string
	for tid, recs := range m.tasks {
		if tid == taskID {
			continue
		}
		for _, t := range recs {
			if t.key() == k {
				other = tid
			}
		}
	}
	if other == "" {
		return nil
	}
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
	return nil
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
	unlock, err := m.locks.lock(ctx, k.String())
	if err != nil {
		return Published{}, fmt.Errorf("gave up waiting for another operation on volume %q (volume_id %q, plugin %q) to finish: %w",
			req.Name, volumeID, req.PluginID, err)
	}
	defer unlock()
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
	pub := Published{Name: req.Name, HostPath: target, Destination: req.Destination,
		ReadOnly: req.ReadOnly || !writerMode(req.AccessMode), Block: attachment(req) == AttachmentBlockDevice}

	tr, ok := m.taskRec(taskID, req.Name)
	if ok && tr.key() != k {
		return Published{}, invalidf("volume %q: task %q already uses this name for volume_id %q", req.Name, taskID, tr.VolumeID)
	}
	if ok && tr.State == phasePublished {
		if mounted, err := m.cfg.Mounter.IsMountPoint(target); err == nil && mounted {
			m.logger.Debug("volume already published", "task_id", taskID, "volume", req.Name, "volume_id", volumeID, "target_path", target)
			return pub, nil
		}
	}

	vol, ok := m.vol(k)
	if ok && m.users(k) == 0 && (vol.AccessMode != req.AccessMode || vol.AttachmentMode != attachment(req) || vol.FSType != req.FSType || vol.MountGroup != req.MountGroup) {
		// Left over with another capability and nobody using it: take it
		// down before staging it anew.
		if err := m.releaseLocked(ctx, taskID, req.Name, k, nil); err != nil {
			return Published{}, err
		}
		ok = false
	}
	if ok && len(vol.Secrets) == 0 {
		// The log keeps secrets only while a call needs them: loaded
		// after a restart, a staged volume has none, and staging it
		// again takes the request's.
		vol.Secrets = req.Secrets
	}
	// New records go out in one batch with the first record of a call,
	// before that call: nothing is called for the volume until then. The
	// first namespace to use the volume becomes its owner with them.
	pending := m.claimOwner(req, volumeID)
	if !ok {
		vol = volRecord{
			PluginID: req.PluginID, VolumeID: volumeID, StagingPath: m.StagingPath(req.PluginID, volumeID),
			AccessMode: req.AccessMode, AttachmentMode: attachment(req), FSType: req.FSType,
			MountFlags: req.MountFlags, VolumeContext: vctx, Secrets: req.Secrets, Server: info.Server,
			MountGroup: req.MountGroup, HadSecrets: len(req.Secrets) > 0,
		}
		pending = append(pending, volPut(vol))
	} else if vol.Server == "" && info.Server != "" {
		// Recorded before servers were kept: what serves the id now set
		// it up as far as anyone can tell.
		vol.Server = info.Server
		pending = append(pending, volPut(vol))
	}
	if existing, ok := m.taskRec(taskID, req.Name); ok {
		tr = existing
	} else {
		tr = taskRecord{
			TaskID: taskID, Name: req.Name, Seq: p.seq, PluginID: req.PluginID, VolumeID: volumeID,
			Target: target, Destination: req.Destination, ReadOnly: pub.ReadOnly,
			AccessMode: req.AccessMode, AttachmentMode: attachment(req), FSType: req.FSType,
			MountFlags: req.MountFlags, VolumeContext: vctx, Secrets: req.Secrets, HadSecrets: len(req.Secrets) > 0,
			MountGroup: req.MountGroup, ApplyGroup: req.applyGroup,
			// The intent to publish goes out with the volume's first
			// record, so that no commit waits between the calls.
			State: phasePublishing, notCalled: true,
		}
		// Once written the task counts as a user: nobody unstages under
		// it.
		pending = append(pending, taskPut(tr))
	}
	if vol, pending, err = m.ensureVolume(ctx, taskID, req.Name, info, vol, false, pending); err != nil {
		return Published{}, err
	}
	if err := m.ensurePublished(ctx, info, vol, tr, pending); err != nil {
		return Published{}, err
	}
	if err := m.expandNode(ctx, taskID, req, info, o, vol, tr); err != nil {
		return Published{}, err
	}
	return pub, nil
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
func (m *Manager) ensureVolume(ctx context.Context, taskID, name string, info PluginInfo, vol volRecord, restage bool, pending []journalOp) (volRecord, []journalOp, error) {
	o := op{taskID: taskID, name: name, pluginID: vol.PluginID, volumeID: vol.VolumeID, nodeID: vol.NodeID,
		secrets: []map[string]string{vol.Secrets}}
	ann := annotations(name, vol.PluginID, vol.VolumeID)
	vc := capability(vol.AccessMode, vol.AttachmentMode, vol.FSType, vol.MountFlags)
	stageVC := withGroup(capability(vol.AccessMode, vol.AttachmentMode, vol.FSType, vol.MountFlags), vol.MountGroup)
	needCtrl := info.ControllerPublish || vol.Controller != phaseNone
	needStage := info.StageUnstage || vol.Stage != phaseNone
	if vol.Stage == phaseStaged && !restage && !m.isVerified(vol.key()) {
		if ok, err := m.cfg.Mounter.IsMountPoint(vol.StagingPath); err == nil && ok {
			m.setVerified(vol.key(), true)
		} else {
			m.logger.Info("staging from before a restart not found mounted; staging again", "plugin_id", vol.PluginID,
				"volume_id", vol.VolumeID, "staging_path", vol.StagingPath)
			restage = true
		}
	}
	if (!needCtrl || vol.Controller == phasePublished) && (!needStage || (vol.Stage == phaseStaged && !restage)) {
		return vol, pending, nil
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
		m.event(taskID, fmt.Sprintf("Attaching volume %q", name), ann)
		o.method = MethodControllerPublishVolume
		var pctx map[string]string
		err := m.call(ctx, o, func(ctx context.Context) error {
			resp, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
				VolumeId: vol.VolumeID, NodeId: vol.NodeID, VolumeCapability: vc,
				Readonly: !writerMode(vol.AccessMode), Secrets: vol.Secrets, VolumeContext: vol.VolumeContext,
			})
			pctx = resp.GetPublishContext()
			return err
		})
		if err != nil {
			return vol, nil, err
		}
		vol.PublishContext, vol.Controller = pctx, phasePublished
		pending = []journalOp{volPut(vol)}
	}

	if needStage && (vol.Stage != phaseStaged || restage) {
		if err := m.makeDir(vol.StagingPath); err != nil {
			return vol, pending, fmt.Errorf("failed to create staging directory %q for volume %q: %w", vol.StagingPath, name, err)
		}
		vol.Stage = phaseStaging
		if err := m.commit(append(pending, volPut(vol))...); err != nil {
			return vol, nil, err
		}
		pending = nil
		m.event(taskID, fmt.Sprintf("Staging volume %q", name), ann)
		o.method, o.path = MethodNodeStageVolume, vol.StagingPath
		err := m.call(ctx, o, func(ctx context.Context) error {
			_, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
				VolumeId: vol.VolumeID, PublishContext: vol.PublishContext, StagingTargetPath: vol.StagingPath,
				VolumeCapability: stageVC, Secrets: vol.Secrets, VolumeContext: vol.VolumeContext,
			})
			return err
		})
		if err != nil {
			return vol, nil, err
		}
		vol.Stage = phaseStaged
		pending = []journalOp{volPut(vol)}
		m.setVerified(vol.key(), true)
	}
	return vol, pending, nil
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
// The caller holds the volume's lock.
func (m *Manager) ensurePublished(ctx context.Context, info PluginInfo, vol volRecord, tr taskRecord, pending []journalOp) error {
	o := op{method: MethodNodePublishVolume, taskID: tr.TaskID, name: tr.Name, pluginID: tr.PluginID,
		volumeID: tr.VolumeID, nodeID: vol.NodeID, path: tr.Target, secrets: []map[string]string{tr.Secrets}}
	_, node, _, err := m.pluginClients(o)
	if err != nil {
		return err
	}
	// The CO makes the parent; the plugin makes the target (CSI spec).
	if err := m.makeDir(filepath.Dir(tr.Target)); err != nil {
		return fmt.Errorf("failed to create the publish directory of volume %q: %w", tr.Name, err)
	}
	// The intent is durable already when it went out with the volume's
	// first record; the results before this call then go out with this
	// call's.
	if cur, ok := m.taskRec(tr.TaskID, tr.Name); ok && cur.State == phasePublishing {
		tr = cur
		tr.notCalled = false
		m.apply([]journalOp{taskPut(tr)})
	} else {
		tr.State, tr.notCalled = phasePublishing, false
		if err := m.commit(append(pending, taskPut(tr))...); err != nil {
			return err
		}
		pending = nil
	}
	staging := ""
	if vol.Stage == phaseStaged {
		staging = vol.StagingPath
	}
	err = m.call(ctx, o, func(ctx context.Context) error {
		_, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: tr.VolumeID, PublishContext: vol.PublishContext, StagingTargetPath: staging,
			TargetPath: tr.Target, VolumeCapability: withGroup(capability(tr.AccessMode, tr.AttachmentMode, tr.FSType, tr.MountFlags), tr.MountGroup),
			Readonly: tr.ReadOnly, Secrets: tr.Secrets, VolumeContext: tr.VolumeContext,
		})
		return err
	})
	if err != nil {
		return err
	}
	// Creating target_path is the plugin's job (CSI spec); a plugin that
	// answers OK without it did not publish anything, and the task must
	// not start on an empty directory of ours.
	if _, err := m.cfg.Mounter.IsMountPoint(tr.Target); errors.Is(err, fs.ErrNotExist) {
		return &OpError{Method: o.method, Volume: o.name, VolumeID: o.volumeID, PluginID: o.pluginID, Code: codes.Internal,
			Message: fmt.Sprintf("the plugin reported success but did not create the target path %q, which the CSI spec leaves to the plugin", tr.Target),
			Hint: fmt.Sprintf("plugin %q did not publish the volume on this node (a mock plugin does not); check the plugin's logs, "+
				"or use a plugin that mounts volumes at target_path", o.pluginID)}
	}
	if tr.ApplyGroup != "" {
		if err := applyVolumeGroup(tr.Target, tr.ApplyGroup); err != nil {
			return fmt.Errorf("volume %q: mount_group = true: %w", tr.Name, err)
		}
	}
	tr.State = phasePublished
	if err := m.commitLazy(append(pending, taskPut(tr))...); err != nil {
		return err
	}
	m.event(tr.TaskID, fmt.Sprintf("Published volume %q at %s", tr.Name, tr.Destination), annotations(tr.Name, tr.PluginID, tr.VolumeID))
	return nil
}

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
		return fmt.Errorf("gave up waiting for another operation on volume %q (volume_id %q, plugin %q) to finish: %w",
			name, tr.VolumeID, tr.PluginID, err)
	}
	defer unlock()
	if tr, ok = m.taskRec(taskID, name); !ok {
		return nil
	}
	drop, err := m.unpublishLocked(ctx, tr)
	if err != nil {
		return err
	}
	if err := m.releaseLocked(ctx, taskID, name, tr.key(), drop); err != nil {
		if _, ok := m.taskRec(taskID, name); !ok {
			// The drop went out with the volume's "unstaging" or
			// "unpublishing": remember the volume for the retry.
			m.setUnreleased(taskID, tr.key(), name)
		}
		return err
	}
	return nil
}

// releaseAgain retries the release of a volume a task no longer has a
// record of. Nothing is called when another task uses the volume by now
// or its record is gone.
func (m *Manager) releaseAgain(ctx context.Context, taskID, name string, k volKey) error {
	unlock, err := m.locks.lock(ctx, k.String())
	if err != nil {
		return fmt.Errorf("gave up waiting for another operation on volume %q (volume_id %q, plugin %q) to finish: %w",
			name, k.volume, k.plugin, err)
	}
	defer unlock()
	if err := m.releaseLocked(ctx, taskID, name, k, nil); err != nil {
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
// uncertain and the task as a user of the volume. The caller holds the
// volume's lock.
func (m *Manager) unpublishLocked(ctx context.Context, tr taskRecord) ([]journalOp, error) {
	if tr.State != phasePending && !tr.notCalled {
		o := op{method: MethodNodeUnpublishVolume, taskID: tr.TaskID, name: tr.Name, pluginID: tr.PluginID,
			volumeID: tr.VolumeID, path: tr.Target, notFoundOK: true, secrets: []map[string]string{tr.Secrets}}
		if tr.State != phaseUnpublishing {
			tr.State = phaseUnpublishing
			if err := m.commit(taskPut(tr)); err != nil {
				return nil, err
			}
		}
		_, node, _, err := m.pluginClients(o)
		if err != nil {
			return nil, err
		}
		m.event(tr.TaskID, fmt.Sprintf("Unpublishing volume %q", tr.Name), annotations(tr.Name, tr.PluginID, tr.VolumeID))
		err = m.call(ctx, o, func(ctx context.Context) error {
			_, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: tr.VolumeID, TargetPath: tr.Target})
			return err
		})
		if err != nil {
			return nil, err
		}
		if err := m.checkGone(o, tr.Target); err != nil {
			return nil, err
		}
		m.logger.Info("volume unpublished", "task_id", tr.TaskID, "volume", tr.Name, "plugin_id", tr.PluginID,
			"volume_id", tr.VolumeID, "target_path", tr.Target)
	}
	return []journalOp{taskDrop(tr.TaskID, tr.Name)}, nil
}

// releaseLocked unstages and detaches a volume when no task on this node
// uses it any more, and drops its record. pending are task record drops
// not written yet: they go out with the record before the first call, or
// on their own, and the tasks they drop no longer count as users. The
// result of a call is written with the record of the next call. The
// caller holds the volume's lock.
func (m *Manager) releaseLocked(ctx context.Context, taskID, name string, k volKey, pending []journalOp) error {
	vol, ok := m.vol(k)
	if !ok || m.usersAfter(k, pending) > 0 {
		return m.commitLazy(pending...)
	}
	o := op{taskID: taskID, name: name, pluginID: vol.PluginID, volumeID: vol.VolumeID, nodeID: vol.NodeID,
		notFoundOK: true, secrets: []map[string]string{vol.Secrets}}
	ann := annotations(name, vol.PluginID, vol.VolumeID)
	if vol.Stage != phaseNone {
		o.method, o.path = MethodNodeUnstageVolume, vol.StagingPath
		if vol.Stage != phaseUnstaging {
			vol.Stage = phaseUnstaging
			pending = append(pending, volPut(vol))
		}
		if err := m.commit(pending...); err != nil {
			return err
		}
		pending = nil
		_, node, _, err := m.pluginClients(o)
		if err != nil {
			return err
		}
		m.event(taskID, fmt.Sprintf("Unstaging volume %q", name), ann)
		err = m.call(ctx, o, func(ctx context.Context) error {
			_, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.VolumeID, StagingTargetPath: vol.StagingPath})
			return err
		})
		if err != nil {
			return err
		}
		if err := m.checkGone(o, vol.StagingPath); err != nil {
			return err
		}
		vol.Stage = phaseNone
		pending = append(pending, volPut(vol))
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
				return err
			}
			pending = nil
			_, _, ctrl, err := m.pluginClients(o)
			if err != nil {
				return err
			}
			m.event(taskID, fmt.Sprintf("Detaching volume %q", name), ann)
			err = m.call(ctx, o, func(ctx context.Context) error {
				_, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{
					VolumeId: vol.VolumeID, NodeId: vol.NodeID, Secrets: vol.Secrets,
				})
				return err
			})
			if err != nil {
				return err
			}
		}
	}
	if err := m.commitLazy(append(pending, volDrop(k))...); err != nil {
		return err
	}
	m.setVerified(k, false)
	m.removeIfEmpty(filepath.Dir(vol.StagingPath))
	m.logger.Info("volume released on this node", "task_id", taskID, "plugin_id", vol.PluginID, "volume_id", vol.VolumeID)
	return nil
}

// checkGone makes sure the plugin really took its mount away from path
// after it said so, then removes what the plugin left of path when it is
// empty. A path still mounted is an Internal failure, retried like others.
func (m *Manager) checkGone(o op, path string) error {
	mounted, err := m.cfg.Mounter.IsMountPoint(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		m.logger.Warn("cannot check mount", "path", path, "error", err)
	}
	if err == nil && mounted {
		return &OpError{Method: o.method, Volume: o.name, VolumeID: o.volumeID, PluginID: o.pluginID, Code: codes.Internal,
			Message: fmt.Sprintf("the plugin reported success but %q is still mounted", path),
			Hint:    hint(o.method, codes.Internal, o.volumeID, o.pluginID, "")}
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		m.logger.Warn("left a path the plugin did not remove", "path", path, "error", err)
	}
	return nil
}

// makeDir makes a directory of ours under the stage root, with its
// parents, never while an empty parent is being removed.
func (m *Manager) makeDir(dir string) error {
	m.dirs.Lock()
	defer m.dirs.Unlock()
	return os.MkdirAll(dir, 0o750)
}

// removeIfEmpty removes a directory of ours once nothing is left in it.
func (m *Manager) removeIfEmpty(dir string) {
	m.dirs.Lock()
	defer m.dirs.Unlock()
	_ = os.Remove(dir)
}

// summary is the first line of a failure for an event.
func summary(err error) string {
	if oes := opErrors(err); len(oes) > 0 {
		e := oes[0]
		msg := fmt.Sprintf("%s %q failed (%s", gerund(e.Method), e.Volume, e.Code)
		if e.Message != "" {
			msg += ": " + e.Message
		}
		return msg + ")"
	}
	return fmt.Sprintf("Tearing down volumes failed (%v)", err)
}

// opErrors returns every OpError in err's tree.
func opErrors(err error) []*OpError {
	var out []*OpError
	var walk func(error)
	walk = func(err error) {
		if err == nil {
			return
		}
		if oe, ok := err.(*OpError); ok {
			out = append(out, oe)
			return
		}
		switch u := err.(type) {
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				walk(e)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}
