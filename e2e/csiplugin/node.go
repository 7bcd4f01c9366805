package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

func (p *plugin) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	if p.cfg.noNodeInfo {
		return nil, status.Error(codes.Unimplemented, "NodeGetInfo is not implemented (--no-node-info)")
	}
	resp := &csi.NodeGetInfoResponse{NodeId: p.cfg.nodeID, MaxVolumesPerNode: p.cfg.maxVolumes}
	if len(p.cfg.topology) > 0 {
		resp.AccessibleTopology = &csi.Topology{Segments: p.cfg.topology}
	}
	return resp, nil
}

func (p *plugin) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	resp := &csi.NodeGetCapabilitiesResponse{}
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_VOLUME_CONDITION,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		resp.Capabilities = append(resp.Capabilities, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}},
		})
	}
	if p.cfg.mountGroup {
		t := csi.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP
		resp.Capabilities = append(resp.Capabilities, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}},
		})
	}
	return resp, nil
}

// holds reports whether path is where v is mounted: a bind of its
// directory, the root of its ext4 filesystem, or its loop device node.
func (p *plugin) holds(v *volume, path string) bool {
	dev, ino, rdev, mode, err := statID(path)
	if err != nil {
		return false
	}
	if v.Type == typeFuse {
		return fuseHolds(v, path)
	}
	if v.Type == typeDir {
		ddev, dino, _, _, err := statID(p.store.dataPath(v))
		return err == nil && dev == ddev && ino == dino
	}
	if v.Loop == "" || loopBacking(v.Loop) != p.store.dataPath(v) {
		return false
	}
	_, _, lrdev, _, err := statID(v.Loop)
	if err != nil {
		return false
	}
	if mode&unix.S_IFMT == unix.S_IFBLK {
		return rdev == lrdev
	}
	return dev == lrdev
}

// prune forgets stages and targets that are no longer really there, so a
// mount someone else removed does not wedge the volume.
func (p *plugin) prune(v *volume) {
	for path, r := range v.Staged {
		attached := v.Loop != "" && loopBacking(v.Loop) == p.store.dataPath(v)
		if r.Block && !attached || !r.Block && !(isMountPoint(path) && p.holds(v, path)) || v.Type == typeFuse && !fuseLive(path) {
			delete(v.Staged, path)
		}
	}
	for path := range v.Targets {
		if !(isMountPoint(path) && p.holds(v, path)) {
			delete(v.Targets, path)
		}
	}
}

func (p *plugin) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	if err := need("volume_id", req.GetVolumeId(), "staging_target_path", req.GetStagingTargetPath()); err != nil {
		return nil, err
	}
	if req.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	if err := p.checkSecret(req.GetSecrets()); err != nil {
		return nil, err
	}
	if p.cfg.echoSecrets && len(req.GetSecrets()) > 0 {
		return nil, echoSecretsError(req.GetSecrets())
	}
	stg := filepath.Clean(req.GetStagingTargetPath())
	defer p.store.lock(req.GetVolumeId())()
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist", req.GetVolumeId())
	}
	c := req.GetVolumeCapability()
	if err := checkCapability(v.Type, p.withoutMountGroup(c)); err != nil {
		return nil, err
	}
	rec := mountRecord{Block: c.GetBlock() != nil, ReadOnly: readerOnly(c), Flags: c.GetMount().GetMountFlags(), Mode: c.GetAccessMode().GetMode().String()}
	if p.cfg.controllerPublish {
		ro, published := v.Published[p.cfg.nodeID]
		if !published || req.GetPublishContext()["device"] != p.store.dataPath(v) {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %q is not controller-published to node %q: call ControllerPublishVolume and pass its publish_context", v.ID, p.cfg.nodeID)
		}
		rec.ReadOnly = rec.ReadOnly || ro
	}
	p.prune(v)
	if old, ok := v.Staged[stg]; ok {
		if !old.same(rec) {
			return nil, status.Errorf(codes.AlreadyExists, "volume %q is already staged at %q with a different capability", v.ID, stg)
		}
		return &csi.NodeStageVolumeResponse{}, nil
	}
	if max := p.cfg.maxVolumes; max > 0 && !p.cfg.controllerPublish && len(v.Staged) == 0 {
		n := int64(0)
		for _, o := range p.store.list() {
			if len(o.Staged) > 0 {
				n++
			}
		}
		if n >= max {
			return nil, status.Errorf(codes.ResourceExhausted, "node %q already has %d volumes staged, its maximum", p.cfg.nodeID, n)
		}
	}
	if err := os.MkdirAll(stg, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "failed to create staging_target_path %q: %v", stg, err)
	}
	if isMountPoint(stg) {
		return nil, status.Errorf(codes.FailedPrecondition, "staging_target_path %q already has another mount", stg)
	}
	var err error
	switch {
	case v.Type == typeDir:
		bits, _ := rec.bits()
		err = bindMount(p.store.dataPath(v), stg, bits)
	case v.Type == typeFuse:
		bits, _ := rec.bits()
		err = p.fuseStage(v, stg, fuseReadOnly(bits))
	default:
		if v.Loop, err = loopAttach(ctx, p.store.dataPath(v)); err != nil {
			return nil, status.Errorf(codes.Internal, "failed to attach volume %q to a loop device: %v", v.ID, err)
		}
		if !rec.Block {
			if err = mountExt4(v.Loop, stg, rec); err != nil {
				_ = p.detachIfUnused(ctx, v)
			}
		}
	}
	if err != nil {
		return nil, status.Errorf(codes.Internal, "failed to stage volume %q at %q: %v", v.ID, stg, err)
	}
	v.Staged[stg] = rec
	if err := p.store.save(v); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// detachIfUnused releases an ext4 volume's loop device once nothing is
// staged from it.
func (p *plugin) detachIfUnused(ctx context.Context, v *volume) error {
	if v.Loop == "" || len(v.Staged) > 0 {
		return nil
	}
	if err := loopDetach(ctx, v.Loop); err != nil {
		return err
	}
	v.Loop = ""
	return nil
}

func (p *plugin) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	if err := need("volume_id", req.GetVolumeId(), "staging_target_path", req.GetStagingTargetPath()); err != nil {
		return nil, err
	}
	stg := filepath.Clean(req.GetStagingTargetPath())
	defer p.store.lock(req.GetVolumeId())()
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist", req.GetVolumeId())
	}
	p.prune(v)
	for t, r := range v.Targets {
		if r.Staging == stg {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %q is still published at %q from %q: unpublish it first", v.ID, t, stg)
		}
	}
	if v.Type == typeFuse && p.holds(v, stg) {
		if err := fuseUnstage(stg); err != nil {
			return nil, status.Errorf(codes.Internal, "failed to unstage volume %q: %v", v.ID, err)
		}
	} else if isMountPoint(stg) && p.holds(v, stg) {
		if err := unmountAll(stg); err != nil {
			return nil, status.Errorf(codes.Internal, "failed to unstage volume %q: %v", v.ID, err)
		}
	}
	delete(v.Staged, stg)
	if err := p.detachIfUnused(ctx, v); err != nil {
		return nil, status.Errorf(codes.Internal, "failed to detach volume %q: %v", v.ID, err)
	}
	if err := p.store.save(v); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (p *plugin) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if err := need("volume_id", req.GetVolumeId(), "target_path", req.GetTargetPath(), "staging_target_path", req.GetStagingTargetPath()); err != nil {
		return nil, err
	}
	if req.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	if err := p.checkSecret(req.GetSecrets()); err != nil {
		return nil, err
	}
	target, stg := filepath.Clean(req.GetTargetPath()), filepath.Clean(req.GetStagingTargetPath())
	defer p.store.lock(req.GetVolumeId())()
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist", req.GetVolumeId())
	}
	c := req.GetVolumeCapability()
	if err := checkCapability(v.Type, p.withoutMountGroup(c)); err != nil {
		return nil, err
	}
	p.prune(v)
	staged, ok := v.Staged[stg]
	if !ok {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %q is not staged at %q: call NodeStageVolume first", v.ID, stg)
	}
	rec := mountRecord{Block: c.GetBlock() != nil, Flags: c.GetMount().GetMountFlags(), Mode: c.GetAccessMode().GetMode().String(), Staging: stg,
		ReadOnly: req.GetReadonly() || readerOnly(c) || staged.ReadOnly}
	if rec.Block != staged.Block {
		return nil, status.Errorf(codes.InvalidArgument, "volume %q was staged for %s access; publish asks for the other", v.ID, map[bool]string{true: "block", false: "mount"}[staged.Block])
	}
	if old, ok := v.Targets[target]; ok {
		if !old.same(rec) {
			return nil, status.Errorf(codes.AlreadyExists, "volume %q is already published at %q with a different capability or readonly flag", v.ID, target)
		}
		return &csi.NodePublishVolumeResponse{}, nil
	}
	single := csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER.String()
	for t, r := range v.Targets {
		if rec.Mode == single || r.Mode == single {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %q is SINGLE_NODE_SINGLE_WRITER and already published at %q", v.ID, t)
		}
	}
	if isMountPoint(target) {
		return nil, status.Errorf(codes.FailedPrecondition, "target_path %q already has another mount", target)
	}
	src := stg
	if rec.Block {
		src = v.Loop
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			return nil, status.Errorf(codes.Internal, "failed to create the parent of target_path %q: %v", target, err)
		}
		f, err := os.OpenFile(target, os.O_CREATE|os.O_RDONLY, 0o600)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "failed to create target_path %q: %v", target, err)
		}
		f.Close()
	} else if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "failed to create target_path %q: %v", target, err)
	}
	bits, _ := rec.bits()
	if err := bindMount(src, target, bits); err != nil {
		_ = os.Remove(target)
		return nil, status.Errorf(codes.Internal, "failed to publish volume %q: %v", v.ID, err)
	}
	if g := c.GetMount().GetVolumeMountGroup(); g != "" && !rec.ReadOnly {
		if err := applyMountGroup(target, g); err != nil {
			_ = unmountAll(target)
			_ = os.Remove(target)
			return nil, err
		}
	}
	v.Targets[target] = rec
	if err := p.store.save(v); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (p *plugin) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if err := need("volume_id", req.GetVolumeId(), "target_path", req.GetTargetPath()); err != nil {
		return nil, err
	}
	target := filepath.Clean(req.GetTargetPath())
	defer p.store.lock(req.GetVolumeId())()
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist", req.GetVolumeId())
	}
	_, recorded := v.Targets[target]
	mounted := isMountPoint(target)
	if mounted && !p.holds(v, target) {
		// Another volume is published here; not ours to touch.
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	if mounted {
		if err := unmountAll(target); err != nil {
			return nil, status.Errorf(codes.Internal, "failed to unpublish volume %q: %v", v.ID, err)
		}
	}
	if recorded || mounted {
		if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, status.Errorf(codes.Internal, "failed to remove target_path %q: %v", target, err)
		}
		delete(v.Targets, target)
		if err := p.store.save(v); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (p *plugin) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	if err := need("volume_id", req.GetVolumeId(), "volume_path", req.GetVolumePath()); err != nil {
		return nil, err
	}
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist", req.GetVolumeId())
	}
	path := filepath.Clean(req.GetVolumePath())
	if !p.holds(v, path) {
		return nil, status.Errorf(codes.NotFound, "volume %q is not mounted at %q", v.ID, path)
	}
	cond := &csi.VolumeCondition{Message: "ok"}
	if fi, err := os.Stat(p.store.dataPath(v)); err != nil {
		cond = &csi.VolumeCondition{Abnormal: true, Message: "backing " + v.Type + " data is gone: " + err.Error()}
	} else if v.Type == typeExt4 && loopSize(v.Loop) < fi.Size() {
		cond.Message = "ok; the image is larger than the loop device, NodeExpandVolume is due"
	}
	if msg, bad, err := p.abnormalCondition(v); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "condition rules in %s: %v", p.conditionsFile(), err)
	} else if bad {
		cond = &csi.VolumeCondition{Abnormal: true, Message: msg}
	}
	_, _, _, mode, _ := statID(path)
	if mode&unix.S_IFMT == unix.S_IFBLK {
		return &csi.NodeGetVolumeStatsResponse{VolumeCondition: cond, Usage: []*csi.VolumeUsage{
			{Unit: csi.VolumeUsage_BYTES, Total: loopSize(v.Loop)},
		}}, nil
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil {
		return nil, status.Errorf(codes.Internal, "failed to statfs %q: %v", path, err)
	}
	bs := fs.Bsize
	return &csi.NodeGetVolumeStatsResponse{VolumeCondition: cond, Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(fs.Blocks) * bs, Available: int64(fs.Bavail) * bs, Used: int64(fs.Blocks-fs.Bfree) * bs},
		{Unit: csi.VolumeUsage_INODES, Total: int64(fs.Files), Available: int64(fs.Ffree), Used: int64(fs.Files - fs.Ffree)},
	}}, nil
}

// NodeExpandVolume makes the loop device see the grown image and, for a
// mounted volume, grows the filesystem online with resize2fs.
func (p *plugin) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	if err := need("volume_id", req.GetVolumeId(), "volume_path", req.GetVolumePath()); err != nil {
		return nil, err
	}
	defer p.store.lock(req.GetVolumeId())()
	v, ok := p.store.get(req.GetVolumeId())
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist", req.GetVolumeId())
	}
	path := filepath.Clean(req.GetVolumePath())
	if !p.holds(v, path) {
		return nil, status.Errorf(codes.NotFound, "volume %q is not mounted at %q", v.ID, path)
	}
	if dirLike(v.Type) {
		return &csi.NodeExpandVolumeResponse{CapacityBytes: v.Capacity}, nil
	}
	fi, err := os.Stat(p.store.dataPath(v))
	if err != nil {
		return nil, status.Errorf(codes.Internal, "failed to stat the image of volume %q: %v", v.ID, err)
	}
	if want := req.GetCapacityRange().GetRequiredBytes(); want > fi.Size() {
		return nil, status.Errorf(codes.OutOfRange, "volume %q has %d bytes, less than the %d asked for: call ControllerExpandVolume first", v.ID, fi.Size(), want)
	}
	if _, err := runCmd(ctx, "losetup", "--set-capacity", v.Loop); err != nil {
		return nil, status.Errorf(codes.Internal, "failed to refresh the size of %s: %v", v.Loop, err)
	}
	_, _, _, mode, _ := statID(path)
	if mode&unix.S_IFMT != unix.S_IFBLK && req.GetVolumeCapability().GetBlock() == nil {
		if err := p.growFS(ctx, v); err != nil {
			return nil, status.Errorf(codes.Internal, "failed to grow the filesystem of volume %q: %v", v.ID, err)
		}
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: fi.Size()}, nil
}

// growFS grows the ext4 filesystem on v.Loop to the size of the device.
// Online resize (resize2fs on the mounted device) needs CAP_SYS_RESOURCE;
// without it the fixture unmounts the volume's targets and stages, resizes
// offline, and mounts them again as recorded. That fails, and says so, when
// something holds the volume open.
func (p *plugin) growFS(ctx context.Context, v *volume) error {
	if hasCapability(unix.CAP_SYS_RESOURCE) {
		_, err := runCmd(ctx, "resize2fs", v.Loop)
		return err
	}
	log.Printf("offline resize volume_id=%s reason=%q", v.ID, "no CAP_SYS_RESOURCE for online resize")
	type down struct {
		path string
		rec  mountRecord
	}
	var stages, targets []down
	var err error
	for t, r := range v.Targets {
		if err == nil && !r.Block {
			if err = unmountAll(t); err == nil {
				targets = append(targets, down{t, r})
			}
		}
	}
	for s, r := range v.Staged {
		if err == nil && !r.Block {
			if err = unmountAll(s); err == nil {
				stages = append(stages, down{s, r})
			}
		}
	}
	if err == nil {
		_, err = runCmd(ctx, "resize2fs", "-f", v.Loop)
	}
	for _, d := range stages {
		err = errors.Join(err, mountExt4(v.Loop, d.path, d.rec))
	}
	for _, d := range targets {
		bits, _ := d.rec.bits()
		err = errors.Join(err, bindMount(d.rec.Staging, d.path, bits))
	}
	return err
}

// mountExt4 mounts an attached ext4 volume at path as rec says.
func mountExt4(dev, path string, rec mountRecord) error {
	bits, data := rec.bits()
	if err := unix.Mount(dev, path, typeExt4, bits, strings.Join(data, ",")); err != nil {
		return fmt.Errorf("failed to mount %s at %q: %w", dev, path, err)
	}
	return nil
}

// applyMountGroup makes a published volume's root writable by the group
// the CO sent in volume_mount_group, as a plugin with VOLUME_MOUNT_GROUP
// does: the group, setgid and g+rwx on the root directory.
func applyMountGroup(target, group string) error {
	gid, err := strconv.Atoi(group)
	if err != nil || gid < 0 {
		return status.Errorf(codes.InvalidArgument, "volume_mount_group %q is not a numeric gid", group)
	}
	if err := os.Lchown(target, -1, gid); err != nil {
		return status.Errorf(codes.Internal, "failed to give %q group %d: %v", target, gid, err)
	}
	fi, err := os.Lstat(target)
	if err != nil {
		return status.Errorf(codes.Internal, "failed to stat %q: %v", target, err)
	}
	if err := os.Chmod(target, fi.Mode().Perm()|0o070|os.ModeSetgid); err != nil {
		return status.Errorf(codes.Internal, "failed to make %q group-writable: %v", target, err)
	}
	return nil
}

// withoutMountGroup is c without its volume_mount_group when the plugin
// advertises VOLUME_MOUNT_GROUP: checkCapability refuses the field from a
// CO that sends it to a plugin without the capability.
func (p *plugin) withoutMountGroup(c *csi.VolumeCapability) *csi.VolumeCapability {
	if !p.cfg.mountGroup || c.GetMount().GetVolumeMountGroup() == "" {
		return c
	}
	c = proto.Clone(c).(*csi.VolumeCapability)
	c.GetMount().VolumeMountGroup = ""
	return c
}

// echoSecretsError is --echo-secrets' refusal: the secrets as a careless
// plugin shows its request, in each form such a message may take.
func echoSecretsError(secrets map[string]string) error {
	var parts []string
	for k, v := range secrets {
		j, _ := json.Marshal(v)
		parts = append(parts, fmt.Sprintf("%s=%s quoted=%q json=%s", k, v, v, j))
	}
	sort.Strings(parts)
	return status.Errorf(codes.InvalidArgument, "refusing secrets %s", strings.Join(parts, " "))
}

// checkSecret enforces --require-secret without ever showing a value.
func (p *plugin) checkSecret(secrets map[string]string) error {
	if p.cfg.requireSecret == "" {
		return nil
	}
	k, v, _ := strings.Cut(p.cfg.requireSecret, "=")
	if got, ok := secrets[k]; !ok || got != v {
		return status.Errorf(codes.PermissionDenied, "secret %q is missing or wrong", k)
	}
	return nil
}
