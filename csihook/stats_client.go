package csihook

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

var _ StatsClient = (*grpcClient)(nil)

func (c *grpcClient) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	return c.node.NodeGetVolumeStats(ctx, req)
}
