// Command csi-fixture is a small CSI plugin (spec v1.12.0) that the
// nomad-driver-csi end-to-end tests launch as a task. It does real work:
//
//   - "dir" volumes (the default) are directories under --state-dir,
//     bind-mounted at the staging path and from there at each target;
//   - "ext4" volumes are sparse image files formatted with mkfs.ext4,
//     attached to a loop device at NodeStageVolume and mounted there, or
//     handed out as the loop device itself for block access;
//   - "fuse" volumes are directories served at the staging path through a
//     FUSE loopback file system run by the fixture itself (fuse.go):
//     killing the fixture leaves their mounts dead, as with FUSE plugins.
//
// It serves the Identity, Controller and Node services on one unix socket,
// remembers its volumes as JSON files under --state-dir/meta, and logs each
// RPC's method and volume ID (never a request body, so never a secret) to
// stderr and, with --log-calls, to a file the tests count lines in.
//
// Test knobs: --hang METHOD makes that RPC block until the client gives up;
// --fail-once METHOD=CODE makes its first call fail with CODE; fault rules
// in a control file (--faults, default <state-dir>/faults; see faults.go)
// hang or fail chosen calls of chosen volumes while the fixture runs, until
// the test changes the file.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// config is everything the flags say.
type config struct {
	endpoint          string
	nodeID            string
	stateDir          string
	name              string
	vendorVersion     string
	controllerPublish bool
	maxVolumes        int64
	topology          map[string]string
	logCalls          string
	hang              map[string]bool
	failOnce          map[string]codes.Code
	faults            string
	// mountGroup advertises VOLUME_MOUNT_GROUP and honours it (see
	// applyMountGroup).
	mountGroup bool
	// requireSecret, KEY=VALUE, makes NodeStageVolume and
	// NodePublishVolume refuse (PermissionDenied) a request whose secrets
	// lack it: a test sees that the secrets reached the plugin.
	requireSecret string
	// echoSecrets makes NodeStageVolume fail (InvalidArgument) with a
	// message that echoes the request's secrets as careless plugins do:
	// verbatim, Go-quoted and JSON-encoded. The driver must redact every
	// form before the message reaches an event, a log or an error.
	echoSecrets bool
	// createdTopology, when set, is the accessible topology CreateVolume
	// answers instead of the node's: a volume made elsewhere.
	createdTopology map[string]string
	// Plugins that differ from the default in a capability, each held to
	// what the CSI spec then asks of a CO: noPublishReadonly drops
	// PUBLISH_READONLY and refuses ControllerPublishVolume with
	// readonly = true; offlineExpansion advertises VolumeExpansion OFFLINE
	// instead of ONLINE and refuses ControllerExpandVolume for a volume
	// attached, staged or published anywhere; noNodeInfo answers
	// NodeGetInfo with Unimplemented (allowed without controller publish).
	noPublishReadonly bool
	offlineExpansion  bool
	noNodeInfo        bool
}

// plugin serves all three CSI services.
type plugin struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer

	cfg   config
	store *store

	mu        sync.Mutex // guards callLog, failOnce and faultUses
	callLog   *os.File
	failOnce  map[string]codes.Code
	faultUses map[string]int // fault rule text -> calls it failed
}

func main() {
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	log.SetPrefix("csi-fixture: ")
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		log.Fatalf("invalid flags: %v", err)
	}
	if err := run(cfg); err != nil {
		log.Fatalf("%v", err)
	}
}

func parseFlags(args []string) (config, error) {
	host, _ := os.Hostname()
	cfg := config{topology: map[string]string{}, createdTopology: map[string]string{}, hang: map[string]bool{}, failOnce: map[string]codes.Code{}}
	fs := flag.NewFlagSet("csi-fixture", flag.ContinueOnError)
	fs.StringVar(&cfg.endpoint, "endpoint", "", "CSI endpoint, unix:///path/csi.sock (default $CSI_ENDPOINT)")
	fs.StringVar(&cfg.nodeID, "node-id", host, "node ID returned by NodeGetInfo")
	fs.StringVar(&cfg.stateDir, "state-dir", "/var/lib/csi-fixture", "directory the volumes and their records live in")
	fs.StringVar(&cfg.name, "name", "fixture.csi.nomad-driver-csi", "plugin name returned by GetPluginInfo")
	fs.StringVar(&cfg.vendorVersion, "vendor-version", "0.1.0", "vendor version returned by GetPluginInfo")
	fs.BoolVar(&cfg.controllerPublish, "controller-publish", false, "advertise PUBLISH_UNPUBLISH_VOLUME and require its publish_context in NodeStageVolume")
	fs.Int64Var(&cfg.maxVolumes, "max-volumes", 0, "max_volumes_per_node returned by NodeGetInfo and enforced (0: no limit)")
	fs.BoolVar(&cfg.mountGroup, "mount-group", false, "advertise VOLUME_MOUNT_GROUP: a published file-system volume's root gets the volume_mount_group (setgid, g+rwx)")
	fs.StringVar(&cfg.requireSecret, "require-secret", "", "KEY=VALUE: NodeStageVolume and NodePublishVolume need this secret (PermissionDenied otherwise; the value is never logged)")
	fs.BoolVar(&cfg.echoSecrets, "echo-secrets", false, "NodeStageVolume fails with a message echoing the request's secrets (verbatim, %q and JSON): a careless plugin, for the driver's redaction")
	fs.StringVar(&cfg.logCalls, "log-calls", "", "append one line per RPC (method and volume ID) to this file")
	fs.Func("topology", "key=value segment of this node's accessible topology (repeatable)", func(s string) error {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" {
			return fmt.Errorf("topology must be key=value, not %q", s)
		}
		cfg.topology[k] = v
		return nil
	})
	fs.Func("created-topology", "key=value segment CreateVolume answers the new volume is accessible from, instead of this node's (repeatable)", func(s string) error {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" {
			return fmt.Errorf("created-topology must be key=value, not %q", s)
		}
		cfg.createdTopology[k] = v
		return nil
	})
	fs.Func("hang", "test mode: this RPC (e.g. NodePublishVolume) blocks until the client gives up (repeatable)", func(s string) error {
		cfg.hang[s] = true
		return nil
	})
	fs.Func("fail-once", "test mode: METHOD=CODE makes the first call of METHOD fail with CODE, e.g. NodeStageVolume=Unavailable (repeatable)", func(s string) error {
		m, c, ok := strings.Cut(s, "=")
		code, err := parseCode(c)
		if !ok || m == "" || err != nil {
			return fmt.Errorf("fail-once must be METHOD=CODE with a gRPC code name or number, not %q", s)
		}
		cfg.failOnce[m] = code
		return nil
	})
	fs.BoolVar(&cfg.noPublishReadonly, "no-publish-readonly", false, "with --controller-publish: do not advertise PUBLISH_READONLY, and refuse ControllerPublishVolume with readonly = true (InvalidArgument), as the CSI spec lets such a plugin")
	fs.BoolVar(&cfg.offlineExpansion, "offline-expansion", false, "advertise VolumeExpansion OFFLINE instead of ONLINE, and refuse ControllerExpandVolume for a volume in use (FailedPrecondition)")
	fs.BoolVar(&cfg.noNodeInfo, "no-node-info", false, "answer NodeGetInfo with Unimplemented (not with --controller-publish: the CSI spec requires it then)")
	fs.StringVar(&cfg.faults, "faults", "", "test mode: control file of fault rules read on every call (default <state-dir>/faults; see faults.go)")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if cfg.faults == "" {
		cfg.faults = filepath.Join(cfg.stateDir, "faults")
	}
	if cfg.endpoint == "" {
		cfg.endpoint = os.Getenv("CSI_ENDPOINT")
	}
	switch {
	case cfg.endpoint == "":
		return cfg, errors.New("endpoint is required: pass --endpoint unix:///path/csi.sock or set CSI_ENDPOINT")
	case cfg.nodeID == "":
		return cfg, errors.New("node-id is required when the hostname is unknown")
	case cfg.noNodeInfo && cfg.controllerPublish:
		return cfg, errors.New("no-node-info cannot be used with controller-publish: the CSI spec requires NodeGetInfo of a plugin with PUBLISH_UNPUBLISH_VOLUME")
	case cfg.maxVolumes < 0:
		return cfg, errors.New("max-volumes must not be negative")
	}
	return cfg, nil
}

func parseCode(s string) (codes.Code, error) {
	if n, err := strconv.ParseUint(s, 10, 32); err == nil && n <= 16 {
		return codes.Code(n), nil
	}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if strings.EqualFold(c.String(), s) || strings.EqualFold(strings.ReplaceAll(c.String(), "_", ""), strings.ReplaceAll(s, "_", "")) {
			return c, nil
		}
	}
	return 0, fmt.Errorf("unknown gRPC code %q", s)
}

func run(cfg config) error {
	st, err := openStore(cfg.stateDir)
	if err != nil {
		return err
	}
	p := &plugin{cfg: cfg, store: st, failOnce: cfg.failOnce, faultUses: map[string]int{}}
	if cfg.logCalls != "" {
		if p.callLog, err = os.OpenFile(cfg.logCalls, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err != nil {
			return fmt.Errorf("failed to open call log %q: %w", cfg.logCalls, err)
		}
		defer p.callLog.Close()
	}
	lis, err := listen(cfg.endpoint)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(p.intercept))
	csi.RegisterIdentityServer(srv, p)
	csi.RegisterControllerServer(srv, p)
	csi.RegisterNodeServer(srv, p)

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		sig := <-sigs
		log.Printf("stopping signal=%s", sig)
		done := make(chan struct{})
		go func() { srv.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			srv.Stop()
		}
	}()
	log.Printf("serving name=%s node_id=%s endpoint=%s state_dir=%s controller_publish=%t", cfg.name, cfg.nodeID, cfg.endpoint, cfg.stateDir, cfg.controllerPublish)
	return srv.Serve(lis)
}

// listen opens the unix socket, replacing a stale socket file.
func listen(endpoint string) (net.Listener, error) {
	p := endpoint
	switch {
	case strings.HasPrefix(endpoint, "unix://"):
		p = strings.TrimPrefix(endpoint, "unix://")
	case strings.HasPrefix(endpoint, "unix:"):
		p = strings.TrimPrefix(endpoint, "unix:")
	case strings.Contains(endpoint, "://"):
		return nil, fmt.Errorf("endpoint must be unix:///absolute/path, not %q", endpoint)
	}
	if !filepath.IsAbs(p) {
		return nil, fmt.Errorf("endpoint must name an absolute socket path, not %q", endpoint)
	}
	if len(p) > 107 {
		return nil, fmt.Errorf("socket path %q is %d bytes; unix sockets allow 107", p, len(p))
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return nil, fmt.Errorf("failed to create socket directory for %q: %w", p, err)
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("failed to remove stale socket %q: %w", p, err)
	}
	lis, err := net.Listen("unix", p)
	if err != nil {
		return nil, fmt.Errorf("failed to listen on %q: %w", p, err)
	}
	return lis, nil
}

// intercept logs every RPC by method and volume ID and applies the test knobs.
func (p *plugin) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	method := path.Base(info.FullMethod)
	vol := "-"
	if r, ok := req.(interface{ GetVolumeId() string }); ok && r.GetVolumeId() != "" {
		vol = r.GetVolumeId()
	} else if r, ok := req.(*csi.CreateVolumeRequest); ok && r.GetName() != "" {
		vol = "name=" + r.GetName()
	}
	p.logCall(method, vol)
	start := time.Now()
	volumeID, name := "", ""
	if r, ok := req.(interface{ GetVolumeId() string }); ok && r.GetVolumeId() != "" {
		volumeID = r.GetVolumeId()
		if v, ok := p.store.get(volumeID); ok {
			name = v.Name
		}
	} else if r, ok := req.(*csi.CreateVolumeRequest); ok {
		name = r.GetName()
	}
	if err := p.applyFaults(ctx, method, volumeID, name); err != nil {
		return nil, err
	}
	if p.cfg.hang[method] {
		log.Printf("hanging method=%s volume_id=%s", method, vol)
		<-ctx.Done()
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	p.mu.Lock()
	code, fail := p.failOnce[method]
	delete(p.failOnce, method)
	p.mu.Unlock()
	if fail {
		log.Printf("injected failure method=%s volume_id=%s code=%s", method, vol, code)
		return nil, status.Errorf(code, "injected %s failure of %s (--fail-once)", code, method)
	}
	resp, err := h(ctx, req)
	log.Printf("rpc method=%s volume_id=%s code=%s duration=%s", method, vol, status.Code(err), time.Since(start).Round(time.Microsecond))
	if err != nil {
		log.Printf("rpc failed method=%s volume_id=%s error=%q", method, vol, status.Convert(err).Message())
	}
	return resp, err
}

func (p *plugin) logCall(method, vol string) {
	if p.callLog == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.callLog, "%s %s\n", method, vol)
}

// ---- Identity ----

func (p *plugin) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: p.cfg.name, VendorVersion: p.cfg.vendorVersion}, nil
}

func (p *plugin) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	svc := func(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
		return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
	}
	caps := []*csi.PluginCapability{
		svc(csi.PluginCapability_Service_CONTROLLER_SERVICE),
	}
	expansion := csi.PluginCapability_VolumeExpansion_ONLINE
	if p.cfg.offlineExpansion {
		expansion = csi.PluginCapability_VolumeExpansion_OFFLINE
	}
	caps = append(caps, &csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: expansion}}})
	if len(p.cfg.topology) > 0 {
		caps = append(caps, svc(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS))
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

func (p *plugin) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if _, err := os.Stat(p.cfg.stateDir); err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "state dir %q is gone: %v", p.cfg.stateDir, err)
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
