package csihook

import (
	"context"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// publishOnce is a FakeClient that answers a second NodePublishVolume of
// a volume at another target path as the CSI spec's table says a plugin
// SHOULD: FAILED_PRECONDITION unless the access mode is MULTI_NODE_...
// ("This RPC MAY be called by the CO multiple times on the same node for
// the same volume with a possibly different target_path ... if the volume
// supports either MULTI_NODE_... or SINGLE_NODE_MULTI_WRITER access
// modes"). The fake and the e2e fixture publish any number of times.
//
// A second publish with another volume_capability is refused the same
// way in every mode ("COs SHOULD NOT call NodePublishVolume a second time
// with a different volume_capability. If this happens, the Plugin SHOULD
// return FAILED_PRECONDITION").
type publishOnce struct {
	*FakeClient
	mu      sync.Mutex
	targets map[string]map[string]bool
	caps    map[string]*csi.VolumeCapability
	refused int
}

func (p *publishOnce) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	p.mu.Lock()
	if p.targets == nil {
		p.targets = map[string]map[string]bool{}
		p.caps = map[string]*csi.VolumeCapability{}
	}
	ts := p.targets[req.GetVolumeId()]
	if c := p.caps[req.GetVolumeId()]; len(ts) > 0 && !proto.Equal(c, req.GetVolumeCapability()) {
		p.refused++
		p.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is published with another capability", req.GetVolumeId())
	}
	switch req.GetVolumeCapability().GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
	default:
		for t := range ts {
			if t != req.GetTargetPath() {
				p.refused++
				p.mu.Unlock()
				return nil, status.Errorf(codes.FailedPrecondition, "volume %s is already published at %s", req.GetVolumeId(), t)
			}
		}
	}
	p.mu.Unlock()
	resp, err := p.FakeClient.NodePublishVolume(ctx, req)
	if err == nil {
		p.mu.Lock()
		if p.targets[req.GetVolumeId()] == nil {
			p.targets[req.GetVolumeId()] = map[string]bool{}
		}
		p.targets[req.GetVolumeId()][req.GetTargetPath()] = true
		p.caps[req.GetVolumeId()] = req.GetVolumeCapability()
		p.mu.Unlock()
	}
	return resp, err
}

func (p *publishOnce) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	resp, err := p.FakeClient.NodeUnpublishVolume(ctx, req)
	if err == nil {
		p.mu.Lock()
		delete(p.targets[req.GetVolumeId()], req.GetTargetPath())
		p.mu.Unlock()
	}
	return resp, err
}

// A single-node-reader-only volume is shared by the tasks of a node, each
// published at its own target, as Nomad shares it between allocations.
// A plugin that holds such a volume to one target path (CSI spec,
// NodePublishVolume's second table) refuses the second task's publish
// with FAILED_PRECONDITION, whose recovery is to "wait for the volume to
// be unpublished on the node". The second task fails without retries,
// told why and what to do; the first keeps its volume; nothing of the
// second is left.
func TestSpec_SecondPublishRefusedBySingleNodePlugin(t *testing.T) {
	var pc *publishOnce
	h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return pc, nil } })
	pc = &publishOnce{FakeClient: h.fake}
	ctx := context.Background()
	ro := func() VolumeRequest {
		r := req("data", "vol1", "/data")
		r.AccessMode, r.ReadOnly = AccessSingleNodeReaderOnly, true
		return r
	}
	_, err := h.m.Setup(ctx, "t1", []VolumeRequest{ro()})
	must.NoError(t, err)
	h.fake.ResetCalls()

	_, err = h.m.Setup(ctx, "t2", []VolumeRequest{ro()})
	must.Eq(t, codes.FailedPrecondition, Code(err))
	// Not retried: the same request would be refused the same way.
	must.Eq(t, 1, pc.refused)
	must.StrContains(t, err.Error(), `volume "vol1" is published on this node for task "t1" already, and plugin "p" publishes a volume of access_mode = "single-node-reader-only" at one path per node (CSI spec): stop task "t1" first, or use access_mode = "multi-node-reader-only" if the storage allows it`)
	h.waitIdle()
	must.Eq(t, 1, h.m.Users("p", "vol1"))
	must.SliceEmpty(t, h.callsOf(MethodNodeUnstageVolume))
	must.Eq(t, []string{h.m.StagingPath("p", "vol1"), h.m.TargetPath("t1", "data")}, h.mountPaths())

	must.NoError(t, h.m.Teardown(ctx, "t1"))
	h.waitIdle()
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
}

// Two blocks of one task naming the same single-node-reader-only volume
// publish it at two targets: the same plugin refuses the second, and the
// task is told to name the volume once.
func TestSpec_SecondPublishRefusedInOneTask(t *testing.T) {
	var pc *publishOnce
	h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return pc, nil } })
	pc = &publishOnce{FakeClient: h.fake}
	ctx := context.Background()
	a, b := req("a", "vol1", "/a"), req("b", "vol1", "/b")
	a.AccessMode, a.ReadOnly = AccessSingleNodeReaderOnly, true
	b.AccessMode, b.ReadOnly = AccessSingleNodeReaderOnly, true
	_, err := h.m.Setup(ctx, "t1", []VolumeRequest{a, b})
	must.Eq(t, codes.FailedPrecondition, Code(err))
	must.StrContains(t, err.Error(), `volume "vol1" is published on this node for volume "a" of this task already, and plugin "p" publishes a volume of access_mode = "single-node-reader-only" at one path per node (CSI spec): name the volume in one volume block of the task, or use access_mode = "multi-node-reader-only" if the storage allows it`)
	h.waitIdle()
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
}

// A multi-node volume is published for each task, with each task's
// mount_flags. A plugin that refuses a second publish with another
// volume capability, as the CSI spec has it, fails the second task, told
// which task has the volume with which flags; the same flags publish.
func TestSpec_SecondPublishWithOtherMountFlags(t *testing.T) {
	var pc *publishOnce
	h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return pc, nil } })
	pc = &publishOnce{FakeClient: h.fake}
	ctx := context.Background()
	shared := func(flags ...string) VolumeRequest {
		r := req("data", "vol1", "/data")
		r.AccessMode, r.MountFlags = AccessMultiNodeMultiWriter, flags
		return r
	}
	_, err := h.m.Setup(ctx, "t1", []VolumeRequest{shared("noatime")})
	must.NoError(t, err)
	_, err = h.m.Setup(ctx, "t2", []VolumeRequest{shared("noatime", "sync")})
	must.Eq(t, codes.FailedPrecondition, Code(err))
	must.StrContains(t, err.Error(), `volume "vol1" is published on this node for task "t1" with other mount_flags, and plugin "p" does not publish it again with another volume capability (CSI spec): use the same mount_options.mount_flags as task "t1", or stop task "t1" first`)
	must.StrNotContains(t, err.Error(), "noatime")
	must.Eq(t, 1, pc.refused)
	_, err = h.m.Setup(ctx, "t3", []VolumeRequest{shared("noatime")})
	must.NoError(t, err)
	h.waitIdle()
	must.Eq(t, 2, h.m.Users("p", "vol1"))
	must.NoError(t, h.m.Teardown(ctx, "t1"))
	must.NoError(t, h.m.Teardown(ctx, "t3"))
	h.waitIdle()
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
}

// stageForgetting is a FakeClient that keeps what it staged in memory, as
// many plugins do, and answers NodePublishVolume of a volume it has not
// staged at staging_target_path with FAILED_PRECONDITION, the CSI spec's
// "Staging target path not set" condition. forget is its restart: the
// staging mounts stay on the node, its memory of them is gone; amnesiac
// forgets every stage at once.
type stageForgetting struct {
	*FakeClient
	mu       sync.Mutex
	staged   map[string]bool
	amnesiac bool
	refused  int
}

func (p *stageForgetting) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	resp, err := p.FakeClient.NodeStageVolume(ctx, req)
	p.mu.Lock()
	if err == nil && !p.amnesiac {
		p.staged[req.GetVolumeId()+"@"+req.GetStagingTargetPath()] = true
	}
	p.mu.Unlock()
	return resp, err
}

func (p *stageForgetting) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	p.mu.Lock()
	ok := p.staged[req.GetVolumeId()+"@"+req.GetStagingTargetPath()]
	p.mu.Unlock()
	if !ok {
		p.mu.Lock()
		p.refused++
		p.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged at %q", req.GetVolumeId(), req.GetStagingTargetPath())
	}
	return p.FakeClient.NodePublishVolume(ctx, req)
}

func (p *stageForgetting) forget() {
	p.mu.Lock()
	defer p.mu.Unlock()
	clear(p.staged)
}

// NodePublishVolume answered FAILED_PRECONDITION "Staging target path not
// set": "Caller MUST make sure call to NodeStageVolume is made and returns
// success before retrying with valid staging_target_path" (CSI spec). A
// plugin restarted without its state answers so for a volume the driver
// staged before, whose staging mount is still there: the driver stages it
// again (idempotent: the same path, capability, secrets and contexts) and
// publishes once more, beside a task that has the volume. Refused again
// after that, the failure is the task's, and the other task keeps the
// volume.
func TestSpec_PublishNotStagedStagesAgain(t *testing.T) {
	var p *stageForgetting
	h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return p, nil } })
	p = &stageForgetting{FakeClient: h.fake, staged: map[string]bool{}}
	ctx := context.Background()
	multi := func(r VolumeRequest) VolumeRequest { r.AccessMode = AccessMultiNodeMultiWriter; return r }

	_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.NoError(t, err)
	var first FakeCall
	for _, c := range h.fake.Calls() {
		if c.Method == MethodNodeStageVolume {
			first = c
		}
	}
	must.NotEq(t, "", first.StagingPath)
	p.forget()
	h.fake.ResetCalls()

	_, err = h.m.Setup(ctx, "b", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.NoError(t, err)
	// The wrapper's refusal is not among the fake's calls.
	must.Eq(t, 1, p.refused)
	must.Eq(t, []string{MethodNodeStageVolume, MethodNodePublishVolume}, h.fake.Methods())
	calls := h.fake.Calls()
	must.Eq(t, first.StagingPath, calls[0].StagingPath)
	must.True(t, proto.Equal(first.Capability, calls[0].Capability))
	must.Eq(t, first.Secrets, calls[0].Secrets)
	must.Eq(t, first.VolumeContext, calls[0].VolumeContext)
	must.Eq(t, first.PublishContext, calls[0].PublishContext)
	must.Eq(t, first.StagingPath, calls[1].StagingPath)
	must.True(t, h.m.publishedAt(h.m.TargetPath("b", "data")))

	p.mu.Lock()
	p.amnesiac = true
	p.mu.Unlock()
	p.forget()
	h.fake.ResetCalls()
	_, err = h.m.Setup(ctx, "c", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.ErrorContains(t, err, "FailedPrecondition")
	must.Eq(t, 3, p.refused)
	// The failed publish is undone (NodeUnpublishVolume, which the spec
	// allows after a failure); the volume stays staged for the others.
	must.Eq(t, []string{MethodNodeStageVolume, MethodNodeUnpublishVolume}, h.fake.Methods())
	must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))
	must.Eq(t, 2, h.m.Users("p", "vol1"))

	must.NoError(t, h.m.Teardown(ctx, "a"))
	must.NoError(t, h.m.Teardown(ctx, "b"))
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}
