package csihook

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// Client is the part of a CSI plugin's Controller and Node services the
// volume lifecycle needs. Every method is one RPC under the caller's
// context; errors are gRPC status errors as the plugin sent them.
type Client interface {
	NodeGetInfo(ctx context.Context, req *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error)
	CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error)
	ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error)
	ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error)
	NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error)
	NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error)
	NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error)
	NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error)
	ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error)
	NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error)
	Close() error
}

// Names of the RPCs, as used by FakeClient and in logs.
const (
	MethodNodeGetInfo               = csiclient.NodeGetInfo
	MethodCreateVolume              = csiclient.CreateVolume
	MethodControllerPublishVolume   = csiclient.ControllerPublishVolume
	MethodControllerUnpublishVolume = csiclient.ControllerUnpublishVolume
	MethodNodeStageVolume           = csiclient.NodeStageVolume
	MethodNodeUnstageVolume         = csiclient.NodeUnstageVolume
	MethodNodePublishVolume         = csiclient.NodePublishVolume
	MethodNodeUnpublishVolume       = csiclient.NodeUnpublishVolume
	MethodControllerExpandVolume    = csiclient.ControllerExpandVolume
	MethodNodeExpandVolume          = csiclient.NodeExpandVolume
)

type grpcClient struct {
	conn *csiclient.Conn
	node csi.NodeClient
	ctrl csi.ControllerClient
}

var _ Client = (*grpcClient)(nil)

// DialUnix returns a Client for the plugin listening on the unix socket
// at path. It does not connect until the first call, so a plugin that is
// down shows as Unavailable on that call.
func DialUnix(path string) (Client, error) { return DialUnixPeer(path, nil) }

// DialUnixPeer is DialUnix with a check of the process listening on the
// socket before each connection is used (csiclient.Options.Peer).
func DialUnixPeer(path string, peer func(pid int32) error) (Client, error) {
	if !filepath.IsAbs(path) {
		return nil, fmt.Errorf("CSI socket path %q must be absolute", path)
	}
	conn, err := csiclient.Dial(path, csiclient.Options{Peer: peer})
	if err != nil {
		return nil, fmt.Errorf("failed to create a client for CSI socket %q: %w", path, err)
	}
	return &grpcClient{conn: conn, node: conn.Node, ctrl: conn.Controller}, nil
}

func (c *grpcClient) NodeGetInfo(ctx context.Context, req *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return c.node.NodeGetInfo(ctx, req)
}

func (c *grpcClient) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	return c.ctrl.CreateVolume(ctx, req)
}

func (c *grpcClient) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	return c.ctrl.ControllerPublishVolume(ctx, req)
}

func (c *grpcClient) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	return c.ctrl.ControllerUnpublishVolume(ctx, req)
}

func (c *grpcClient) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	return c.node.NodeStageVolume(ctx, req)
}

func (c *grpcClient) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	return c.node.NodeUnstageVolume(ctx, req)
}

func (c *grpcClient) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	return c.node.NodePublishVolume(ctx, req)
}

func (c *grpcClient) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	return c.node.NodeUnpublishVolume(ctx, req)
}

func (c *grpcClient) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	return c.ctrl.ControllerExpandVolume(ctx, req)
}

func (c *grpcClient) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	return c.node.NodeExpandVolume(ctx, req)
}

func (c *grpcClient) Close() error { return c.conn.Close() }
