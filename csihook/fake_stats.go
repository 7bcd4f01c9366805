package csihook

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

var _ StatsClient = (*FakeClient)(nil)

// fakeStats is what FakeClient answers to NodeGetVolumeStats, per volume.
type fakeStats struct {
	conditions map[string]*csi.VolumeCondition
	usage      map[string][]*csi.VolumeUsage
}

// SetUsage makes NodeGetVolumeStats of volumeID answer usage in place of
// the default.
func (f *FakeClient) SetUsage(volumeID string, usage ...*csi.VolumeUsage) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stats.usage == nil {
		f.stats.usage = map[string][]*csi.VolumeUsage{}
	}
	f.stats.usage[volumeID] = usage
}

// SetCondition makes NodeGetVolumeStats of volumeID answer the condition
// (abnormal with msg, or normal).
func (f *FakeClient) SetCondition(volumeID string, abnormal bool, msg string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stats.conditions == nil {
		f.stats.conditions = map[string]*csi.VolumeCondition{}
	}
	f.stats.conditions[volumeID] = &csi.VolumeCondition{Abnormal: abnormal, Message: msg}
}

// NodeGetVolumeStats answers what SetUsage gave (else 1 GiB with 1 KiB
// used and 1000 inodes with 10 used), and the condition SetCondition gave (normal "ok" otherwise).
func (f *FakeClient) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	err := f.begin(ctx, FakeCall{Method: MethodNodeGetVolumeStats, VolumeID: req.GetVolumeId(),
		StagingPath: req.GetStagingTargetPath(), TargetPath: req.GetVolumePath()})
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	cond := f.stats.conditions[req.GetVolumeId()]
	usage, ok := f.stats.usage[req.GetVolumeId()]
	f.mu.Unlock()
	if cond == nil {
		cond = &csi.VolumeCondition{Message: "ok"}
	}
	if !ok {
		usage = []*csi.VolumeUsage{
			{Unit: csi.VolumeUsage_BYTES, Total: 1 << 30, Used: 1 << 10, Available: 1<<30 - 1<<10},
			{Unit: csi.VolumeUsage_INODES, Total: 1000, Used: 10, Available: 990},
		}
	}
	return &csi.NodeGetVolumeStatsResponse{
		Usage:           usage,
		VolumeCondition: &csi.VolumeCondition{Abnormal: cond.GetAbnormal(), Message: cond.GetMessage()},
	}, nil
}
