package fingerprint

import (
	"context"
	"errors"
	"fmt"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// DefaultRPCTimeout bounds every CSI call made by a Client from NewClient
// when no other timeout is given: the Rules table's deadline of the calls
// that read what a plugin is.
const DefaultRPCTimeout = csiclient.InfoDeadline

// ErrUnimplemented is matched (errors.Is) by a Client error when the plugin
// answered codes.Unimplemented: it does not offer that service. A plugin of
// type controller answers it for the Node calls, which is not a failure.
var ErrUnimplemented = errors.New("not implemented by the plugin")

// PluginInfo is the answer to GetPluginInfo.
type PluginInfo struct {
	// Name is the plugin's name in reverse domain notation, e.g.
	// "hostpath.csi.k8s.io". Sockets found in plugin_socket_dirs are known
	// by this name.
	Name          string
	VendorVersion string
	Manifest      map[string]string
}

// PluginCapabilities is the answer to GetPluginCapabilities.
type PluginCapabilities struct {
	ControllerService              bool
	VolumeAccessibilityConstraints bool
	GroupControllerService         bool
	SnapshotMetadataService        bool
	OnlineExpansion                bool
	OfflineExpansion               bool
}

// ControllerCapabilities is the answer to ControllerGetCapabilities.
type ControllerCapabilities struct {
	CreateDeleteVolume        bool
	PublishUnpublishVolume    bool
	ListVolumes               bool
	GetCapacity               bool
	CreateDeleteSnapshot      bool
	ListSnapshots             bool
	CloneVolume               bool
	PublishReadonly           bool
	ExpandVolume              bool
	ListVolumesPublishedNodes bool
	VolumeCondition           bool
	GetVolume                 bool
	SingleNodeMultiWriter     bool
	ModifyVolume              bool
	GetSnapshot               bool
}

// NodeInfo is the answer to NodeGetInfo.
type NodeInfo struct {
	NodeID string
	// MaxVolumes is the most volumes the plugin can publish on this node;
	// 0 means no limit was given.
	MaxVolumes int64
	// Topology holds the accessible topology segments, nil when the plugin
	// gave none.
	Topology map[string]string
}

// NodeCapabilities is the answer to NodeGetCapabilities.
type NodeCapabilities struct {
	StageUnstageVolume    bool
	GetVolumeStats        bool
	ExpandVolume          bool
	VolumeCondition       bool
	SingleNodeMultiWriter bool
	VolumeMountGroup      bool
}

// Client is what this package asks of a CSI plugin. Every method is one
// RPC under its own deadline. Errors name the call and the socket; an
// Unimplemented answer matches ErrUnimplemented.
type Client interface {
	// PluginInfo calls Identity.GetPluginInfo.
	PluginInfo(ctx context.Context) (PluginInfo, error)
	// Probe calls Identity.Probe. ready is false only when the plugin said
	// so; an answer without the ready field means ready (CSI spec).
	Probe(ctx context.Context) (ready bool, err error)
	// PluginCapabilities calls Identity.GetPluginCapabilities.
	PluginCapabilities(ctx context.Context) (PluginCapabilities, error)
	// ControllerCapabilities calls Controller.ControllerGetCapabilities.
	ControllerCapabilities(ctx context.Context) (ControllerCapabilities, error)
	// NodeInfo calls Node.NodeGetInfo.
	NodeInfo(ctx context.Context) (NodeInfo, error)
	// NodeCapabilities calls Node.NodeGetCapabilities.
	NodeCapabilities(ctx context.Context) (NodeCapabilities, error)
	// Generation counts the connections the client has established. When
	// it changes between two calls the plugin may have restarted behind
	// the same socket, and what it said before may be stale.
	Generation() uint64
	// Changed receives (coalesced) when the connection's state changes,
	// so a caller can probe at once when a plugin goes away instead of
	// waiting for its next period. It may be nil: never.
	Changed() <-chan struct{}
	// Close releases the connection. Calls after Close fail.
	Close() error
}

// grpcClient is the Client over a csiclient connection to a unix socket.
type grpcClient struct {
	socket string
	conn   *csiclient.Conn
	policy csiclient.Policy
}

var _ Client = (*grpcClient)(nil)

// NewClient returns a Client for the plugin listening on the unix socket
// at socket. It does not connect: the first call does, and a call made
// while the plugin is away fails at once rather than waiting for it. Each
// call runs under rpcTimeout (DefaultRPCTimeout when zero or less) or the
// caller's deadline, whichever is sooner. Calls are not retried: the
// prober's next round is the retry.
func NewClient(socket string, rpcTimeout time.Duration) (Client, error) {
	return NewClientPeer(socket, rpcTimeout, nil)
}

// NewClientPeer is NewClient with a check of the process listening on the
// socket before each connection is used (csiclient.Options.Peer).
func NewClientPeer(socket string, rpcTimeout time.Duration, peer func(pid int32) error) (Client, error) {
	if rpcTimeout <= 0 {
		rpcTimeout = DefaultRPCTimeout
	}
	conn, err := csiclient.Dial(socket, csiclient.Options{
		// A plugin that comes back must be reachable within a period or
		// two, not after gRPC's default backoff of up to two minutes.
		ReconnectMax:   time.Second,
		ConnectTimeout: rpcTimeout,
		Watch:          true,
		Peer:           peer,
	})
	if err != nil {
		return nil, fmt.Errorf("failed to create a client for plugin socket %q: %w", socket, err)
	}
	return &grpcClient{socket: socket, conn: conn, policy: csiclient.Policy{Attempts: 1, Timeout: rpcTimeout}}, nil
}

func (c *grpcClient) Generation() uint64 { return c.conn.Generation() }

func (c *grpcClient) Changed() <-chan struct{} { return c.conn.Changed() }

func (c *grpcClient) Close() error {
	if err := c.conn.Close(); err != nil {
		return fmt.Errorf("failed to close the connection to plugin socket %q: %w", c.socket, err)
	}
	return nil
}

// call runs one RPC under the client's policy and wraps its error.
func (c *grpcClient) call(ctx context.Context, method string, fn func(ctx context.Context) error) error {
	_, err := c.policy.Do(ctx, method, fn, nil, nil)
	if err == nil {
		return nil
	}
	if status.Code(err) == codes.Unimplemented {
		return fmt.Errorf("%s on plugin socket %q: %w", method, c.socket, ErrUnimplemented)
	}
	return fmt.Errorf("%s on plugin socket %q failed: %w", method, c.socket, err)
}

func (c *grpcClient) PluginInfo(ctx context.Context) (PluginInfo, error) {
	var resp *csi.GetPluginInfoResponse
	err := c.call(ctx, csiclient.GetPluginInfo, func(ctx context.Context) (err error) {
		resp, err = c.conn.Identity.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		return err
	})
	if err != nil {
		return PluginInfo{}, err
	}
	if resp.GetName() == "" {
		return PluginInfo{}, fmt.Errorf("GetPluginInfo on plugin socket %q returned an empty name", c.socket)
	}
	return PluginInfo{Name: resp.GetName(), VendorVersion: resp.GetVendorVersion(), Manifest: resp.GetManifest()}, nil
}

func (c *grpcClient) Probe(ctx context.Context) (bool, error) {
	var resp *csi.ProbeResponse
	err := c.call(ctx, csiclient.Probe, func(ctx context.Context) (err error) {
		resp, err = c.conn.Identity.Probe(ctx, &csi.ProbeRequest{})
		return err
	})
	if err != nil {
		return false, err
	}
	return probeReady(resp), nil
}

// probeReady reads a Probe answer: an absent ready wrapper means ready.
func probeReady(resp *csi.ProbeResponse) bool {
	if resp.GetReady() == nil {
		return true
	}
	return resp.GetReady().GetValue()
}

func (c *grpcClient) PluginCapabilities(ctx context.Context) (PluginCapabilities, error) {
	var resp *csi.GetPluginCapabilitiesResponse
	err := c.call(ctx, csiclient.GetPluginCapabilities, func(ctx context.Context) (err error) {
		resp, err = c.conn.Identity.GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
		return err
	})
	if err != nil {
		return PluginCapabilities{}, err
	}
	return pluginCapabilities(resp), nil
}

func pluginCapabilities(resp *csi.GetPluginCapabilitiesResponse) PluginCapabilities {
	var caps PluginCapabilities
	for _, c := range resp.GetCapabilities() {
		if svc := c.GetService(); svc != nil {
			switch svc.GetType() {
			case csi.PluginCapability_Service_CONTROLLER_SERVICE:
				caps.ControllerService = true
			case csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS:
				caps.VolumeAccessibilityConstraints = true
			case csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE:
				caps.GroupControllerService = true
			case csi.PluginCapability_Service_SNAPSHOT_METADATA_SERVICE:
				caps.SnapshotMetadataService = true
			}
		}
		if exp := c.GetVolumeExpansion(); exp != nil {
			switch exp.GetType() {
			case csi.PluginCapability_VolumeExpansion_ONLINE:
				caps.OnlineExpansion = true
			case csi.PluginCapability_VolumeExpansion_OFFLINE:
				caps.OfflineExpansion = true
			}
		}
	}
	return caps
}

func (c *grpcClient) ControllerCapabilities(ctx context.Context) (ControllerCapabilities, error) {
	var resp *csi.ControllerGetCapabilitiesResponse
	err := c.call(ctx, csiclient.ControllerGetCapabilities, func(ctx context.Context) (err error) {
		resp, err = c.conn.Controller.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
		return err
	})
	if err != nil {
		return ControllerCapabilities{}, err
	}
	return controllerCapabilities(resp), nil
}

func controllerCapabilities(resp *csi.ControllerGetCapabilitiesResponse) ControllerCapabilities {
	var caps ControllerCapabilities
	for _, c := range resp.GetCapabilities() {
		switch c.GetRpc().GetType() {
		case csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME:
			caps.CreateDeleteVolume = true
		case csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME:
			caps.PublishUnpublishVolume = true
		case csi.ControllerServiceCapability_RPC_LIST_VOLUMES:
			caps.ListVolumes = true
		case csi.ControllerServiceCapability_RPC_GET_CAPACITY:
			caps.GetCapacity = true
		case csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT:
			caps.CreateDeleteSnapshot = true
		case csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS:
			caps.ListSnapshots = true
		case csi.ControllerServiceCapability_RPC_CLONE_VOLUME:
			caps.CloneVolume = true
		case csi.ControllerServiceCapability_RPC_PUBLISH_READONLY:
			caps.PublishReadonly = true
		case csi.ControllerServiceCapability_RPC_EXPAND_VOLUME:
			caps.ExpandVolume = true
		case csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES:
			caps.ListVolumesPublishedNodes = true
		case csi.ControllerServiceCapability_RPC_VOLUME_CONDITION:
			caps.VolumeCondition = true
		case csi.ControllerServiceCapability_RPC_GET_VOLUME:
			caps.GetVolume = true
		case csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER:
			caps.SingleNodeMultiWriter = true
		case csi.ControllerServiceCapability_RPC_MODIFY_VOLUME:
			caps.ModifyVolume = true
		case csi.ControllerServiceCapability_RPC_GET_SNAPSHOT:
			caps.GetSnapshot = true
		}
	}
	return caps
}

func (c *grpcClient) NodeInfo(ctx context.Context) (NodeInfo, error) {
	var resp *csi.NodeGetInfoResponse
	err := c.call(ctx, csiclient.NodeGetInfo, func(ctx context.Context) (err error) {
		resp, err = c.conn.Node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		return err
	})
	if err != nil {
		return NodeInfo{}, err
	}
	if resp.GetNodeId() == "" {
		return NodeInfo{}, fmt.Errorf("NodeGetInfo on plugin socket %q returned an empty node_id", c.socket)
	}
	info := NodeInfo{NodeID: resp.GetNodeId(), MaxVolumes: resp.GetMaxVolumesPerNode()}
	if segs := resp.GetAccessibleTopology().GetSegments(); len(segs) > 0 {
		info.Topology = make(map[string]string, len(segs))
		for k, v := range segs {
			info.Topology[k] = v
		}
	}
	return info, nil
}

func (c *grpcClient) NodeCapabilities(ctx context.Context) (NodeCapabilities, error) {
	var resp *csi.NodeGetCapabilitiesResponse
	err := c.call(ctx, csiclient.NodeGetCapabilities, func(ctx context.Context) (err error) {
		resp, err = c.conn.Node.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
		return err
	})
	if err != nil {
		return NodeCapabilities{}, err
	}
	return nodeCapabilities(resp), nil
}

func nodeCapabilities(resp *csi.NodeGetCapabilitiesResponse) NodeCapabilities {
	var caps NodeCapabilities
	for _, c := range resp.GetCapabilities() {
		switch c.GetRpc().GetType() {
		case csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME:
			caps.StageUnstageVolume = true
		case csi.NodeServiceCapability_RPC_GET_VOLUME_STATS:
			caps.GetVolumeStats = true
		case csi.NodeServiceCapability_RPC_EXPAND_VOLUME:
			caps.ExpandVolume = true
		case csi.NodeServiceCapability_RPC_VOLUME_CONDITION:
			caps.VolumeCondition = true
		case csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER:
			caps.SingleNodeMultiWriter = true
		case csi.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP:
			caps.VolumeMountGroup = true
		}
	}
	return caps
}
