package csihook

import (
	"context"
	"maps"
	"os"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// FakeCall is one call recorded by FakeClient.
type FakeCall struct {
	Method string
	// VolumeID is the request's volume id (the name for CreateVolume).
	VolumeID       string
	NodeID         string
	StagingPath    string
	TargetPath     string
	Readonly       bool
	Capability     *csi.VolumeCapability
	Parameters     map[string]string
	CapacityRange  *csi.CapacityRange
	Secrets        map[string]string
	VolumeContext  map[string]string
	PublishContext map[string]string
	// Accessibility is CreateVolume's accessibility_requirements.
	Accessibility *csi.TopologyRequirement
}

// FakeClient is an in-memory Client. It records every call, fails calls
// with queued (SetNextError) or standing (SetError) errors, hangs calls on
// chosen volumes or methods until released or their context ends, and,
// with Mounter set, mounts at staging and target paths like a plugin
// would. Dial can be used as Config.Dial.
type FakeClient struct {
	// NodeID is NodeGetInfo's answer; "fake-node" when empty.
	NodeID string
	// Mounter, when set, gets a mount at each staging path and target
	// path, taken away again on unstage and unpublish.
	Mounter *mounter.Fake
	// PublishWithoutMount makes NodePublishVolume create its target as
	// an empty file and mount nothing there, as a plugin that publishes
	// a block volume by mknod(2) of its device at target_path does.
	PublishWithoutMount bool
	// NoNodeExpansion makes ControllerExpandVolume answer that no
	// NodeExpandVolume is needed.
	NoNodeExpansion bool
	// AccessibleTopology is what CreateVolume answers the volume is
	// accessible from (none when nil).
	AccessibleTopology []*csi.Topology

	mu       sync.Mutex
	calls    []FakeCall
	nextErrs map[string][]error
	errs     map[string]error
	hangs    map[string]chan struct{}
	// stats holds the answers of NodeGetVolumeStats (fake_stats.go).
	stats fakeStats
}

var _ Client = (*FakeClient)(nil)

// NewFakeClient returns a FakeClient mounting on mnt (may be nil).
func NewFakeClient(mnt *mounter.Fake) *FakeClient {
	return &FakeClient{Mounter: mnt, nextErrs: map[string][]error{}, errs: map[string]error{}, hangs: map[string]chan struct{}{}}
}

// Dial returns f for any socket.
func (f *FakeClient) Dial(string) (Client, error) { return f, nil }

// Calls returns a copy of the recorded calls.
func (f *FakeClient) Calls() []FakeCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]FakeCall(nil), f.calls...)
}

// Methods returns the recorded calls' methods in order.
func (f *FakeClient) Methods() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]string, 0, len(f.calls))
	for _, c := range f.calls {
		out = append(out, c.Method)
	}
	return out
}

// Count returns how many times method was called.
func (f *FakeClient) Count(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.calls {
		if c.Method == method {
			n++
		}
	}
	return n
}

// ResetCalls forgets the recorded calls.
func (f *FakeClient) ResetCalls() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = nil
}

// SetNextError makes the next calls of method fail with errs, one each.
func (f *FakeClient) SetNextError(method string, errs ...error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextErrs[method] = append(f.nextErrs[method], errs...)
}

// SetError makes every call of method fail with err until it is set to
// nil. Queued errors go first.
func (f *FakeClient) SetError(method string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err == nil {
		delete(f.errs, method)
		return
	}
	f.errs[method] = err
}

// Hang makes every call on volumeID block until release is called or the
// call's context ends (DeadlineExceeded or Canceled).
func (f *FakeClient) Hang(volumeID string) (release func()) { return f.hang("vol:" + volumeID) }

// HangMethod is Hang for every call of a method.
func (f *FakeClient) HangMethod(method string) (release func()) { return f.hang("method:" + method) }

func (f *FakeClient) hang(key string) func() {
	f.mu.Lock()
	defer f.mu.Unlock()
	ch := make(chan struct{})
	f.hangs[key] = ch
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			if f.hangs[key] == ch {
				delete(f.hangs, key)
			}
			f.mu.Unlock()
			close(ch)
		})
	}
}

// begin records c, waits out any hang and returns the error to fail with.
func (f *FakeClient) begin(ctx context.Context, c FakeCall) error {
	f.mu.Lock()
	c.Secrets, c.VolumeContext, c.PublishContext = maps.Clone(c.Secrets), maps.Clone(c.VolumeContext), maps.Clone(c.PublishContext)
	f.calls = append(f.calls, c)
	var waits []chan struct{}
	for _, key := range []string{"vol:" + c.VolumeID, "method:" + c.Method} {
		if ch, ok := f.hangs[key]; ok {
			waits = append(waits, ch)
		}
	}
	f.mu.Unlock()
	for _, ch := range waits {
		select {
		case <-ch:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if q := f.nextErrs[c.Method]; len(q) > 0 {
		f.nextErrs[c.Method] = q[1:]
		return q[0]
	}
	return f.errs[c.Method]
}

func (f *FakeClient) NodeGetInfo(ctx context.Context, _ *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	if err := f.begin(ctx, FakeCall{Method: MethodNodeGetInfo}); err != nil {
		return nil, err
	}
	id := f.NodeID
	if id == "" {
		id = "fake-node"
	}
	return &csi.NodeGetInfoResponse{NodeId: id}, nil
}

// CreateVolume answers volume id "id-<name>" and context {"created": name}.
func (f *FakeClient) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	var vc *csi.VolumeCapability
	if len(req.GetVolumeCapabilities()) > 0 {
		vc = req.GetVolumeCapabilities()[0]
	}
	err := f.begin(ctx, FakeCall{Method: MethodCreateVolume, VolumeID: req.GetName(), Capability: vc,
		Parameters: maps.Clone(req.GetParameters()), CapacityRange: req.GetCapacityRange(), Secrets: req.GetSecrets(),
		Accessibility: req.GetAccessibilityRequirements()})
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	topo := f.AccessibleTopology
	f.mu.Unlock()
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{
		VolumeId: "id-" + req.GetName(), CapacityBytes: req.GetCapacityRange().GetRequiredBytes(),
		VolumeContext: map[string]string{"created": req.GetName()}, AccessibleTopology: topo,
	}}, nil
}

// ControllerPublishVolume answers publish context {"device": "/dev/fake-<id>"}.
func (f *FakeClient) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	err := f.begin(ctx, FakeCall{Method: MethodControllerPublishVolume, VolumeID: req.GetVolumeId(), NodeID: req.GetNodeId(),
		Readonly: req.GetReadonly(), Capability: req.GetVolumeCapability(), Secrets: req.GetSecrets(), VolumeContext: req.GetVolumeContext()})
	if err != nil {
		return nil, err
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{"device": "/dev/fake-" + req.GetVolumeId()}}, nil
}

func (f *FakeClient) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	err := f.begin(ctx, FakeCall{Method: MethodControllerUnpublishVolume, VolumeID: req.GetVolumeId(), NodeID: req.GetNodeId(), Secrets: req.GetSecrets()})
	if err != nil {
		return nil, err
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

func (f *FakeClient) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	err := f.begin(ctx, FakeCall{Method: MethodNodeStageVolume, VolumeID: req.GetVolumeId(), StagingPath: req.GetStagingTargetPath(),
		Capability: req.GetVolumeCapability(), Secrets: req.GetSecrets(), VolumeContext: req.GetVolumeContext(), PublishContext: req.GetPublishContext()})
	if err != nil {
		return nil, err
	}
	if f.Mounter != nil && req.GetVolumeCapability().GetMount() != nil {
		if ok, _ := f.Mounter.IsMountPoint(req.GetStagingTargetPath()); !ok {
			if err := f.Mounter.Mount("fake:"+req.GetVolumeId(), req.GetStagingTargetPath(), "ext4", 0, ""); err != nil {
				return nil, status.Error(codes.Internal, err.Error())
			}
		}
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (f *FakeClient) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	err := f.begin(ctx, FakeCall{Method: MethodNodeUnstageVolume, VolumeID: req.GetVolumeId(), StagingPath: req.GetStagingTargetPath()})
	if err != nil {
		return nil, err
	}
	if f.Mounter != nil {
		if err := f.Mounter.Unmount(req.GetStagingTargetPath()); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (f *FakeClient) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	err := f.begin(ctx, FakeCall{Method: MethodNodePublishVolume, VolumeID: req.GetVolumeId(), StagingPath: req.GetStagingTargetPath(),
		TargetPath: req.GetTargetPath(), Readonly: req.GetReadonly(), Capability: req.GetVolumeCapability(),
		Secrets: req.GetSecrets(), VolumeContext: req.GetVolumeContext(), PublishContext: req.GetPublishContext()})
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	noMount := f.PublishWithoutMount
	f.mu.Unlock()
	if noMount {
		if err := os.WriteFile(req.GetTargetPath(), nil, 0o600); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if f.Mounter != nil {
		if ok, _ := f.Mounter.IsMountPoint(req.GetTargetPath()); !ok {
			src := req.GetStagingTargetPath()
			if src == "" {
				src = "/fake/" + req.GetVolumeId()
			}
			if err := f.Mounter.BindMount(src, req.GetTargetPath(), req.GetReadonly(), false); err != nil {
				return nil, status.Error(codes.Internal, err.Error())
			}
		}
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (f *FakeClient) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	err := f.begin(ctx, FakeCall{Method: MethodNodeUnpublishVolume, VolumeID: req.GetVolumeId(), TargetPath: req.GetTargetPath()})
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	noMount := f.PublishWithoutMount
	f.mu.Unlock()
	if noMount {
		if err := os.Remove(req.GetTargetPath()); err != nil && !os.IsNotExist(err) {
			return nil, status.Error(codes.Internal, err.Error())
		}
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	if f.Mounter != nil {
		if err := f.Mounter.Unmount(req.GetTargetPath()); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// ControllerExpandVolume answers the required bytes as the new capacity.
func (f *FakeClient) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	err := f.begin(ctx, FakeCall{Method: MethodControllerExpandVolume, VolumeID: req.GetVolumeId(), Capability: req.GetVolumeCapability(),
		CapacityRange: req.GetCapacityRange(), Secrets: req.GetSecrets()})
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	node := !f.NoNodeExpansion
	f.mu.Unlock()
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: req.GetCapacityRange().GetRequiredBytes(), NodeExpansionRequired: node}, nil
}

// NodeExpandVolume answers the required bytes as the new capacity.
func (f *FakeClient) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	err := f.begin(ctx, FakeCall{Method: MethodNodeExpandVolume, VolumeID: req.GetVolumeId(), StagingPath: req.GetStagingTargetPath(),
		TargetPath: req.GetVolumePath(), Capability: req.GetVolumeCapability(), CapacityRange: req.GetCapacityRange(), Secrets: req.GetSecrets()})
	if err != nil {
		return nil, err
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: req.GetCapacityRange().GetRequiredBytes()}, nil
}

// Close does nothing; the fake stays usable.
func (f *FakeClient) Close() error { return nil }
