package main

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

const (
	minExt4Size     = 16 << 20
	defaultExt4Size = 64 << 20
	tokenPrefix     = "after:"
)

// need returns InvalidArgument naming the first empty field of the
// name/value pairs.
func need(fields ...string) error {
	for i := 0; i+1 < len(fields); i += 2 {
		if fields[i+1] == "" {
			return status.Errorf(codes.InvalidArgument, "%s is required", fields[i])
		}
	}
	return nil
}

// checkCapability says whether a volume of type typ can serve c.
func checkCapability(typ string, c *csi.VolumeCapability) error {
	switch {
	case c == nil:
		return status.Error(codes.InvalidArgument, "volume_capability is required")
	case c.GetAccessMode() == nil || c.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_UNKNOWN:
		return status.Error(codes.InvalidArgument, "volume_capability.access_mode must be set to a known mode")
	case c.GetBlock() == nil && c.GetMount() == nil:
		return status.Error(codes.InvalidArgument, "volume_capability must have an access_type, block or mount")
	case c.GetBlock() != nil && dirLike(typ):
		return status.Errorf(codes.InvalidArgument, `block access needs a volume of type "ext4"; %q volumes can only be mounted`, typ)
	case c.GetMount() != nil && typ == typeExt4 && c.GetMount().GetFsType() != "" && c.GetMount().GetFsType() != typeExt4:
		return status.Errorf(codes.InvalidArgument, "volume_capability.mount.fs_type must be empty or ext4 for ext4 volumes, not %q", c.GetMount().GetFsType())
	case c.GetMount().GetVolumeMountGroup() != "":
		return status.Error(codes.InvalidArgument, "volume_mount_group is not supported")
	}
	if _, data := parseMountFlags(c.GetMount().GetMountFlags()); dirLike(typ) && len(data) > 0 {
		return status.Errorf(codes.InvalidArgument, "mount_flags %q are not supported for %s volumes", data, typ)
	}
	return nil
}

func readerOnly(c *csi.VolumeCapability) bool {
	m := c.GetAccessMode().GetMode()
	return m == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY || m == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
}

func volumeType(params map[string]string) (string, error) {
	typ := typeDir
	for k, v := range params {
		if k != "type" {
			return "", status.Errorf(codes.InvalidArgument, "unknown parameter %q: the only parameter is type", k)
		}
		typ = v
	}
	if typ != typeDir && typ != typeExt4 && typ != typeFuse {
		return "", status.Errorf(codes.InvalidArgument, "parameter type must be dir, ext4 or fuse, not %q", typ)
	}
	return typ, nil
}

// pickSize chooses the size of a new volume from its capacity range. A dir
// volume has no size of its own and records what was asked for.
func pickSize(typ string, cr *csi.CapacityRange) (int64, error) {
	req, lim := cr.GetRequiredBytes(), cr.GetLimitBytes()
	switch {
	case req < 0 || lim < 0:
		return 0, status.Error(codes.InvalidArgument, "capacity_range must not be negative")
	case lim > 0 && req > lim:
		return 0, status.Errorf(codes.InvalidArgument, "capacity_range.required_bytes %d exceeds limit_bytes %d", req, lim)
	case dirLike(typ):
		return req, nil
	}
	size := req
	if size == 0 {
		size = defaultExt4Size
		if lim > 0 && lim < size {
			size = lim
		}
	}
	if size < minExt4Size {
		if lim > 0 && lim < minExt4Size {
			return 0, status.Errorf(codes.OutOfRange, "ext4 volumes need at least %d bytes; limit_bytes is %d", minExt4Size, lim)
		}
		size = minExt4Size
	}
	return size, nil
}

func fits(capacity int64, cr *csi.CapacityRange) bool {
	return capacity >= cr.GetRequiredBytes() && (cr.GetLimitBytes() == 0 || capacity <= cr.GetLimitBytes())
}

// topologyOK says whether this node satisfies the requisite topologies (any
// one of them) of a request.
func (p *plugin) topologyOK(req *csi.TopologyRequirement) bool {
	if len(req.GetRequisite()) == 0 {
		return true
	}
	for _, t := range req.GetRequisite() {
		match := true
		for k, v := range t.GetSegments() {
			if p.cfg.topology[k] != v {
				match = false
			}
		}
		if match {
			return true
		}
	}
	return false
}

func (p *plugin) csiVolume(v *volume) *csi.Volume {
	out := &csi.Volume{VolumeId: v.ID, CapacityBytes: v.Capacity, VolumeContext: map[string]string{"type": v.Type}}
	if len(p.cfg.createdTopology) > 0 {
		out.AccessibleTopology = []*csi.Topology{{Segments: p.cfg.createdTopology}}
	} else if len(p.cfg.topology) > 0 {
		out.AccessibleTopology = []*csi.Topology{{Segments: p.cfg.topology}}
	}
	return out
}

func (p *plugin) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if err := need("name", req.GetName()); err != nil {
		return nil, err
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume_capabilities is required")
	}
	typ, err := volumeType(req.GetParameters())
	if err != nil {
		return nil, err
	}
	for _, c := range req.GetVolumeCapabilities() {
		if err := checkCapability(typ, c); err != nil {
			return nil, err
		}
	}
	if req.GetVolumeContentSource() != nil {
		return nil, status.Error(codes.InvalidArgument, "volume_content_source is not supported: the fixture has no snapshots or clones")
	}
	size, err := pickSize(typ, req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	if !p.topologyOK(req.GetAccessibilityRequirements()) {
		return nil, status.Errorf(codes.ResourceExhausted, "no requisite topology matches this node's %v", p.cfg.topology)
	}

	defer p.store.lock("name/" + req.GetName())()
	if v, ok := p.store.byName(req.GetName()); ok {
		if v.Type != typ || !fits(v.Capacity, req.GetCapacityRange()) {
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists as %s with %d bytes, which does not match this request", req.GetName(), v.Type, v.Capacity)
		}
		return &csi.CreateVolumeResponse{Volume: p.csiVolume(v)}, nil
	}
	v := clone(&volume{ID: newVolumeID(), Name: req.GetName(), Type: typ, Capacity: size})
	data := p.store.dataPath(v)
	if dirLike(typ) {
		err = os.Mkdir(data, 0o777)
		if err == nil {
			err = os.Chmod(data, 0o777) // tasks may run as any user
		}
	} else {
		err = makeExt4Image(ctx, data, size)
	}
	if err != nil {
		_ = os.RemoveAll(data)
		return nil, status.Errorf(codes.Internal, "failed to create volume %q: %v", req.GetName(), err)
	}
	if err := p.store.save(v); err != nil {
		_ = os.RemoveAll(data)
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.CreateVolumeResponse{Volume: p.csiVolume(v)}, nil
}

// makeExt4Image creates a sparse image of size bytes and formats it. Lazy
// init keeps mkfs from writing the inode tables and journal up front.
func makeExt4Image(ctx context.Context, path string, size int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	_, err = runCmd(ctx, "mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1", "-m", "0", path)
	return err
}

func (p *plugin) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if err := need("volume_id", req.GetVolumeId()); err != nil {
		return nil, err
	}
	defer p.store.lock(req.GetVolumeId())()
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return &csi.DeleteVolumeResponse{}, nil
	}
	p.prune(v)
	if len(v.Published) > 0 || len(v.Staged) > 0 || len(v.Targets) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %q is still in use: published to %d nodes, staged at %d paths, published at %d targets",
			v.ID, len(v.Published), len(v.Staged), len(v.Targets))
	}
	if v.Loop != "" {
		if err := loopDetach(ctx, v.Loop); err != nil {
			return nil, status.Errorf(codes.Internal, "failed to detach volume %q from %s: %v", v.ID, v.Loop, err)
		}
	}
	if err := os.RemoveAll(p.store.dataPath(v)); err != nil {
		return nil, status.Errorf(codes.Internal, "failed to delete volume %q: %v", v.ID, err)
	}
	if err := p.store.remove(v.ID); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.DeleteVolumeResponse{}, nil
}

func (p *plugin) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	if !p.cfg.controllerPublish {
		return nil, status.Error(codes.Unimplemented, "ControllerPublishVolume needs --controller-publish")
	}
	if err := need("volume_id", req.GetVolumeId(), "node_id", req.GetNodeId()); err != nil {
		return nil, err
	}
	if req.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	if p.cfg.noPublishReadonly && req.GetReadonly() {
		return nil, status.Error(codes.InvalidArgument, "readonly must be false: this plugin has no PUBLISH_READONLY capability")
	}
	defer p.store.lock(req.GetVolumeId())()
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist", req.GetVolumeId())
	}
	if req.GetNodeId() != p.cfg.nodeID {
		return nil, status.Errorf(codes.NotFound, "node %q does not exist; this plugin serves node %q", req.GetNodeId(), p.cfg.nodeID)
	}
	if err := checkCapability(v.Type, req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	pubCtx := map[string]string{"device": p.store.dataPath(v), "type": v.Type}
	if ro, ok := v.Published[req.GetNodeId()]; ok {
		if ro != req.GetReadonly() {
			return nil, status.Errorf(codes.AlreadyExists, "volume %q is already published to node %q with readonly=%t", v.ID, req.GetNodeId(), ro)
		}
		return &csi.ControllerPublishVolumeResponse{PublishContext: pubCtx}, nil
	}
	if max := p.cfg.maxVolumes; max > 0 {
		n := int64(0)
		for _, o := range p.store.list() {
			if _, ok := o.Published[req.GetNodeId()]; ok {
				n++
			}
		}
		if n >= max {
			return nil, status.Errorf(codes.ResourceExhausted, "node %q already has %d volumes published, its maximum", req.GetNodeId(), n)
		}
	}
	v.Published[req.GetNodeId()] = req.GetReadonly()
	if err := p.store.save(v); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: pubCtx}, nil
}

func (p *plugin) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if !p.cfg.controllerPublish {
		return nil, status.Error(codes.Unimplemented, "ControllerUnpublishVolume needs --controller-publish")
	}
	if err := need("volume_id", req.GetVolumeId()); err != nil {
		return nil, err
	}
	// An unknown volume or node is as unpublished as it gets: the spec
	// asks for OK then.
	defer p.store.lock(req.GetVolumeId())()
	v, ok := p.store.get(req.GetVolumeId())
	if n := req.GetNodeId(); !ok || n != "" && n != p.cfg.nodeID || len(v.Published) == 0 {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	v.Published = nil
	if err := p.store.save(v); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

func (p *plugin) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if err := need("volume_id", req.GetVolumeId()); err != nil {
		return nil, err
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume_capabilities is required")
	}
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist", req.GetVolumeId())
	}
	if len(req.GetParameters()) > 0 {
		if typ, err := volumeType(req.GetParameters()); err != nil || typ != v.Type {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: fmt.Sprintf("volume %q is of type %s", v.ID, v.Type)}, nil
		}
	}
	for _, c := range req.GetVolumeCapabilities() {
		if err := checkCapability(v.Type, c); err != nil {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
		}
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

// ListVolumes pages by ID: a token is "after:" and the last ID of the
// previous page, so deleting volumes between pages loses nothing.
func (p *plugin) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	if req.GetMaxEntries() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max_entries must not be negative")
	}
	vols := p.store.list()
	start := 0
	if tok := req.GetStartingToken(); tok != "" {
		after, ok := strings.CutPrefix(tok, tokenPrefix)
		if !ok || after == "" {
			return nil, status.Errorf(codes.Aborted, "starting_token %q was not issued by this plugin", tok)
		}
		start = sort.Search(len(vols), func(i int) bool { return vols[i].ID > after })
	}
	end, next := len(vols), ""
	if max := int(req.GetMaxEntries()); max > 0 && start+max < len(vols) {
		end = start + max
		next = tokenPrefix + vols[end-1].ID
	}
	resp := &csi.ListVolumesResponse{NextToken: next}
	for _, v := range vols[start:end] {
		e := &csi.ListVolumesResponse_Entry{Volume: p.csiVolume(v)}
		if p.cfg.controllerPublish {
			e.Status = &csi.ListVolumesResponse_VolumeStatus{}
			for n := range v.Published {
				e.Status.PublishedNodeIds = append(e.Status.PublishedNodeIds, n)
			}
		}
		resp.Entries = append(resp.Entries, e)
	}
	return resp, nil
}

func (p *plugin) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	typ, err := volumeType(req.GetParameters())
	if err != nil {
		return nil, err
	}
	if t := req.GetAccessibleTopology(); t != nil && !p.topologyOK(&csi.TopologyRequirement{Requisite: []*csi.Topology{t}}) {
		return &csi.GetCapacityResponse{}, nil
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(p.store.dataDir(), &fs); err != nil {
		return nil, status.Errorf(codes.Internal, "failed to statfs %q: %v", p.store.dataDir(), err)
	}
	resp := &csi.GetCapacityResponse{AvailableCapacity: int64(fs.Bavail) * fs.Bsize}
	if typ == typeExt4 {
		resp.MinimumVolumeSize = wrapperspb.Int64(minExt4Size)
	}
	return resp, nil
}

func (p *plugin) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	types := []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	}
	if p.cfg.controllerPublish {
		types = append(types,
			csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
			csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES)
		if !p.cfg.noPublishReadonly {
			types = append(types, csi.ControllerServiceCapability_RPC_PUBLISH_READONLY)
		}
	}
	resp := &csi.ControllerGetCapabilitiesResponse{}
	for _, t := range types {
		resp.Capabilities = append(resp.Capabilities, &csi.ControllerServiceCapability{
			Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: t}},
		})
	}
	return resp, nil
}

// ControllerExpandVolume grows an ext4 image file (the node then refreshes
// the loop device and runs resize2fs) or records a dir volume's new size.
func (p *plugin) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	if err := need("volume_id", req.GetVolumeId()); err != nil {
		return nil, err
	}
	if req.GetCapacityRange() == nil {
		return nil, status.Error(codes.InvalidArgument, "capacity_range is required")
	}
	want, lim := req.GetCapacityRange().GetRequiredBytes(), req.GetCapacityRange().GetLimitBytes()
	if want < 0 || lim < 0 || lim > 0 && want > lim {
		return nil, status.Errorf(codes.InvalidArgument, "capacity_range (required_bytes %d, limit_bytes %d) is not valid", want, lim)
	}
	defer p.store.lock(req.GetVolumeId())()
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist", req.GetVolumeId())
	}
	if p.cfg.offlineExpansion && want > v.Capacity && (len(v.Published) > 0 || len(v.Staged) > 0 || len(v.Targets) > 0) {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %q is in use and this plugin expands volumes only offline", v.ID)
	}
	if lim > 0 && v.Capacity > lim {
		return nil, status.Errorf(codes.OutOfRange, "volume %q already has %d bytes, more than limit_bytes %d; volumes do not shrink", v.ID, v.Capacity, lim)
	}
	if want > v.Capacity {
		if v.Type == typeExt4 {
			if err := os.Truncate(p.store.dataPath(v), want); err != nil {
				return nil, status.Errorf(codes.Internal, "failed to grow the image of volume %q: %v", v.ID, err)
			}
		}
		v.Capacity = want
		if err := p.store.save(v); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.Capacity, NodeExpansionRequired: v.Type == typeExt4}, nil
}
