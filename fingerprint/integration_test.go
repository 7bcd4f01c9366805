package fingerprint

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// testPlugin is a minimal CSI plugin: Identity and Node, and Controller
// when controller is set.
type testPlugin struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedNodeServer
	csi.UnimplementedControllerServer

	name       string
	nodeID     string
	controller bool
	noNode     bool
	notReady   atomic.Bool
	// omitReady answers Probe without the ready field.
	omitReady bool
	// hang makes Probe wait for its caller's deadline.
	hang atomic.Bool
	// keepSocket leaves the socket file behind when the server stops, as
	// a killed process does.
	keepSocket bool
	// newer answers capabilities as a plugin of a later CSI version
	// would: beside the known ones, enum values this build does not know
	// and capabilities of a type it does not know (an empty oneof once
	// decoded).
	newer bool
	// unadvertised serves the Controller service (controller set) without
	// CONTROLLER_SERVICE among its plugin capabilities.
	unadvertised bool

	probes    atomic.Int64
	infos     atomic.Int64
	nodeGets  atomic.Int64
	ctrlCalls atomic.Int64
}

func (s *testPlugin) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	s.infos.Add(1)
	return &csi.GetPluginInfoResponse{Name: s.name, VendorVersion: "0.1.0", Manifest: map[string]string{"commit": "abc"}}, nil
}

func (s *testPlugin) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	resp := &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{
		{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS}}},
		{Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE}}},
	}}
	if s.controller && !s.unadvertised {
		resp.Capabilities = append(resp.Capabilities, &csi.PluginCapability{
			Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}},
		})
	}
	if s.newer {
		resp.Capabilities = append(resp.Capabilities,
			&csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_Type(977)}}},
			&csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_Type(977)}}},
			&csi.PluginCapability{})
	}
	return resp, nil
}

func (s *testPlugin) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	s.probes.Add(1)
	if s.hang.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if s.omitReady {
		return &csi.ProbeResponse{}, nil
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(!s.notReady.Load())}, nil
}

func (s *testPlugin) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	s.nodeGets.Add(1)
	return &csi.NodeGetInfoResponse{
		NodeId:             s.nodeID,
		MaxVolumesPerNode:  4,
		AccessibleTopology: &csi.Topology{Segments: map[string]string{"zone": "z1"}},
	}, nil
}

func (s *testPlugin) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	rpc := func(t csi.NodeServiceCapability_RPC_Type) *csi.NodeServiceCapability {
		return &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}}}
	}
	resp := &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{
		rpc(csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME),
		rpc(csi.NodeServiceCapability_RPC_EXPAND_VOLUME),
	}}
	if s.newer {
		resp.Capabilities = append(resp.Capabilities, rpc(csi.NodeServiceCapability_RPC_Type(977)), &csi.NodeServiceCapability{})
	}
	return resp, nil
}

func (s *testPlugin) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	s.ctrlCalls.Add(1)
	resp := &csi.ControllerGetCapabilitiesResponse{Capabilities: []*csi.ControllerServiceCapability{{
		Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME}},
	}}}
	if s.newer {
		resp.Capabilities = append(resp.Capabilities, &csi.ControllerServiceCapability{
			Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: csi.ControllerServiceCapability_RPC_Type(977)}},
		}, &csi.ControllerServiceCapability{})
	}
	return resp, nil
}

// serve runs plugin on a unix socket at path until the returned stop is
// called (stop is also run at the end of the test and may be called again).
func serve(t testing.TB, path string, plugin *testPlugin) (stop func()) {
	t.Helper()
	l, err := net.Listen("unix", path)
	must.NoError(t, err)
	l.(*net.UnixListener).SetUnlinkOnClose(!plugin.keepSocket)
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, plugin)
	if !plugin.noNode {
		csi.RegisterNodeServer(srv, plugin)
	}
	if plugin.controller {
		csi.RegisterControllerServer(srv, plugin)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = srv.Serve(l)
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			srv.Stop() // closes the listener, which removes the socket file
			wg.Wait()
		})
	}
	t.Cleanup(stop)
	return stop
}

func TestClient_realPlugin(t *testing.T) {
	dir := mkSocketDir(t)
	sock := filepath.Join(dir, "p.sock")
	plugin := &testPlugin{name: "test.csi.example.com", nodeID: "n1", controller: true}
	serve(t, sock, plugin)

	c, err := NewClient(sock, time.Second)
	must.NoError(t, err)
	defer c.Close()
	ctx := context.Background()

	ready, err := c.Probe(ctx)
	must.NoError(t, err)
	must.True(t, ready)
	must.Eq(t, uint64(1), c.Generation())

	info, err := c.PluginInfo(ctx)
	must.NoError(t, err)
	must.Eq(t, PluginInfo{Name: "test.csi.example.com", VendorVersion: "0.1.0", Manifest: map[string]string{"commit": "abc"}}, info)

	caps, err := c.PluginCapabilities(ctx)
	must.NoError(t, err)
	must.Eq(t, PluginCapabilities{ControllerService: true, VolumeAccessibilityConstraints: true, OnlineExpansion: true}, caps)

	cc, err := c.ControllerCapabilities(ctx)
	must.NoError(t, err)
	must.Eq(t, ControllerCapabilities{PublishUnpublishVolume: true}, cc)

	ni, err := c.NodeInfo(ctx)
	must.NoError(t, err)
	must.Eq(t, NodeInfo{NodeID: "n1", MaxVolumes: 4, Topology: map[string]string{"zone": "z1"}}, ni)

	nc, err := c.NodeCapabilities(ctx)
	must.NoError(t, err)
	must.Eq(t, NodeCapabilities{StageUnstageVolume: true, ExpandVolume: true}, nc)

	plugin.notReady.Store(true)
	ready, err = c.Probe(ctx)
	must.NoError(t, err)
	must.False(t, ready)
	// All of this went over one connection.
	must.Eq(t, uint64(1), c.Generation())
}

// A plugin of a later CSI version answers capabilities this build does not
// know: enum values past the known ones, and capability types it cannot
// decode (an empty oneof). They are ignored, as protobuf's forward
// compatibility means them to be: the known capabilities are read as
// they are, and the plugin is healthy.
func TestClient_capabilitiesOfALaterSpecIgnored(t *testing.T) {
	dir := mkSocketDir(t)
	sock := filepath.Join(dir, "p.sock")
	serve(t, sock, &testPlugin{name: "later.csi.example.com", nodeID: "n1", controller: true, newer: true})

	c, err := NewClient(sock, time.Second)
	must.NoError(t, err)
	defer c.Close()
	ctx := context.Background()
	caps, err := c.PluginCapabilities(ctx)
	must.NoError(t, err)
	must.Eq(t, PluginCapabilities{ControllerService: true, VolumeAccessibilityConstraints: true, OnlineExpansion: true}, caps)
	cc, err := c.ControllerCapabilities(ctx)
	must.NoError(t, err)
	must.Eq(t, ControllerCapabilities{PublishUnpublishVolume: true}, cc)
	nc, err := c.NodeCapabilities(ctx)
	must.NoError(t, err)
	must.Eq(t, NodeCapabilities{StageUnstageVolume: true, ExpandVolume: true}, nc)

	p := NewProber(Config{})
	defer p.Close()
	must.NoError(t, p.Add(PluginSpec{ID: "later", Type: TypeMonolith, Socket: sock, TaskID: "task-1"}))
	waitFor(t, 5*time.Second, "plugin probed", func() bool {
		st, ok := p.Get("later")
		return ok && !st.Since.IsZero()
	})
	st, _ := p.Get("later")
	must.True(t, st.Healthy, must.Sprint(st.HealthDescription))
	attrs := attrValues(Build(p.Snapshot()))
	must.Eq(t, "monolith", attrs["driver.csi.plugin.later.type"])
	must.Eq(t, "true", attrs["driver.csi.plugin.later.stage_unstage"])
}

// CONTROLLER_SERVICE "determines whether the CO will attempt to invoke the
// REQUIRED ControllerService RPCs, as well as specific RPCs as indicated by
// ControllerGetCapabilities" (CSI spec), and Nomad and Kubernetes'
// external-attacher call ControllerPublishVolume only for a plugin that
// advertises it. A plugin that serves the Controller service without it
// (a node-mode binary that registers every service) is not asked for its
// controller capabilities, whatever type the operator declared: its
// controller is never used. Declared a controller or a monolith, it is
// unhealthy, saying why.
func TestProber_controllerServiceNotAdvertised(t *testing.T) {
	for _, typ := range []PluginType{"", TypeNode, TypeMonolith, TypeController} {
		t.Run("declared_"+string(typ), func(t *testing.T) {
			dir := mkSocketDir(t)
			sock := filepath.Join(dir, "p.sock")
			plugin := &testPlugin{name: "nodemode.csi.example.com", nodeID: "n1", controller: true, unadvertised: true}
			serve(t, sock, plugin)
			p := NewProber(Config{})
			defer p.Close()
			spec := PluginSpec{ID: "p", Type: typ, Socket: sock, TaskID: "task-1"}
			if typ == "" {
				p.SetSocketDirs([]string{dir})
			} else {
				must.NoError(t, p.Add(spec))
			}
			var st PluginStatus
			waitFor(t, 5*time.Second, "plugin probed", func() bool {
				for _, s := range p.Snapshot() {
					if !s.Since.IsZero() {
						st = s
						return true
					}
				}
				return false
			})
			must.Eq(t, int64(0), plugin.ctrlCalls.Load())
			must.False(t, st.ControllerService)
			must.False(t, st.ControllerCaps.PublishUnpublishVolume)
			switch typ {
			case TypeMonolith, TypeController:
				must.False(t, st.Healthy)
				must.StrContains(t, st.HealthDescription, "does not advertise the CSI Controller service (no CONTROLLER_SERVICE in GetPluginCapabilities)")
			default:
				must.True(t, st.Healthy, must.Sprint(st.HealthDescription))
				must.Eq(t, TypeNode, st.Type)
			}
		})
	}
}

func TestClient_unimplementedAndAbsentReady(t *testing.T) {
	dir := mkSocketDir(t)
	sock := filepath.Join(dir, "c.sock")
	// A controller-only plugin that omits Probe's ready field.
	serve(t, sock, &testPlugin{name: "ctl", noNode: true, omitReady: true})

	c, err := NewClient(sock, 0)
	must.NoError(t, err)
	defer c.Close()
	ctx := context.Background()

	ready, err := c.Probe(ctx)
	must.NoError(t, err)
	must.True(t, ready)

	_, err = c.NodeInfo(ctx)
	must.ErrorIs(t, err, ErrUnimplemented)
	must.EqError(t, err, fmt.Sprintf("NodeGetInfo on plugin socket %q: not implemented by the plugin", sock))
	_, err = c.ControllerCapabilities(ctx)
	must.ErrorIs(t, err, ErrUnimplemented)
}

func TestClient_unreachableFailsFast(t *testing.T) {
	dir := mkSocketDir(t)
	sock := filepath.Join(dir, "none.sock")
	c, err := NewClient(sock, 2*time.Second)
	must.NoError(t, err)
	defer c.Close()

	start := time.Now()
	_, err = c.Probe(context.Background())
	must.Error(t, err)
	must.StrContains(t, err.Error(), fmt.Sprintf("Probe on plugin socket %q failed", sock))
	must.Less(t, time.Second, time.Since(start))
}

// TestProber_realPluginDiesAndComesBack runs the prober with its defaults
// (1s interval, real gRPC client) against a real plugin server.
func TestProber_realPluginDiesAndComesBack(t *testing.T) {
	dir := mkSocketDir(t)
	sock := filepath.Join(dir, "hp.sock")
	plugin := &testPlugin{name: "hostpath.csi.k8s.io", nodeID: "n1"}
	stop := serve(t, sock, plugin)

	events := &eventLog{}
	p := NewProber(Config{OnHealthChange: events.record})
	defer p.Close()
	must.NoError(t, p.Add(PluginSpec{ID: "hostpath", Type: TypeNode, Socket: sock, TaskID: "task-1"}))

	healthy := func(want bool) func() bool {
		return func() bool {
			st, ok := p.Get("hostpath")
			return ok && st.Healthy == want && !st.Since.IsZero()
		}
	}
	waitFor(t, 2*time.Second, "plugin healthy", healthy(true))
	attrs := attrValues(Build(p.Snapshot()))
	must.Eq(t, "true", attrs["driver.csi.plugin.hostpath.healthy"])
	must.Eq(t, "hostpath.csi.k8s.io", attrs["driver.csi.plugin.hostpath.vendor"])
	must.Eq(t, "n1", attrs["driver.csi.plugin.hostpath.node_id"])
	must.Eq(t, "4", attrs["driver.csi.plugin.hostpath.max_volumes"])
	must.Eq(t, "z1", attrs["driver.csi.plugin.hostpath.topology.zone"])
	must.Eq(t, "true", attrs["driver.csi.plugin.hostpath.expand"])

	// Steady probing keeps one connection and asks for details once.
	time.Sleep(1500 * time.Millisecond)
	must.Eq(t, int64(1), plugin.nodeGets.Load())
	must.Eq(t, int64(1), plugin.infos.Load())
	must.Greater(t, int64(1), plugin.probes.Load())

	drain(p)
	start := time.Now()
	stop()
	select {
	case <-p.Updates():
	case <-time.After(2 * time.Second):
		t.Fatal("no update within 2s of the plugin dying")
	}
	down := time.Since(start)
	st, _ := p.Get("hostpath")
	must.False(t, st.Healthy)
	must.Eq(t, "n1", st.Node.NodeID) // last known
	t.Logf("death noticed after %s: %s", down, st.HealthDescription)
	must.Less(t, time.Second, down)

	restarted := &testPlugin{name: "hostpath.csi.k8s.io", nodeID: "n2"}
	start = time.Now()
	serve(t, sock, restarted)
	waitFor(t, 2*time.Second, "plugin healthy again", healthy(true))
	t.Logf("return noticed after %s", time.Since(start))
	st, _ = p.Get("hostpath")
	// The new connection asked for the details again.
	must.Eq(t, "n2", st.Node.NodeID)
	must.Eq(t, int64(1), restarted.nodeGets.Load())

	got := events.get()
	must.Len(t, 3, got)
	must.Eq(t, healthEvent{"hostpath", true, ""}, got[0])
	must.False(t, got[1].healthy)
	must.Eq(t, healthEvent{"hostpath", true, ""}, got[2])
}

func TestProber_realSocketDir(t *testing.T) {
	dir := mkSocketDir(t)
	must.NoError(t, os.MkdirAll(filepath.Join(dir, "nfs"), 0o755))
	serve(t, filepath.Join(dir, "nfs", "csi.sock"), &testPlugin{name: "nfs.csi.k8s.io", nodeID: "n1", controller: true})
	serve(t, filepath.Join(dir, "ctl.sock"), &testPlugin{name: "ctl.example.com", noNode: true, controller: true})

	p := NewProber(Config{})
	defer p.Close()
	p.SetSocketDirs([]string{dir})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	must.NoError(t, p.Refresh(ctx))

	nfs, ok := p.Get("nfs.csi.k8s.io")
	must.True(t, ok)
	must.True(t, nfs.Healthy)
	must.Eq(t, TypeMonolith, nfs.Type)
	must.True(t, nfs.ControllerCaps.PublishUnpublishVolume)

	ctl, ok := p.Get("ctl.example.com")
	must.True(t, ok)
	must.True(t, ctl.Healthy)
	must.Eq(t, TypeController, ctl.Type)
	must.False(t, ctl.NodeService)

	attrs := attrValues(Build(p.Snapshot()))
	must.Eq(t, "ctl.example.com,nfs.csi.k8s.io", attrs["driver.csi.plugins"])
	must.Eq(t, "socket_dir", attrs["driver.csi.plugin.nfs_csi_k8s_io.source"])
	must.Eq(t, "true", attrs["driver.csi.plugin.ctl_example_com.controller_publish"])
}

func TestProber_realPluginRefusesOrHangs(t *testing.T) {
	dir := mkSocketDir(t)
	sock := filepath.Join(dir, "k.sock")
	plugin := &testPlugin{name: "k", nodeID: "n1", keepSocket: true}
	stop := serve(t, sock, plugin)

	p := NewProber(Config{RPCTimeout: 300 * time.Millisecond})
	defer p.Close()
	must.NoError(t, p.Add(PluginSpec{ID: "k", Type: TypeNode, Socket: sock, TaskID: "t"}))
	status := func() PluginStatus {
		st, _ := p.Get("k")
		return st
	}
	waitFor(t, 2*time.Second, "plugin healthy", func() bool { return status().Healthy })

	// A hung plugin fails by the RPC deadline.
	plugin.hang.Store(true)
	waitFor(t, 2*time.Second, "hung plugin unhealthy", func() bool {
		st := status()
		return !st.Healthy && strings.HasPrefix(st.HealthDescription, "probe failed: DeadlineExceeded: ")
	})
	plugin.hang.Store(false)
	waitFor(t, 2*time.Second, "plugin healthy again", func() bool { return status().Healthy })

	// A killed plugin leaves its socket: connections are refused.
	stop()
	// A probe in flight when it died may fail otherwise first ("error
	// reading from server: EOF"); the next one is refused.
	waitFor(t, 2*time.Second, "refused plugin unhealthy", func() bool {
		st := status()
		return !st.Healthy && strings.HasPrefix(st.HealthDescription, "probe failed: Unavailable: ") &&
			strings.Contains(st.HealthDescription, "connection refused")
	})
}
