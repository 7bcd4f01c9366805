package csihook

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

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

	// mu guards the maps and closed. It is the journal's lock (journal.mu):
	// vols and tasks are the journal's records (journalState), which a
	// commit changes once its batch is written, with the log's lock held
	// and then mu. So mu is never held across a call to a plugin, the
	// journal or the mounter.
	mu *sync.Mutex
	// reserved counts, per volume, the setups between checkVolumeLimit and
	// their end: volumes about to come to the node count as there.
	reserved map[volKey]int
	// vols and tasks (by task id, then volume name) are the journal's
	// live records, held once: changed only by the journal's commits
	// (Manager.commit), read under mu.
	vols  map[volKey]volRecord
	tasks map[string]map[string]taskRecord
	// byVolume are the task records of each volume (journalState.byVolume).
	byVolume map[volKey][]taskRef
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
	// expandHeld holds the volumes whose NodeExpandVolume answered
	// FailedPrecondition (cannot grow while staged or published): not
	// asked again until the volume is released, as the CSI spec says; the
	// node's part stays owed for its next staging (see expandNode).
	expandHeld map[volKey]bool
	closed     bool
	// stats is the stats loop (stats.go); nil until StartStats.
	stats *statsLoop
	// repairs holds what the repairs of each task volume remember between
	// passes (repairState, see repair.go). Its entries leave with their
	// task records (forgetRepairLocked).
	repairs map[taskRef]repairState
	// returned holds the plugins that became healthy again
	// (ResetRepairBackoff) since a repair pass last checked all their
	// volumes: a dead mount such a pass finds died with the plugin's
	// restart, and the task is told so. Each return is numbered
	// (returns counts them): a pass forgets only the returns it saw
	// before it began, never one that came while it ran, which may
	// have killed volumes the pass had already found alive. Guarded by
	// mu.
	returned map[string]uint64
	returns  uint64
	// now is the repairs' clock (their back-off); time.Now but in tests.
	now func() time.Time
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
	setDefault(&cfg.RepairBackoffBase, defaultRepairBackoffBase)
	setDefault(&cfg.RepairBackoffMax, defaultRepairBackoffMax)
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
	m := &Manager{
		cfg:        cfg,
		logger:     logger,
		journal:    j,
		locks:      newKeyLocks(),
		mu:         j.mu,
		vols:       j.state.vols,
		tasks:      j.state.tasks,
		byVolume:   j.state.byVolume,
		clients:    map[string]Client{},
		workers:    map[string]bool{},
		verified:   map[volKey]bool{},
		unreleased: map[string]map[volKey]string{},
		expandHeld: map[volKey]bool{},
		repairs:    map[taskRef]repairState{},
		returned:   map[string]uint64{},
		now:        time.Now,
	}
	j.mu.Lock()
	j.state.dropped = m.forgetRepairLocked
	j.mu.Unlock()
	m.ctx, m.cancel = context.WithCancel(context.Background())
	if vols, tasks := m.counts(); vols+tasks > 0 {
		logger.Info("loaded volume journal", "volumes", vols, "task_volumes", tasks)
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

// Users returns how many task volumes use a volume on this node. Nothing
// in the driver decides by it: it is how the driver package's tests see a
// volume's users (what releases it) from outside this package.
func (m *Manager) Users(pluginID, volumeID string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.usersLocked(volKey{pluginID, volumeID})
}

func (m *Manager) usersLocked(k volKey) int { return len(m.byVolume[k]) }

// otherUsersLocked returns the task records of volume k of tasks other
// than taskID, sorted. The caller holds m.mu.
func (m *Manager) otherUsersLocked(k volKey, taskID string) []taskRef {
	var out []taskRef
	for _, ref := range m.byVolume[k] {
		if ref.taskID != taskID {
			out = append(out, ref)
		}
	}
	slices.SortFunc(out, func(a, b taskRef) int {
		return cmp.Or(strings.Compare(a.taskID, b.taskID), strings.Compare(a.name, b.name))
	})
	return out
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
func (m *Manager) Tasks() []string { return m.TasksWithPrefix("") }

// TasksWithPrefix is Tasks, of the task IDs that begin with prefix: a
// start looks for earlier invocations of its task by their common prefix
// (allocation ID and task name), and with hundreds of tasks a map and a
// sort of every ID on each start cost more than the few it keeps.
func (m *Manager) TasksWithPrefix(prefix string) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for id, recs := range m.tasks {
		if len(recs) > 0 && strings.HasPrefix(id, prefix) {
			out = append(out, id)
		}
	}
	for id, keys := range m.unreleased {
		if len(keys) > 0 && strings.HasPrefix(id, prefix) && len(m.tasks[id]) == 0 {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
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

// commit writes ops to the journal as one batch, which then applies them
// to the records (vols, tasks) before it returns. The caller holds the
// lock of every volume the ops name.
func (m *Manager) commit(ops ...journalOp) error { return m.journal.commit(ops...) }

// commitLazy is commit without waiting for the disk (journal.commitLazy),
// for the result of a call after which no other call follows in the same
// operation: the last record of a Setup or a release. Its call's "-ing"
// record is durable, so a result lost with a crash of the host leaves the
// call uncertain, and recovery calls again.
func (m *Manager) commitLazy(ops ...journalOp) error { return m.journal.commitLazy(ops...) }

// counts returns how many volume and task records there are.
func (m *Manager) counts() (vols, tasks int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, recs := range m.tasks {
		tasks += len(recs)
	}
	return len(m.vols), tasks
}

// markCalled clears a task record's notCalled in memory: its
// NodePublishVolume is being made. Nothing is journalled (the durable
// record says publishing already) and the record is otherwise unchanged.
// The caller holds the volume's lock.
func (m *Manager) markCalled(taskID, name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if t, ok := m.tasks[taskID][name]; ok {
		t.notCalled = false
		m.tasks[taskID][name] = t
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
	if v, ok := m.vol(volKey{o.pluginID, o.volumeID}); ok {
		if err := m.serverRefusal(o, v, info); err != nil {
			return info, nil, nil, err
		}
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

// serverRefusal is the error of call o of volume v while a server other
// than the one that set v up serves its plugin id (info), nil otherwise.
// The volume's calls, and the secrets the journal keeps for them, go to
// the server that set it up alone: a socket in plugin_socket_dirs that a
// restarted driver found first, or another job, is another plugin. They
// wait for that server.
func (m *Manager) serverRefusal(o op, v volRecord, info PluginInfo) *OpError {
	if !serverMoved(v, info) {
		return nil
	}
	err := unreachable(o, fmt.Sprintf("volume %q of CSI plugin %q on node %q was set up through %s, and %s serves the plugin id now: its calls wait until %s serves it again",
		o.volumeID, o.pluginID, m.cfg.NodeName, v.Server, info.Server, v.Server))
	err.Hint = fmt.Sprintf("serve plugin %q from %s again; the driver retries until then and sends this volume to no other plugin", o.pluginID, v.Server)
	return err
}

// serverMoved reports whether a server other than the one that set the
// volume up serves its plugin id now. A server not named on either side
// (a record from before servers were kept, a plugin task not recovered
// yet) is not told apart.
func serverMoved(v volRecord, info PluginInfo) bool {
	return v.Server != "" && info.Server != "" && info.Server != v.Server
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

// makeDir makes a directory of ours under the stage root, with its
// parents, never while an empty parent is being removed.
func (m *Manager) makeDir(dir string) error {
	m.dirs.Lock()
	defer m.dirs.Unlock()
	return os.MkdirAll(dir, 0o750)
}

// makeDirAside is makeDir on a goroutine of its own, so that the disk's
// work goes on beside a journal commit or a plugin's call; wait returns
// makeDir's error. Every caller waits, on every path, before it returns:
// a directory made after the caller's error was undone would be left.
func (m *Manager) makeDirAside(dir string) (wait func() error) {
	done := make(chan error, 1)
	go func() {
		asideStarts(dir)
		done <- m.makeDir(dir)
	}()
	return sync.OnceValue(func() error { return <-done })
}

// asideStarts is called as makeDirAside's goroutine starts; a test delays
// it.
var asideStarts = func(dir string) {}

// dirAhead is a directory of ours needed later in a set-up: made aside
// once started (start, after the journal names what the directory is for,
// so that a crash never leaves it unnamed), or by made itself. A nil
// *dirAhead is started never.
type dirAhead struct {
	m    *Manager
	dir  string
	wait func() error
}

func (d *dirAhead) start() {
	if d != nil && d.wait == nil {
		d.wait = d.m.makeDirAside(d.dir)
	}
}

// made returns once the directory is made, making it now unless started.
func (d *dirAhead) made() error {
	if d.wait == nil {
		return d.m.makeDir(d.dir)
	}
	return d.wait()
}

// settle waits for a directory started aside, for the set-up's defer.
func (d *dirAhead) settle() {
	if d.wait != nil {
		_ = d.wait()
	}
}

// removeIfEmpty removes a directory of ours once nothing is left in it.
func (m *Manager) removeIfEmpty(dir string) {
	m.dirs.Lock()
	defer m.dirs.Unlock()
	_ = os.Remove(dir)
}

// summary is the first line of a failure for an event: its first CSI
// call's failure, else "Tearing down volumes failed (err)", the failure
// of a teardown (repairSummary is a repair's).
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

// repairSummary is summary for a failed repair, whose event names the
// repair itself: an error that no CSI call gave (the volume's secrets
// missing, its plugin gone) is told as it is.
func repairSummary(err error) string {
	if len(opErrors(err)) > 0 {
		return summary(err)
	}
	return err.Error()
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
