package fingerprint

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
)

// fakeDialer hands out one Fake per socket and counts dials.
type fakeDialer struct {
	mu      sync.Mutex
	fakes   map[string]*Fake
	dials   map[string]int
	nextErr error
}

func newFakeDialer() *fakeDialer {
	return &fakeDialer{fakes: map[string]*Fake{}, dials: map[string]int{}}
}

func (d *fakeDialer) set(socket string, f *Fake) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.fakes[socket] = f
}

func (d *fakeDialer) dialCount(socket string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dials[socket]
}

func (d *fakeDialer) dial(socket string, _ time.Duration) (Client, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.dials[socket]++
	if d.nextErr != nil {
		return nil, d.nextErr
	}
	f, ok := d.fakes[socket]
	if !ok {
		return nil, fmt.Errorf("no fake for %q", socket)
	}
	return f, nil
}

// healthEvent is one OnHealthChange call.
type healthEvent struct {
	id      string
	healthy bool
	reason  string
}

type eventLog struct {
	mu     sync.Mutex
	events []healthEvent
}

func (l *eventLog) record(id string, healthy bool, reason string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, healthEvent{id, healthy, reason})
}

func (l *eventLog) get() []healthEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]healthEvent(nil), l.events...)
}

// newTestProber returns a Prober over fakes that probes only when told
// (Refresh or a Fake's Changed), so tests count exactly.
func newTestProber(t *testing.T, d *fakeDialer, events *eventLog) *Prober {
	t.Helper()
	p := NewProber(Config{
		Logger:         hclog.New(&hclog.LoggerOptions{Level: hclog.Trace, Output: testWriter{t}}),
		Interval:       time.Hour,
		ScanInterval:   time.Hour,
		Dial:           d.dial,
		StatSocket:     func(string) error { return nil },
		OnHealthChange: events.record,
	})
	t.Cleanup(p.Close)
	return p
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(string(b))
	return len(b), nil
}

// drain empties the Updates channel and says whether it held a signal.
func drain(p *Prober) bool {
	select {
	case <-p.Updates():
		return true
	default:
		return false
	}
}

// waitFor polls cond until it holds or fails the test after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// settle waits for the first probe of every plugin, which Add and
// SetSocketDirs start at once, and empties Updates.
func settle(t *testing.T, p *Prober) {
	t.Helper()
	waitFor(t, 2*time.Second, "first probes", func() bool {
		for _, st := range p.Snapshot() {
			if st.Since.IsZero() {
				return false
			}
		}
		return true
	})
	drain(p)
}

func refresh(t *testing.T, p *Prober) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	must.NoError(t, p.Refresh(ctx))
}

func nodeFake() *Fake {
	f := NewFake(PluginInfo{Name: "hostpath.csi.k8s.io", VendorVersion: "1.0"}, NodeInfo{NodeID: "node-1", MaxVolumes: 8})
	f.NodeCaps = NodeCapabilities{StageUnstageVolume: true}
	return f
}

func TestProber_healthFlipsNotifyOnce(t *testing.T) {
	d := newFakeDialer()
	f := nodeFake()
	d.set("/csi/hp.sock", f)
	events := &eventLog{}
	p := newTestProber(t, d, events)

	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/hp.sock", TaskID: "task-1"}))
	settle(t, p)
	st, ok := p.Get("hp")
	must.True(t, ok)
	must.True(t, st.Healthy)
	must.Eq(t, "node-1", st.Node.NodeID)
	must.Eq(t, "task-1", st.TaskID)

	// Steady probes that change nothing neither notify nor ask again.
	refresh(t, p)
	refresh(t, p)
	must.False(t, drain(p))
	calls := f.Calls()
	must.Eq(t, 3, calls.ProbeCalls)
	must.Eq(t, 1, calls.PluginInfoCalls)
	must.Eq(t, 1, calls.NodeInfoCalls)
	must.Eq(t, 1, calls.NodeCapabilitiesCalls)
	must.Eq(t, 0, calls.ControllerCapabilitiesCalls)

	// Down: one update, the last known details are kept.
	f.Update(func(f *Fake) { f.NextProbeErr = errors.New("connection refused") })
	refresh(t, p)
	must.True(t, drain(p))
	refresh(t, p)
	must.False(t, drain(p))
	st, _ = p.Get("hp")
	must.False(t, st.Healthy)
	must.Eq(t, "probe failed: connection refused", st.HealthDescription)
	must.Eq(t, "node-1", st.Node.NodeID)
	must.Eq(t, "1.0", st.Info.VendorVersion)
	// Each failed probe drops its connection; the next probe dials anew.
	must.Eq(t, d.dialCount("/csi/hp.sock"), f.Calls().CloseCalls)

	// Back: one update, and the details are asked again on the new
	// connection.
	f.Update(func(f *Fake) { f.NextProbeErr = nil; f.Node.NodeID = "node-2" })
	refresh(t, p)
	must.True(t, drain(p))
	st, _ = p.Get("hp")
	must.True(t, st.Healthy)
	must.Eq(t, "", st.HealthDescription)
	must.Eq(t, "node-2", st.Node.NodeID)
	must.Eq(t, 2, f.Calls().NodeInfoCalls)

	must.Eq(t, []healthEvent{
		{"hp", true, ""},
		{"hp", false, "probe failed: connection refused"},
		{"hp", true, ""},
	}, events.get())
}

func TestProber_notReady(t *testing.T) {
	d := newFakeDialer()
	f := nodeFake()
	f.NotReady = true
	d.set("/csi/hp.sock", f)
	events := &eventLog{}
	p := newTestProber(t, d, events)

	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/hp.sock", TaskID: "t"}))
	settle(t, p)
	st, _ := p.Get("hp")
	must.False(t, st.Healthy)
	must.Eq(t, "plugin reports not ready", st.HealthDescription)
	must.False(t, st.Known)
	must.Eq(t, 0, f.Calls().NodeInfoCalls)

	f.Update(func(f *Fake) { f.NotReady = false })
	refresh(t, p)
	st, _ = p.Get("hp")
	must.True(t, st.Healthy)
	must.True(t, st.Known)
	must.Eq(t, []healthEvent{{"hp", false, "plugin reports not ready"}, {"hp", true, ""}}, events.get())
}

func TestProber_reconnectAsksAgain(t *testing.T) {
	d := newFakeDialer()
	f := nodeFake()
	d.set("/csi/hp.sock", f)
	p := newTestProber(t, d, &eventLog{})

	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/hp.sock", TaskID: "t"}))
	settle(t, p)
	must.Eq(t, 1, f.Calls().PluginInfoCalls)
	// The client reconnected behind our back (the plugin restarted between
	// two probes): its answers may be stale.
	f.Update(func(f *Fake) { f.Gen++; f.Info.VendorVersion = "2.0" })
	refresh(t, p)
	must.Eq(t, 2, f.Calls().PluginInfoCalls)
	st, _ := p.Get("hp")
	must.Eq(t, "2.0", st.Info.VendorVersion)
	must.Eq(t, 1, d.dialCount("/csi/hp.sock"))
}

func TestProber_changedProbesAtOnce(t *testing.T) {
	d := newFakeDialer()
	f := nodeFake()
	d.set("/csi/hp.sock", f)
	events := &eventLog{}
	p := newTestProber(t, d, events) // Interval is an hour

	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/hp.sock", TaskID: "t"}))
	waitFor(t, time.Second, "first probe", func() bool { return len(events.get()) == 1 })
	drain(p)

	start := time.Now()
	f.Update(func(f *Fake) { f.NextProbeErr = errors.New("connection reset") })
	select {
	case <-p.Updates():
	case <-time.After(time.Second):
		t.Fatal("no update within 1s of the connection changing")
	}
	t.Logf("noticed after %s", time.Since(start))
	st, _ := p.Get("hp")
	must.False(t, st.Healthy)
}

func TestProber_intervalProbes(t *testing.T) {
	d := newFakeDialer()
	f := nodeFake()
	d.set("/csi/hp.sock", f)
	p := NewProber(Config{Interval: 10 * time.Millisecond, Dial: d.dial, StatSocket: func(string) error { return nil }})
	defer p.Close()

	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/hp.sock", TaskID: "t"}))
	waitFor(t, 2*time.Second, "five probes", func() bool { return f.Calls().ProbeCalls >= 5 })
	calls := f.Calls()
	must.Eq(t, 1, calls.PluginInfoCalls)
	must.Eq(t, 1, calls.NodeInfoCalls)
	must.Eq(t, 1, d.dialCount("/csi/hp.sock"))
}

func TestProber_addValidationAndDuplicates(t *testing.T) {
	d := newFakeDialer()
	d.set("/csi/a.sock", nodeFake())
	d.set("/csi/b.sock", nodeFake())
	p := newTestProber(t, d, &eventLog{})

	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/a.sock", TaskID: "task-1"}))
	settle(t, p)

	cases := []struct {
		name string
		spec PluginSpec
		err  string
	}{
		{"empty id", PluginSpec{Type: TypeNode, Socket: "/csi/x.sock"}, "plugin id must not be empty"},
		{"relative socket", PluginSpec{ID: "x", Type: TypeNode, Socket: "csi.sock"}, `socket of plugin "x" must be an absolute path, not "csi.sock"`},
		{"bad type", PluginSpec{ID: "x", Type: "nodes", Socket: "/csi/x.sock"}, `type of plugin "x" must be node, controller or monolith, not "nodes"`},
		{"missing type", PluginSpec{ID: "x", Socket: "/csi/x.sock"}, `type of plugin "x" must be node, controller or monolith`},
		{"id served by another task", PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/b.sock", TaskID: "task-2"}, `plugin id "hp" is already served by task "task-1"`},
		{"socket used by another plugin", PluginSpec{ID: "other", Type: TypeNode, Socket: "/csi/a.sock", TaskID: "task-2"}, `socket "/csi/a.sock" is already used by plugin "hp" of task "task-1"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			must.EqError(t, p.Add(tc.spec), tc.err)
		})
	}
	must.False(t, drain(p))

	// The same task adding the same plugin again changes nothing.
	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/a.sock", TaskID: "task-1"}))
	must.False(t, drain(p))
	must.Len(t, 1, p.Snapshot())

	// The same task moving its socket replaces the plugin.
	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/b.sock", TaskID: "task-1"}))
	must.True(t, drain(p))
	snap := p.Snapshot()
	must.Len(t, 1, snap)
	must.Eq(t, "/csi/b.sock", snap[0].Socket)
}

func TestProber_remove(t *testing.T) {
	d := newFakeDialer()
	f := nodeFake()
	d.set("/csi/a.sock", f)
	events := &eventLog{}
	p := newTestProber(t, d, events)

	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/a.sock", TaskID: "t"}))
	settle(t, p)
	drain(p)

	must.True(t, p.Remove("hp"))
	must.True(t, drain(p))
	must.Eq(t, 1, f.Calls().CloseCalls)
	_, ok := p.Get("hp")
	must.False(t, ok)
	must.Len(t, 0, p.Snapshot())
	must.False(t, p.Remove("hp"))
	must.Len(t, 1, events.get())
}

func TestProber_serviceChecks(t *testing.T) {
	unimplemented := fmt.Errorf("NodeGetInfo: %w", ErrUnimplemented)
	cases := []struct {
		name     string
		typ      PluginType
		setup    func(f *Fake)
		healthy  bool
		reason   string
		node     bool
		ctrl     bool
		nodeRPCs int
		ctrlRPCs int
	}{
		{
			name:     "controller without node service is healthy",
			typ:      TypeController,
			setup:    func(f *Fake) { f.PluginCaps.ControllerService = true; f.NextNodeInfoErr = unimplemented },
			healthy:  true,
			ctrl:     true,
			ctrlRPCs: 1,
		},
		{
			name: "node without node service is unhealthy",
			typ:  TypeNode,
			setup: func(f *Fake) {
				f.NextNodeCapabilitiesErr = fmt.Errorf("NodeGetCapabilities: %w", ErrUnimplemented)
			},
			reason: `plugin "hostpath.csi.k8s.io" is of type node but does not implement the CSI Node service`,
		},
		{
			// CSI spec: NodeGetInfo is required only with
			// PUBLISH_UNPUBLISH_VOLUME; NodeGetCapabilities of every node
			// plugin.
			name:     "node without NodeGetInfo is healthy",
			typ:      TypeNode,
			setup:    func(f *Fake) { f.NextNodeInfoErr = unimplemented },
			healthy:  true,
			node:     true,
			nodeRPCs: 1,
		},
		{
			name: "monolith without NodeGetInfo nor controller publish is healthy",
			typ:  TypeMonolith,
			setup: func(f *Fake) {
				f.PluginCaps.ControllerService = true
				f.NextNodeInfoErr = unimplemented
			},
			healthy:  true,
			node:     true,
			ctrl:     true,
			nodeRPCs: 1,
			ctrlRPCs: 1,
		},
		{
			name: "monolith with controller publish needs NodeGetInfo",
			typ:  TypeMonolith,
			setup: func(f *Fake) {
				f.PluginCaps.ControllerService = true
				f.ControllerCaps.PublishUnpublishVolume = true
				f.NextNodeInfoErr = unimplemented
			},
			reason:   `plugin "hostpath.csi.k8s.io" has the PUBLISH_UNPUBLISH_VOLUME controller capability but does not implement NodeGetInfo, which the CSI spec requires then`,
			node:     true,
			ctrl:     true,
			nodeRPCs: 1,
			ctrlRPCs: 1,
		},
		{
			name: "monolith without controller service is unhealthy",
			typ:  TypeMonolith,
			setup: func(f *Fake) {
				f.PluginCaps.ControllerService = true
				f.NextControllerCapabilitiesErr = fmt.Errorf("ControllerGetCapabilities: %w", ErrUnimplemented)
			},
			reason:   `plugin "hostpath.csi.k8s.io" is of type monolith but does not implement the CSI Controller service`,
			node:     true,
			nodeRPCs: 1,
			ctrlRPCs: 1,
		},
		{
			// CSI spec: CONTROLLER_SERVICE "determines whether the CO will
			// attempt to invoke the REQUIRED ControllerService RPCs".
			name: "monolith not advertising the controller service is unhealthy and not asked",
			typ:  TypeMonolith,
			setup: func(f *Fake) {
				f.ControllerCaps.PublishUnpublishVolume = true
			},
			reason:   `plugin "hostpath.csi.k8s.io" is of type monolith but does not advertise the CSI Controller service (no CONTROLLER_SERVICE in GetPluginCapabilities)`,
			node:     true,
			nodeRPCs: 1,
		},
		{
			name: "monolith",
			typ:  TypeMonolith,
			setup: func(f *Fake) {
				f.PluginCaps.ControllerService = true
				f.ControllerCaps.PublishUnpublishVolume = true
			},
			healthy:  true,
			node:     true,
			ctrl:     true,
			nodeRPCs: 1,
			ctrlRPCs: 1,
		},
		{
			name:     "node plugin is not asked controller calls",
			typ:      TypeNode,
			setup:    func(f *Fake) { f.PluginCaps.ControllerService = true },
			healthy:  true,
			node:     true,
			nodeRPCs: 1,
		},
		{
			name:     "node info failure is unhealthy and asked again",
			typ:      TypeNode,
			setup:    func(f *Fake) { f.NextNodeInfoErr = errors.New("NodeGetInfo failed: boom") },
			reason:   "NodeGetInfo failed: boom",
			nodeRPCs: 2,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := newFakeDialer()
			f := nodeFake()
			tc.setup(f)
			d.set("/csi/a.sock", f)
			p := newTestProber(t, d, &eventLog{})
			must.NoError(t, p.Add(PluginSpec{ID: "p", Type: tc.typ, Socket: "/csi/a.sock", TaskID: "t"}))
			settle(t, p)
			refresh(t, p)
			st, ok := p.Get("p")
			must.True(t, ok)
			must.Eq(t, tc.healthy, st.Healthy)
			must.Eq(t, tc.reason, st.HealthDescription)
			must.Eq(t, tc.node, st.NodeService)
			must.Eq(t, tc.ctrl, st.ControllerService)
			must.Eq(t, tc.typ, st.Type)
			calls := f.Calls()
			must.Eq(t, tc.nodeRPCs, calls.NodeInfoCalls)
			must.Eq(t, tc.ctrlRPCs, calls.ControllerCapabilitiesCalls)
		})
	}
}

func TestProber_dialAndStatFailures(t *testing.T) {
	d := newFakeDialer()
	d.set("/csi/a.sock", nodeFake())
	d.nextErr = errors.New("failed to create a client")
	events := &eventLog{}
	missing := true
	var mu sync.Mutex
	p := NewProber(Config{
		Interval: time.Hour,
		Dial:     d.dial,
		StatSocket: func(path string) error {
			mu.Lock()
			defer mu.Unlock()
			if missing {
				return fmt.Errorf("socket %q does not exist", path)
			}
			return nil
		},
		OnHealthChange: events.record,
	})
	defer p.Close()

	must.NoError(t, p.Add(PluginSpec{ID: "p", Type: TypeNode, Socket: "/csi/a.sock", TaskID: "t"}))
	settle(t, p)
	st, _ := p.Get("p")
	must.Eq(t, `socket "/csi/a.sock" does not exist`, st.HealthDescription)
	must.Eq(t, 0, d.dialCount("/csi/a.sock"))

	mu.Lock()
	missing = false
	mu.Unlock()
	refresh(t, p)
	st, _ = p.Get("p")
	must.Eq(t, "failed to create a client", st.HealthDescription)

	d.mu.Lock()
	d.nextErr = nil
	d.mu.Unlock()
	refresh(t, p)
	st, _ = p.Get("p")
	must.True(t, st.Healthy)
	// The first unhealthy state is told once, though its reason changed.
	must.Eq(t, []healthEvent{
		{"p", false, `socket "/csi/a.sock" does not exist`},
		{"p", true, ""},
	}, events.get())
}

// mkSocketDir makes a short temporary directory for unix sockets.
func mkSocketDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "fp")
	must.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// listen creates a unix socket file at path; nothing answers on it.
func listen(t *testing.T, path string) net.Listener {
	t.Helper()
	must.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	l, err := net.Listen("unix", path)
	must.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l
}

func TestFindSockets(t *testing.T) {
	dir := mkSocketDir(t)
	listen(t, filepath.Join(dir, "top.sock"))
	listen(t, filepath.Join(dir, "nfs", "csi.sock"))
	listen(t, filepath.Join(dir, "nfs", "other"))                              // not *.sock
	listen(t, filepath.Join(dir, "a", "b", "deep.sock"))                       // three levels
	must.NoError(t, os.WriteFile(filepath.Join(dir, "file.sock"), nil, 0o600)) // not a socket

	socks, err := findSockets(dir)
	must.NoError(t, err)
	must.SliceContainsAll(t, []string{filepath.Join(dir, "top.sock"), filepath.Join(dir, "nfs", "csi.sock")}, socks)

	socks, err = findSockets(filepath.Join(dir, "missing"))
	must.NoError(t, err)
	must.Len(t, 0, socks)
}

func TestProber_socketDirs(t *testing.T) {
	dir := mkSocketDir(t)
	taskSock := filepath.Join(dir, "task", "csi.sock")
	nfsSock := filepath.Join(dir, "nfs", "csi.sock")
	dupSock := filepath.Join(dir, "zz", "csi.sock")
	clashSock := filepath.Join(dir, "clash.sock")
	listen(t, taskSock)
	nfsL := listen(t, nfsSock)
	listen(t, dupSock)
	listen(t, clashSock)

	d := newFakeDialer()
	d.set(taskSock, nodeFake())
	nfs := NewFake(PluginInfo{Name: "nfs.csi.k8s.io", VendorVersion: "4"}, NodeInfo{NodeID: "n1"})
	nfs.PluginCaps.ControllerService = true
	d.set(nfsSock, nfs)
	d.set(dupSock, NewFake(PluginInfo{Name: "nfs.csi.k8s.io"}, NodeInfo{NodeID: "n1"}))
	d.set(clashSock, NewFake(PluginInfo{Name: "hp"}, NodeInfo{NodeID: "n1"}))
	events := &eventLog{}
	p := NewProber(Config{Interval: time.Hour, ScanInterval: time.Hour, ForgetAfter: time.Nanosecond, Dial: d.dial, OnHealthChange: events.record})
	defer p.Close()

	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: taskSock, TaskID: "task-1"}))
	p.SetSocketDirs([]string{dir, dir + "/"})
	refresh(t, p)

	snap := p.Snapshot()
	must.Len(t, 4, snap, must.Sprintf("%+v", snap))
	// The task's own socket in the dir is not listed twice.
	hp, ok := p.Get("hp")
	must.True(t, ok)
	must.Eq(t, SourceTask, hp.Source)
	must.True(t, hp.Healthy)

	nfsSt, ok := p.Get("nfs.csi.k8s.io")
	must.True(t, ok)
	must.Eq(t, nfsSock, nfsSt.Socket)
	must.Eq(t, SourceSocketDir, nfsSt.Source)
	must.Eq(t, TypeMonolith, nfsSt.Type)
	must.True(t, nfsSt.Healthy)

	conflicts := map[string]string{}
	for _, st := range snap {
		if st.Conflict != "" {
			must.False(t, st.Healthy)
			conflicts[st.Socket] = st.Conflict
		}
	}
	must.Eq(t, map[string]string{
		clashSock: `plugin id "hp" is already served by task "task-1"`,
		dupSock:   fmt.Sprintf("plugin id %q is already served by socket %q", "nfs.csi.k8s.io", nfsSock),
	}, conflicts)

	attrs := attrValues(Build(snap))
	must.Eq(t, "hp,nfs.csi.k8s.io", attrs["driver.csi.plugins"])
	must.Eq(t, clashSock+","+dupSock, attrs["driver.csi.conflicting_sockets"])
	must.Eq(t, "monolith", attrs["driver.csi.plugin.nfs_csi_k8s_io.type"])

	// Conflicting sockets tell no health events.
	for _, e := range events.get() {
		must.True(t, e.healthy, must.Sprintf("%+v", e))
	}

	// The task goes away: the clashing socket becomes the owner of "hp".
	must.True(t, p.Remove("hp"))
	hp, ok = p.Get("hp")
	must.True(t, ok)
	must.Eq(t, clashSock, hp.Socket)
	must.Eq(t, "", hp.Conflict)

	// A socket that is gone is kept (unhealthy) until ForgetAfter, then
	// forgotten; the socket that conflicted with it takes the id.
	must.NoError(t, nfsL.Close())
	p.Rescan()
	_, ok = p.Get("nfs.csi.k8s.io")
	must.True(t, ok)
	p.Rescan()
	nfsSt, ok = p.Get("nfs.csi.k8s.io")
	must.True(t, ok)
	must.Eq(t, dupSock, nfsSt.Socket)

	// Dropping the directory forgets its sockets.
	p.SetSocketDirs(nil)
	must.Len(t, 0, p.Snapshot())
}

// A plugin task takes a moment to make its socket: within its grace period
// a plugin that was never healthy is starting, not unhealthy, and nobody is
// told it failed; once healthy, or once the grace is over, the truth is told.
func TestProber_startingGrace(t *testing.T) {
	for _, tc := range []struct {
		name   string
		grace  time.Duration
		events []healthEvent
	}{
		{"within the grace", time.Hour, []healthEvent{{"p", true, ""}}},
		{"without a grace", 0, []healthEvent{
			{"p", false, `socket "/csi/a.sock" does not exist`},
			{"p", true, ""},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newFakeDialer()
			f := nodeFake()
			d.set("/csi/a.sock", f)
			events := &eventLog{}
			var mu sync.Mutex
			missing := true
			p := NewProber(Config{
				Interval: time.Hour,
				Dial:     d.dial,
				StatSocket: func(path string) error {
					mu.Lock()
					defer mu.Unlock()
					if missing {
						return fmt.Errorf("socket %q does not exist", path)
					}
					return nil
				},
				OnHealthChange: events.record,
			})
			defer p.Close()
			var until time.Time
			if tc.grace > 0 {
				until = time.Now().Add(tc.grace)
			}
			must.NoError(t, p.Add(PluginSpec{ID: "p", Type: TypeNode, Socket: "/csi/a.sock", TaskID: "t", StartingUntil: until}))
			settle(t, p)
			st, _ := p.Get("p")
			must.False(t, st.Healthy)
			want := `socket "/csi/a.sock" does not exist`
			if tc.grace > 0 {
				want = "starting: " + want
			}
			must.Eq(t, want, st.HealthDescription)

			mu.Lock()
			missing = false
			mu.Unlock()
			refresh(t, p)
			st, _ = p.Get("p")
			must.True(t, st.Healthy)
			must.Eq(t, tc.events, events.get())

			// A plugin that was healthy and fails is unhealthy at once,
			// grace or not.
			f.Update(func(f *Fake) { f.NotReady = true })
			refresh(t, p)
			st, _ = p.Get("p")
			must.False(t, st.Healthy)
			must.StrNotContains(t, st.HealthDescription, "starting", must.Sprint(st.HealthDescription, events.get()))
			got := events.get()
			must.False(t, got[len(got)-1].healthy)
		})
	}
}

// Once the grace is over, a plugin that never became healthy is reported
// unhealthy, with its reason.
func TestProber_startingGraceExpires(t *testing.T) {
	d := newFakeDialer()
	events := &eventLog{}
	p := NewProber(Config{
		Interval:       20 * time.Millisecond,
		Dial:           d.dial,
		StatSocket:     func(path string) error { return fmt.Errorf("socket %q does not exist", path) },
		OnHealthChange: events.record,
	})
	defer p.Close()
	must.NoError(t, p.Add(PluginSpec{ID: "p", Type: TypeNode, Socket: "/csi/a.sock", TaskID: "t", StartingUntil: time.Now().Add(100 * time.Millisecond)}))
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return len(events.get()) == 1 }),
		wait.Timeout(10*time.Second), wait.Gap(10*time.Millisecond)))
	must.Eq(t, []healthEvent{{"p", false, `socket "/csi/a.sock" does not exist`}}, events.get())
}
