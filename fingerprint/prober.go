package fingerprint

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// Defaults of Config.
const (
	DefaultInterval     = time.Second
	DefaultScanInterval = 10 * time.Second
	DefaultForgetAfter  = 15 * time.Minute
)

// Config configures a Prober. Zero fields take the defaults.
type Config struct {
	Logger hclog.Logger
	// Interval is how often each healthy plugin is probed
	// (DefaultInterval); an unhealthy one is retried every Interval/2, and
	// a plugin whose connection drops is probed at once.
	Interval time.Duration
	// RPCTimeout bounds each CSI call (DefaultRPCTimeout).
	RPCTimeout time.Duration
	// ScanInterval is how often plugin_socket_dirs are scanned
	// (DefaultScanInterval); Rescan scans at once.
	ScanInterval time.Duration
	// ForgetAfter is how long a discovered socket whose file is gone stays
	// listed, unhealthy, before it is forgotten (DefaultForgetAfter).
	ForgetAfter time.Duration
	// OnHealthChange, when set, is called when a plugin's health is first
	// known and each time it flips, with the reason when unhealthy. It is
	// called from the plugin's probe goroutine, never with a lock held,
	// and not for conflicting sockets nor for removed plugins. It may read
	// the Prober (Get, Snapshot) but must not call Remove, Add or Close,
	// which wait for that goroutine.
	OnHealthChange func(id string, healthy bool, reason string)
	// Dial makes a Client for a socket (NewClient).
	Dial func(socket string, rpcTimeout time.Duration) (Client, error)
	// StatSocket is nil when path is a unix socket that can be dialled. It
	// is asked before each new connection (statSocket).
	StatSocket func(path string) error
}

// PluginSpec is a plugin socket given to Prober.Add.
type PluginSpec struct {
	// ID is the plugin id the job declared.
	ID string
	// Type is what the plugin is used for; required for SourceTask.
	Type   PluginType
	Socket string
	// TaskID is the task serving the plugin.
	TaskID string
	// Source is SourceTask when empty.
	Source Source
	// Reclaim is set when the task takes back an id a task held before:
	// its own after a driver restart, or one of its job's earlier tasks'
	// after Nomad restarted the task. It then replaces the entry of that
	// earlier task, and a socket in plugin_socket_dirs that names itself
	// id (one that appeared while a task served the id) does not stop
	// it. Without Reclaim, Add refuses an id that a socket in
	// plugin_socket_dirs serves: a task never takes over an operator's
	// plugin.
	Reclaim bool
	// StartingUntil is the end of a starting plugin's grace period (as
	// Nomad's csi_plugin health_timeout): until then, a plugin that has
	// not been healthy yet is reported as starting (HealthDescription
	// "starting: ...", not healthy), without an OnHealthChange call, since
	// a plugin takes a moment to make its socket. Zero: no grace.
	StartingUntil time.Time
}

// ErrServedBySocket is matched by Add's error for a task plugin whose id
// a socket in plugin_socket_dirs serves.
var ErrServedBySocket = errors.New("plugin id is served by a socket in plugin_socket_dirs")

// Prober owns the plugin sockets of this node and keeps a PluginStatus for
// each. Each plugin has one goroutine that keeps one connection open and
// calls Probe every Interval; GetPluginInfo, the capabilities and
// NodeGetInfo are asked only on the first successful probe of a
// connection (so again after every reconnect). Any change that shows in
// Build's attributes is announced on Updates.
//
// Plugin ids are unique: Add refuses an id another task already serves,
// and an id a socket in plugin_socket_dirs serves (unless the task
// reclaims it, see PluginSpec.Reclaim). A socket found in
// plugin_socket_dirs that is the socket of a task plugin is that task's
// plugin and is not listed twice; one that names itself with the id of a
// task plugin, or of a discovered socket with a smaller path, is kept,
// probed, and reported with PluginStatus.Conflict set, never merged with
// the owner: a socket that appears later does not take over a task's id.
type Prober struct {
	cfg    Config
	logger hclog.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	updates chan struct{}
	scanMu  sync.Mutex // one scan at a time

	mu          sync.Mutex
	tasks       map[string]*entry // by plugin id
	discovered  map[string]*entry // by socket path
	dirs        []string
	scanRunning bool
	closed      bool
}

// health of a plugin as last told through OnHealthChange.
const (
	reportedNone = iota
	reportedHealthy
	reportedUnhealthy
)

// entry is one plugin socket and its probe goroutine.
type entry struct {
	spec   PluginSpec
	cancel context.CancelFunc
	done   chan struct{}
	kick   chan chan struct{}

	// Guarded by Prober.mu.
	status    PluginStatus
	probed    bool
	removed   bool
	reported  int
	goneSince time.Time
	// wasHealthy is set by the first healthy probe: a grace period
	// (PluginSpec.StartingUntil) is over then.
	wasHealthy bool

	// Owned by the probe goroutine.
	client      Client
	infoFetched bool
	infoGen     uint64
	// detailsErr is why the details read on this connection are not
	// acceptable ("" when they are).
	detailsErr string
}

// NewProber returns a Prober with no plugins. Close stops it.
func NewProber(cfg Config) *Prober {
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.RPCTimeout <= 0 {
		cfg.RPCTimeout = DefaultRPCTimeout
	}
	if cfg.ScanInterval <= 0 {
		cfg.ScanInterval = DefaultScanInterval
	}
	if cfg.ForgetAfter <= 0 {
		cfg.ForgetAfter = DefaultForgetAfter
	}
	if cfg.Dial == nil {
		cfg.Dial = NewClient
	}
	if cfg.StatSocket == nil {
		cfg.StatSocket = statSocket
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Prober{
		cfg:        cfg,
		logger:     cfg.Logger.ResetNamed("csi.fingerprint"),
		ctx:        ctx,
		cancel:     cancel,
		updates:    make(chan struct{}, 1),
		tasks:      map[string]*entry{},
		discovered: map[string]*entry{},
	}
}

// statSocket is nil when path is a unix socket.
func statSocket(path string) error {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("socket %q does not exist", path)
	}
	if err != nil {
		return fmt.Errorf("cannot stat socket %q: %w", path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%q is not a unix socket", path)
	}
	return nil
}

// Updates receives, coalesced, when something that shows in the attributes
// changed: a plugin was added or removed, its health flipped or its
// description or capabilities changed. It is never closed.
func (p *Prober) Updates() <-chan struct{} { return p.updates }

func (p *Prober) notify() {
	select {
	case p.updates <- struct{}{}:
	default:
	}
}

// Add starts probing a plugin socket. Adding the same id again from the
// same task replaces the spec (a no-op when unchanged); an id served by
// another task, or a socket used by another plugin, is refused.
func (p *Prober) Add(spec PluginSpec) error {
	if spec.Source == "" {
		spec.Source = SourceTask
	}
	switch {
	case spec.ID == "":
		return errors.New("plugin id must not be empty")
	case !filepath.IsAbs(spec.Socket):
		return fmt.Errorf("socket of plugin %q must be an absolute path, not %q", spec.ID, spec.Socket)
	case spec.Type != "" && !spec.Type.Valid():
		return fmt.Errorf("type of plugin %q must be node, controller or monolith, not %q", spec.ID, spec.Type)
	case spec.Type == "" && spec.Source == SourceTask:
		return fmt.Errorf("type of plugin %q must be node, controller or monolith", spec.ID)
	}
	spec.Socket = filepath.Clean(spec.Socket)

	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return errors.New("the plugin prober is closed")
	}
	var stopped []*entry
	old, ok := p.tasks[spec.ID]
	if ok {
		if old.spec.TaskID != spec.TaskID && !spec.Reclaim {
			p.mu.Unlock()
			return fmt.Errorf("plugin id %q is already served by task %q", spec.ID, old.spec.TaskID)
		}
		if same := old.spec; same.TaskID == spec.TaskID {
			same.Reclaim = spec.Reclaim
			if same == spec {
				p.mu.Unlock()
				return nil
			}
		}
	}
	if (!ok || old.spec.TaskID != spec.TaskID) && !spec.Reclaim {
		if sock, served := p.socketServingLocked(spec.ID, spec.Socket); served {
			p.mu.Unlock()
			return fmt.Errorf("plugin id %q is already served by socket %q: %w", spec.ID, sock, ErrServedBySocket)
		}
	}
	if ok {
		p.removeLocked(old)
		delete(p.tasks, spec.ID)
		stopped = append(stopped, old)
	}
	for _, other := range p.tasks {
		if other.spec.Socket == spec.Socket {
			p.mu.Unlock()
			return fmt.Errorf("socket %q is already used by plugin %q of task %q", spec.Socket, other.spec.ID, other.spec.TaskID)
		}
	}
	if d, ok := p.discovered[spec.Socket]; ok {
		// The task's socket lies in a scanned directory: it is the task's.
		p.removeLocked(d)
		delete(p.discovered, spec.Socket)
		stopped = append(stopped, d)
	}
	e := p.startLocked(spec, PluginStatus{ID: spec.ID, Type: spec.Type, Socket: spec.Socket, Source: spec.Source, TaskID: spec.TaskID})
	p.tasks[spec.ID] = e
	p.resolveLocked()
	p.mu.Unlock()

	p.logger.Debug("added plugin", "plugin_id", spec.ID, "task_id", spec.TaskID, "socket", spec.Socket, "type", spec.Type)
	waitStopped(stopped)
	p.notify()
	return nil
}

// socketServingLocked returns the socket found in plugin_socket_dirs, other
// than own, whose plugin names itself id, if any: the owner when several
// do. Call with p.mu held.
func (p *Prober) socketServingLocked(id, own string) (string, bool) {
	for _, sock := range slices.Sorted(maps.Keys(p.discovered)) {
		if e := p.discovered[sock]; e.status.ID == id && sock != own {
			return sock, true
		}
	}
	return "", false
}

// SocketServing returns the socket in plugin_socket_dirs that serves id,
// if any. The directories are scanned first, and sockets whose plugin has
// not told its name yet are asked for it (within ctx), so that a task
// cannot take an id in the moments before the Prober learns that a
// socket serves it. A socket whose plugin does not answer within ctx
// counts for no id.
func (p *Prober) SocketServing(ctx context.Context, id string) (string, bool) {
	p.Rescan()
	p.mu.Lock()
	var unnamed []*entry
	for _, e := range p.discovered {
		if e.status.ID == "" {
			unnamed = append(unnamed, e)
		}
	}
	p.mu.Unlock()
	p.kick(ctx, unnamed)
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.socketServingLocked(id, "")
}

// Remove stops probing the plugin added with id and forgets it. It reports
// whether there was such a plugin.
func (p *Prober) Remove(id string) bool {
	p.mu.Lock()
	e, ok := p.tasks[id]
	if ok {
		p.removeLocked(e)
		delete(p.tasks, id)
		p.resolveLocked()
	}
	p.mu.Unlock()
	if !ok {
		return false
	}
	p.logger.Debug("removed plugin", "plugin_id", id, "task_id", e.spec.TaskID)
	waitStopped([]*entry{e})
	p.notify()
	return true
}

// startLocked makes an entry and starts its probe goroutine.
func (p *Prober) startLocked(spec PluginSpec, st PluginStatus) *entry {
	ctx, cancel := context.WithCancel(p.ctx)
	st.HealthDescription = "plugin has not been probed yet"
	e := &entry{spec: spec, cancel: cancel, done: make(chan struct{}), kick: make(chan chan struct{}), status: st}
	p.wg.Add(1)
	go p.run(ctx, e)
	return e
}

func (p *Prober) removeLocked(e *entry) {
	e.removed = true
	e.cancel()
}

func waitStopped(entries []*entry) {
	for _, e := range entries {
		<-e.done
	}
}

// Close stops every probe and the directory scan, and closes the
// connections. The Prober cannot be used afterwards.
func (p *Prober) Close() {
	p.mu.Lock()
	p.closed = true
	for _, e := range p.tasks {
		e.removed = true
	}
	for _, e := range p.discovered {
		e.removed = true
	}
	p.mu.Unlock()
	p.cancel()
	p.wg.Wait()
}

// Snapshot returns every plugin record, owners and conflicting sockets,
// sorted by id (task plugins first), then socket.
func (p *Prober) Snapshot() []PluginStatus {
	p.mu.Lock()
	out := make([]PluginStatus, 0, len(p.tasks)+len(p.discovered))
	for _, e := range p.tasks {
		out = append(out, e.view())
	}
	for _, e := range p.discovered {
		out = append(out, e.view())
	}
	p.mu.Unlock()
	slices.SortFunc(out, comparePlugins)
	return out
}

// Get returns the record of the plugin that owns id: the task plugin, else
// the discovered socket without a conflict.
func (p *Prober) Get(id string) (PluginStatus, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if e, ok := p.tasks[id]; ok {
		return e.view(), true
	}
	for _, e := range p.discovered {
		if e.status.ID == id && e.status.Conflict == "" {
			return e.view(), true
		}
	}
	return PluginStatus{}, false
}

// view is the entry's record as callers see it; call with Prober.mu held.
func (e *entry) view() PluginStatus {
	st := e.status
	st.Info.Manifest = maps.Clone(st.Info.Manifest)
	st.Node.Topology = maps.Clone(st.Node.Topology)
	if st.Conflict != "" {
		st.Healthy = false
		st.HealthDescription = st.Conflict
	}
	return st
}

// Refresh probes every plugin once, at once, and returns when all have
// been probed or ctx is done.
func (p *Prober) Refresh(ctx context.Context) error {
	p.mu.Lock()
	entries := make([]*entry, 0, len(p.tasks)+len(p.discovered))
	for _, e := range p.tasks {
		entries = append(entries, e)
	}
	for _, e := range p.discovered {
		entries = append(entries, e)
	}
	p.mu.Unlock()
	p.kick(ctx, entries)
	return ctx.Err()
}

// kick probes entries once, at once, and returns when all have been
// probed or ctx is done.
func (p *Prober) kick(ctx context.Context, entries []*entry) {
	// Kick every plugin at once, so that one hung plugin does not hold
	// up the others.
	var wg sync.WaitGroup
	for _, e := range entries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reply := make(chan struct{})
			select {
			case e.kick <- reply:
			case <-e.done:
				return
			case <-ctx.Done():
				return
			}
			select {
			case <-reply:
			case <-e.done:
			case <-ctx.Done():
			}
		}()
	}
	wg.Wait()
}

// run is the probe goroutine of one plugin.
func (p *Prober) run(ctx context.Context, e *entry) {
	defer p.wg.Done()
	defer close(e.done)
	defer e.dropClient(p.logger)

	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		var changed <-chan struct{}
		if e.client != nil {
			changed = e.client.Changed()
		}
		var reply chan struct{}
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		case <-changed:
		case reply = <-e.kick:
		}
		out := p.check(ctx, e)
		if ctx.Err() != nil {
			if reply != nil {
				close(reply)
			}
			return
		}
		p.apply(e, out)
		if reply != nil {
			close(reply)
		}
		if out.healthy {
			timer.Reset(p.cfg.Interval)
		} else {
			// Retry an unhealthy plugin twice as often, so that its
			// return is seen within an interval.
			timer.Reset(p.cfg.Interval / 2)
		}
	}
}

func (e *entry) dropClient(logger hclog.Logger) {
	if e.client == nil {
		return
	}
	if err := e.client.Close(); err != nil {
		logger.Debug("failed to close plugin connection", "socket", e.spec.Socket, "error", err)
	}
	e.client = nil
	e.infoFetched = false
}

// outcome is the result of one probe.
type outcome struct {
	healthy bool
	reason  string
	// info is set when GetPluginInfo was asked alone.
	info *PluginInfo
	// details is set when everything was asked again.
	details *details
}

type details struct {
	info              PluginInfo
	pluginCaps        PluginCapabilities
	nodeService       bool
	node              NodeInfo
	nodeCaps          NodeCapabilities
	controllerService bool
	controllerCaps    ControllerCapabilities
	typ               PluginType
}

// check probes the plugin, connecting first if needed, and asks for its
// details when the connection is new.
func (p *Prober) check(ctx context.Context, e *entry) outcome {
	if e.client == nil {
		if err := p.cfg.StatSocket(e.spec.Socket); err != nil {
			return outcome{reason: err.Error()}
		}
		c, err := p.cfg.Dial(e.spec.Socket, p.cfg.RPCTimeout)
		if err != nil {
			return outcome{reason: err.Error()}
		}
		e.client, e.infoFetched = c, false
	}
	ready, err := e.client.Probe(ctx)
	if err != nil {
		// Start from a fresh connection next time: a plugin coming back
		// is then seen within one retry whatever gRPC's backoff.
		e.dropClient(p.logger)
		if serr := p.cfg.StatSocket(e.spec.Socket); serr != nil {
			// The usual death: the plugin removed its socket.
			return outcome{reason: serr.Error()}
		}
		return outcome{reason: "probe failed: " + rpcMessage(err)}
	}
	gen := e.client.Generation()
	stale := !e.infoFetched || gen != e.infoGen
	if !ready {
		out := outcome{reason: "plugin reports not ready"}
		if stale && e.spec.ID == "" {
			// A discovered socket is known by its name: learn it even
			// before the plugin is ready.
			if info, err := e.client.PluginInfo(ctx); err == nil {
				if info, err = checkPluginInfo(info); err == nil {
					out.info = &info
				}
			}
		}
		return out
	}
	if !stale {
		if e.detailsErr != "" {
			return outcome{reason: e.detailsErr}
		}
		return outcome{healthy: true}
	}
	d, err := fetchDetails(ctx, e.client, e.spec.Type)
	if d == nil {
		return outcome{reason: err.Error()}
	}
	// Details that were read are kept even when they are not acceptable.
	e.infoFetched, e.infoGen, e.detailsErr = true, gen, ""
	if err != nil {
		e.detailsErr = boundReason(err.Error())
		return outcome{reason: err.Error(), details: d}
	}
	return outcome{healthy: true, details: d}
}

// rpcMessage is a gRPC error as "<code>: <message>", without the wrapping
// that repeats the socket (the socket has its own attribute).
func rpcMessage(err error) string {
	if st, ok := status.FromError(err); ok {
		return st.Code().String() + ": " + st.Message()
	}
	return err.Error()
}

// fetchDetails asks a ready plugin who it is and what it can do. Node calls
// are skipped for a declared controller and controller calls for a
// declared node; a discovered plugin (declared "") is asked for its node
// service, and for its controller service when it advertises one, and its
// type follows from what it has. A nil result means the plugin must be
// asked again; a result with an error was read but is not acceptable.
func fetchDetails(ctx context.Context, c Client, declared PluginType) (*details, error) {
	info, err := c.PluginInfo(ctx)
	if err != nil {
		return nil, err
	}
	if info, err = checkPluginInfo(info); err != nil {
		return nil, err
	}
	caps, err := c.PluginCapabilities(ctx)
	if err != nil {
		return nil, err
	}
	d := &details{info: info, pluginCaps: caps, typ: declared}

	wantNode := declared != TypeController
	// CONTROLLER_SERVICE "determines whether the CO will attempt to invoke
	// the REQUIRED ControllerService RPCs" (CSI spec), whatever the
	// operator declared: a plugin that serves the Controller service
	// without it (a node-mode binary registering every service) is not
	// asked, and its controller never used, as Nomad and Kubernetes'
	// external-attacher leave it.
	wantController := declared != TypeNode && caps.ControllerService
	if wantController {
		cc, err := c.ControllerCapabilities(ctx)
		switch {
		case errors.Is(err, ErrUnimplemented):
		case err != nil:
			return nil, err
		default:
			d.controllerService, d.controllerCaps = true, cc
		}
	}
	noNodeInfo := false
	if wantNode {
		// NodeGetCapabilities is the one Node call every node plugin
		// implements (CSI spec); NodeGetInfo is required only of a plugin
		// with PUBLISH_UNPUBLISH_VOLUME, so its absence alone is no
		// missing Node service: the node id is then unknown, and only a
		// ControllerPublishVolume needs one.
		nc, err := c.NodeCapabilities(ctx)
		switch {
		case errors.Is(err, ErrUnimplemented):
		case err != nil:
			return nil, err
		default:
			ni, err := c.NodeInfo(ctx)
			switch {
			case errors.Is(err, ErrUnimplemented):
				noNodeInfo = true
			case err != nil:
				return nil, err
			}
			if err := checkNodeInfo(ni); err != nil {
				return nil, err
			}
			d.nodeService, d.node, d.nodeCaps = true, ni, nc
		}
	}

	switch {
	case declared == "" && d.nodeService && d.controllerService:
		d.typ = TypeMonolith
	case declared == "" && d.nodeService:
		d.typ = TypeNode
	case declared == "" && d.controllerService:
		d.typ = TypeController
	case declared == "":
		return d, fmt.Errorf("plugin %q offers neither the CSI Node nor the Controller service", info.Name)
	}
	if (d.typ == TypeNode || d.typ == TypeMonolith) && !d.nodeService {
		return d, fmt.Errorf("plugin %q is of type %s but does not implement the CSI Node service", info.Name, d.typ)
	}
	if (d.typ == TypeController || d.typ == TypeMonolith) && !caps.ControllerService {
		return d, fmt.Errorf("plugin %q is of type %s but does not advertise the CSI Controller service (no CONTROLLER_SERVICE in GetPluginCapabilities)", info.Name, d.typ)
	}
	if (d.typ == TypeController || d.typ == TypeMonolith) && !d.controllerService {
		return d, fmt.Errorf("plugin %q is of type %s but does not implement the CSI Controller service", info.Name, d.typ)
	}
	if noNodeInfo && d.controllerService && d.controllerCaps.PublishUnpublishVolume {
		return d, fmt.Errorf("plugin %q has the PUBLISH_UNPUBLISH_VOLUME controller capability but does not implement NodeGetInfo, which the CSI spec requires then", info.Name)
	}
	return d, nil
}

// apply records a probe's outcome, tells Updates and OnHealthChange, and
// logs health flips.
func (p *Prober) apply(e *entry, out outcome) {
	p.mu.Lock()
	if e.removed {
		p.mu.Unlock()
		return
	}
	// Maps in the record are replaced, never changed in place, so a
	// shallow copy is a true "before".
	before := e.status
	firstProbe := !e.probed
	st := &e.status
	if out.info != nil && e.spec.ID == "" {
		st.ID = out.info.Name
	}
	if d := out.details; d != nil {
		if e.spec.ID == "" {
			st.ID = d.info.Name
			st.Type = d.typ
		}
		st.Known = true
		st.Info = d.info
		st.PluginCaps = d.pluginCaps
		st.NodeService, st.Node, st.NodeCaps = d.nodeService, d.node, d.nodeCaps
		st.ControllerService, st.ControllerCaps = d.controllerService, d.controllerCaps
	}
	if firstProbe || st.Healthy != out.healthy {
		st.Since = time.Now()
	}
	e.wasHealthy = e.wasHealthy || out.healthy
	starting := !e.wasHealthy && time.Now().Before(e.spec.StartingUntil)
	if starting {
		out.reason = startingPrefix + out.reason
	}
	e.probed = true
	st.Healthy = out.healthy
	st.HealthDescription = boundReason(out.reason)
	if before.ID != st.ID {
		p.resolveLocked()
	}
	changed := firstProbe || before.Healthy != st.Healthy || before.HealthDescription != st.HealthDescription ||
		before.ID != st.ID || before.Conflict != st.Conflict
	if out.details != nil && !changed {
		// Details are asked only on a new connection: comparing them
		// fully is rare.
		changed = !reflect.DeepEqual(before, *st)
	}

	report := false
	id, healthy, reason, socket := st.ID, st.Healthy, st.HealthDescription, st.Socket
	vendor, version := st.Info.Name, st.Info.VendorVersion
	if id != "" && st.Conflict == "" && !starting {
		want := reportedUnhealthy
		if healthy {
			want = reportedHealthy
		}
		report = e.reported != want
		e.reported = want
	}
	if changed {
		// Under the lock, so that whoever sees the new record has been
		// told too.
		p.notify()
	}
	p.mu.Unlock()

	if report {
		if healthy {
			p.logger.Info("plugin healthy", "plugin_id", id, "socket", socket, "vendor", vendor, "version", version)
		} else {
			p.logger.Warn("plugin unhealthy", "plugin_id", id, "socket", socket, "reason", reason)
		}
		if p.cfg.OnHealthChange != nil {
			p.cfg.OnHealthChange(id, healthy, reason)
		}
	}
}

// startingPrefix begins the health description of a plugin in its grace
// period (see PluginSpec.StartingUntil).
const startingPrefix = "starting: "

// resolveLocked marks discovered sockets whose id is already served, by a
// task plugin or by a discovered socket with a smaller path.
func (p *Prober) resolveLocked() {
	sockets := slices.Sorted(maps.Keys(p.discovered))
	owner := map[string]string{}
	for _, sock := range sockets {
		e := p.discovered[sock]
		id := e.status.ID
		conflict := ""
		if id != "" {
			if t, ok := p.tasks[id]; ok {
				conflict = fmt.Sprintf("plugin id %q is already served by task %q", id, t.spec.TaskID)
			} else if o, ok := owner[id]; ok {
				conflict = fmt.Sprintf("plugin id %q is already served by socket %q", id, o)
			} else {
				owner[id] = sock
			}
		}
		if conflict != e.status.Conflict {
			if conflict != "" {
				p.logger.Warn("plugin socket conflicts with another plugin", "plugin_id", id, "socket", sock, "reason", conflict)
			}
			e.status.Conflict = conflict
			// Its health is told again should it become the owner.
			e.reported = reportedNone
		}
	}
}

// SetSocketDirs sets the plugin_socket_dirs to scan, scans them at once
// and then every ScanInterval. Sockets of directories no longer listed are
// forgotten.
func (p *Prober) SetSocketDirs(dirs []string) {
	clean := make([]string, 0, len(dirs))
	for _, d := range dirs {
		if d != "" {
			clean = append(clean, filepath.Clean(d))
		}
	}
	slices.Sort(clean)
	clean = slices.Compact(clean)

	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.dirs = clean
	start := !p.scanRunning
	p.scanRunning = true
	if start {
		p.wg.Add(1)
	}
	p.mu.Unlock()

	if start {
		go p.scanLoop()
	}
	p.Rescan()
}

func (p *Prober) scanLoop() {
	defer p.wg.Done()
	ticker := time.NewTicker(p.cfg.ScanInterval)
	defer ticker.Stop()
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-ticker.C:
			p.Rescan()
		}
	}
}

// Rescan scans plugin_socket_dirs now: new sockets start being probed, and
// sockets gone for ForgetAfter, or outside the directories, are forgotten.
func (p *Prober) Rescan() {
	p.scanMu.Lock()
	defer p.scanMu.Unlock()

	p.mu.Lock()
	dirs := slices.Clone(p.dirs)
	p.mu.Unlock()

	found := map[string]bool{}
	for _, dir := range dirs {
		socks, err := findSockets(dir)
		if err != nil {
			p.logger.Warn("failed to scan plugin socket dir", "dir", dir, "error", err)
		}
		for _, s := range socks {
			found[s] = true
		}
	}

	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	changed := false
	taskSockets := map[string]bool{}
	for _, t := range p.tasks {
		taskSockets[t.spec.Socket] = true
	}
	for sock := range found {
		if taskSockets[sock] {
			continue
		}
		if d, ok := p.discovered[sock]; ok {
			d.goneSince = time.Time{}
			continue
		}
		spec := PluginSpec{Socket: sock, Source: SourceSocketDir}
		p.discovered[sock] = p.startLocked(spec, PluginStatus{Socket: sock, Source: SourceSocketDir})
		p.logger.Info("found plugin socket", "socket", sock)
		changed = true
	}
	now := time.Now()
	var stopped []*entry
	for sock, d := range p.discovered {
		if found[sock] {
			continue
		}
		forget := !mounter.WithinAny(sock, dirs)
		if !forget && d.goneSince.IsZero() {
			d.goneSince = now
		} else if !forget && now.Sub(d.goneSince) >= p.cfg.ForgetAfter {
			forget = true
		}
		if forget {
			p.logger.Info("forgot plugin socket", "socket", sock, "plugin_id", d.status.ID)
			p.removeLocked(d)
			delete(p.discovered, sock)
			stopped = append(stopped, d)
			changed = true
		}
	}
	if changed {
		p.resolveLocked()
	}
	p.mu.Unlock()

	waitStopped(stopped)
	if changed {
		p.notify()
	}
}

// findSockets returns the unix sockets named *.sock in dir and in its
// subdirectories (two levels), symlinks followed. A missing dir has none.
func findSockets(dir string) ([]string, error) {
	var out []string
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("failed to read plugin socket dir %q: %w", dir, err)
	}
	for _, de := range entries {
		path := filepath.Join(dir, de.Name())
		fi, err := os.Stat(path)
		if err != nil {
			continue
		}
		switch {
		case isPluginSocket(de.Name(), fi):
			out = append(out, path)
		case fi.IsDir():
			sub, err := os.ReadDir(path)
			if err != nil {
				continue
			}
			for _, se := range sub {
				sp := filepath.Join(path, se.Name())
				if sfi, err := os.Stat(sp); err == nil && isPluginSocket(se.Name(), sfi) {
					out = append(out, sp)
				}
			}
		}
	}
	return out, nil
}

func isPluginSocket(name string, fi fs.FileInfo) bool {
	return strings.HasSuffix(name, ".sock") && fi.Mode().Type() == fs.ModeSocket
}
