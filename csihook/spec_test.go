package csihook

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Conformance with what the CSI spec (v1.12) asks of a CO, for plugins
// that differ from the fake's defaults in one capability each.

// ControllerPublishVolumeRequest.readonly: "CO MUST set this field to
// false if SP does not have the PUBLISH_READONLY controller capability."
// A reader-only volume is still published read-only on the node.
func TestSpec_ControllerPublishReadonlyNeedsCapability(t *testing.T) {
	for _, tc := range []struct {
		name         string
		capable      bool
		mode         string
		wantCtrlRO   bool
		wantPublishR bool
	}{
		{"reader_capable", true, AccessSingleNodeReaderOnly, true, true},
		{"reader_not_capable", false, AccessSingleNodeReaderOnly, false, true},
		{"multi_reader_not_capable", false, AccessMultiNodeReaderOnly, false, true},
		{"writer_capable", true, AccessSingleNodeWriter, false, false},
		{"writer_not_capable", false, AccessSingleNodeWriter, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			p := fullPlugin("p")
			p.PublishReadonly = tc.capable
			h.setPlugin(p)
			r := req("data", "vol1", "/data")
			r.AccessMode = tc.mode
			pubs, err := h.m.Setup(context.Background(), "t", []VolumeRequest{r})
			must.NoError(t, err)
			must.Eq(t, tc.wantPublishR, pubs[0].ReadOnly)
			cp := h.callsOf(MethodControllerPublishVolume)
			must.SliceLen(t, 1, cp)
			must.Eq(t, tc.wantCtrlRO, cp[0].Readonly)
			np := h.callsOf(MethodNodePublishVolume)
			must.SliceLen(t, 1, np)
			must.Eq(t, tc.wantPublishR, np[0].Readonly)
			must.NoError(t, h.m.Teardown(context.Background(), "t"))
		})
	}
}

// CreateVolumeRequest.accessibility_requirements "SHALL NOT be specified
// unless the SP has the VOLUME_ACCESSIBILITY_CONSTRAINTS plugin
// capability"; a topology the plugin reports without it is not used.
func TestSpec_AccessibilityNeedsCapability(t *testing.T) {
	h := newHarness(t)
	p := zonedPlugin("a", 0)
	p.AccessibilityConstraints = false
	h.setPlugin(p)
	// Said to be accessible elsewhere, which only a plugin with the
	// capability can say.
	h.fake.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{"zone": "b"}}}
	must.NoError(t, h.setupAndRelease("t1", sizedReq(mib)))
	cv := h.callsOf(MethodCreateVolume)
	must.SliceLen(t, 1, cv)
	must.Nil(t, cv[0].Accessibility)
}

// A plugin whose volume expansion is OFFLINE only (VolumeExpansion
// OFFLINE, not ONLINE) must not get ControllerExpandVolume for a volume
// that is attached, staged or published on this node (CSI spec,
// ControllerExpandVolume: "If the plugin has only VolumeExpansion.OFFLINE
// expansion capability ..."). The request is refused before any call,
// naming what to do; once the volume is released the same request grows
// it. A plugin with ONLINE grows it in use, and so does one that
// advertises no VolumeExpansion at all (kubernetes-csi/csi-driver-nfs has
// only the controller EXPAND_VOLUME): the spec restricts only OFFLINE,
// and Kubernetes' external-resizer holds back only after the plugin
// answered FailedPrecondition.
func TestSpec_OfflineExpansionWaitsForRelease(t *testing.T) {
	shared := func(min int64) VolumeRequest {
		r := sizedReq(min)
		r.AccessMode = AccessMultiNodeMultiWriter
		return r
	}
	for _, tc := range []struct {
		name            string
		online, offline bool
	}{
		{"offline", false, true},
		{"online", true, false},
		{"online_and_offline", true, true},
		{"unspecified", false, false},
	} {
		online := tc.online || !tc.offline
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			p := expandPlugin(true, false)
			p.OnlineExpansion, p.OfflineExpansion = tc.online, tc.offline
			h.setPlugin(p)
			ctx := context.Background()
			_, err := h.m.Setup(ctx, "t1", []VolumeRequest{shared(64 * mib)})
			must.NoError(t, err)
			h.fake.ResetCalls()

			_, err = h.m.Setup(ctx, "t2", []VolumeRequest{shared(128 * mib)})
			if online {
				must.NoError(t, err)
				must.SliceLen(t, 1, h.callsOf(MethodControllerExpandVolume))
				must.NoError(t, h.m.Teardown(ctx, "t2"))
				must.NoError(t, h.m.Teardown(ctx, "t1"))
				return
			}
			must.ErrorIs(t, err, ErrConflict)
			must.ErrorContains(t, err, `CSI plugin "p" expands volumes only offline (no ONLINE volume expansion) and volume_id "id-scratch" is in use on node "n1": stop the tasks using it, or keep create.capacity_min at "64 MiB"`)
			must.SliceEmpty(t, h.fake.Calls())

			must.NoError(t, h.m.Teardown(ctx, "t1"))
			h.fake.ResetCalls()
			must.NoError(t, h.setupAndRelease("t2", shared(128*mib)))
			must.SliceLen(t, 1, h.callsOf(MethodControllerExpandVolume))
			// Expanded before anything else was called for the volume.
			must.Eq(t, MethodControllerExpandVolume, h.fake.Methods()[0])
			h.waitIdle()
			must.SliceEmpty(t, h.journalRecords())
		})
	}
}

// Only the access modes of CSI v1.0 are ever sent: SINGLE_NODE_SINGLE_WRITER
// and SINGLE_NODE_MULTI_WRITER may be used only with a plugin that has the
// SINGLE_NODE_MULTI_WRITER capability, and single-node-writer maps to
// SINGLE_NODE_WRITER, which every plugin takes.
func TestSpec_AccessModesAreV1(t *testing.T) {
	want := map[string]csi.VolumeCapability_AccessMode_Mode{
		AccessSingleNodeWriter:      csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		AccessSingleNodeReaderOnly:  csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		AccessMultiNodeReaderOnly:   csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY,
		AccessMultiNodeSingleWriter: csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER,
		AccessMultiNodeMultiWriter:  csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER,
	}
	for mode, csiMode := range want {
		t.Run(mode, func(t *testing.T) {
			h := newHarness(t)
			r := req("data", "vol1", "/data")
			r.AccessMode = mode
			_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{r})
			must.NoError(t, err)
			must.NoError(t, h.m.Teardown(context.Background(), "t"))
			for _, c := range h.fake.Calls() {
				if c.Capability != nil {
					must.Eq(t, csiMode, c.Capability.GetAccessMode().GetMode(), must.Sprint(c.Method))
				}
			}
		})
	}
}

// NodeExpandVolume's FAILED_PRECONDITION says the file system cannot grow
// while staged or published: "Caller MUST NOT retry." The task starts on
// the volume as it is, told so, and no later setup asks again while the
// volume stays staged. The node's part stays owed: once the volume was
// released and is staged anew it is asked again, as kubelet does (an
// in-use expansion error holds only while the volume stays mounted).
func TestSpec_NodeExpandFailedPreconditionNotRetried(t *testing.T) {
	shared := func(min int64) VolumeRequest {
		r := sizedReq(min)
		r.AccessMode = AccessMultiNodeMultiWriter
		return r
	}
	ctx := context.Background()
	h := newHarness(t)
	p := expandPlugin(true, true)
	p.OnlineExpansion = true
	h.setPlugin(p)
	must.NoError(t, h.setupAndRelease("t1", shared(64*mib)))
	h.fake.SetNextError(MethodNodeExpandVolume, status.Error(codes.FailedPrecondition, "ext4 cannot grow online here"))
	h.fake.ResetCalls()
	_, err := h.m.Setup(ctx, "t2", []VolumeRequest{shared(128 * mib)})
	must.NoError(t, err)
	must.SliceLen(t, 1, h.callsOf(MethodControllerExpandVolume))
	must.SliceLen(t, 1, h.callsOf(MethodNodeExpandVolume))
	must.True(t, containsEvent(h.eventMsgs(), `Volume "data" was not grown on this node (FailedPrecondition: ext4 cannot grow online here): it is grown once the volume is staged again`),
		must.Sprint(h.eventMsgs()))

	// Still staged: not asked again.
	h.fake.ResetCalls()
	_, err = h.m.Setup(ctx, "t3", []VolumeRequest{shared(128 * mib)})
	must.NoError(t, err)
	must.SliceEmpty(t, h.callsOf(MethodNodeExpandVolume))
	must.NoError(t, h.m.Teardown(ctx, "t3"))
	must.NoError(t, h.m.Teardown(ctx, "t2"))

	// Released and staged anew: the owed node expansion is made.
	h.fake.ResetCalls()
	must.NoError(t, h.setupAndRelease("t4", shared(128*mib)))
	must.SliceEmpty(t, h.callsOf(MethodControllerExpandVolume))
	must.SliceLen(t, 1, h.callsOf(MethodNodeExpandVolume))
	must.True(t, containsEvent(h.eventMsgs(), `Expanded volume "data"`), must.Sprint(h.eventMsgs()))

	h.restart()
	h.fake.ResetCalls()
	must.NoError(t, h.setupAndRelease("t5", shared(128*mib)))
	must.SliceEmpty(t, h.callsOf(MethodNodeExpandVolume))
	must.SliceEmpty(t, h.callsOf(MethodControllerExpandVolume))
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())
}

// pathsAtCall is a FakeClient that records, at the moment of each
// NodeStageVolume and NodePublishVolume, what the CO had made of the paths
// it passes.
type pathsAtCall struct {
	*FakeClient
	mu   sync.Mutex
	seen []string
}

func (p *pathsAtCall) note(method, path string) {
	kind := "missing"
	if fi, err := os.Lstat(path); err == nil {
		kind = "file"
		if fi.IsDir() {
			kind = "dir"
		}
	}
	parent := "missing"
	if fi, err := os.Stat(filepath.Dir(path)); err == nil && fi.IsDir() {
		parent = "dir"
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seen = append(p.seen, method+" path="+kind+" parent="+parent)
}

func (p *pathsAtCall) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	p.note(MethodNodeStageVolume, req.GetStagingTargetPath())
	return p.FakeClient.NodeStageVolume(ctx, req)
}

func (p *pathsAtCall) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	p.note(MethodNodePublishVolume, req.GetTargetPath())
	return p.FakeClient.NodePublishVolume(ctx, req)
}

// The CO makes staging_target_path, a directory ("The CO SHALL be
// responsible for creating the directory if it does not exist"), and only
// the parent of target_path ("Creation of target_path is the
// responsibility of the SP"): for a block volume too, whose target the
// plugin makes a file.
func TestSpec_COMakesStagingDirAndTargetParentOnly(t *testing.T) {
	for _, attach := range []string{AttachmentFileSystem, AttachmentBlockDevice} {
		t.Run(attach, func(t *testing.T) {
			var pc *pathsAtCall
			h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return pc, nil } })
			pc = &pathsAtCall{FakeClient: h.fake}
			r := req("data", "vol1", "/data")
			if attach == AttachmentBlockDevice {
				r.AttachmentMode, r.FSType, r.MountFlags = attach, "", nil
			}
			_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{r})
			must.NoError(t, err)
			must.Eq(t, []string{
				MethodNodeStageVolume + " path=dir parent=dir",
				MethodNodePublishVolume + " path=missing parent=dir",
			}, pc.seen)
			must.NoError(t, h.m.Teardown(context.Background(), "t"))
		})
	}
}

// NodeGetVolumeStats gets staging_target_path only from a plugin that
// stages ("The path where the volume is staged, if the plugin has the
// STAGE_UNSTAGE_VOLUME capability, otherwise empty").
func TestSpec_StatsStagingPathOnlyWhenStaged(t *testing.T) {
	for _, stages := range []bool{true, false} {
		t.Run(fmt.Sprintf("stage_unstage=%t", stages), func(t *testing.T) {
			h := newHarness(t)
			p := statsPlugin("p")
			p.StageUnstage = stages
			h.setPlugin(p)
			ctx := context.Background()
			_, err := h.m.Setup(ctx, "t", []VolumeRequest{req("data", "vol1", "/data")})
			must.NoError(t, err)
			h.m.stats = newStatsLoop(time.Minute)
			statsPassWait(h.m, ctx, time.Now())
			statsPassWait(h.m, ctx, time.Now().Add(time.Minute))
			calls := h.callsOf(MethodNodeGetVolumeStats)
			must.SliceLen(t, 1, calls)
			must.Eq(t, h.m.TargetPath("t", "data"), calls[0].TargetPath)
			want := ""
			if stages {
				want = h.m.StagingPath("p", "vol1")
			}
			must.Eq(t, want, calls[0].StagingPath)
			must.NoError(t, h.m.Teardown(ctx, "t"))
		})
	}
}

// A teardown failure is given up only for the codes that say the request
// itself is wrong (InvalidArgument, Unimplemented: "Caller MUST NOT
// retry"); every other code is retried in the background until the
// plugin answers, and NotFound ("volume does not exist") counts as done
// once the target is seen not mounted.
func TestSpec_TeardownCodes(t *testing.T) {
	for _, tc := range []struct {
		code  codes.Code
		retry bool
	}{
		{codes.InvalidArgument, false},
		{codes.Unimplemented, false},
		{codes.FailedPrecondition, true},
		{codes.AlreadyExists, true},
		{codes.Aborted, true},
		{codes.ResourceExhausted, true},
		{codes.Internal, true},
		{codes.PermissionDenied, true},
		{codes.NotFound, false},
	} {
		t.Run(tc.code.String(), func(t *testing.T) {
			h := newHarness(t)
			ctx := context.Background()
			_, err := h.m.Setup(ctx, "t", []VolumeRequest{req("data", "vol1", "/data")})
			must.NoError(t, err)
			target := h.m.TargetPath("t", "data")
			if tc.code == codes.NotFound {
				// A plugin that lost the volume: the target is not mounted.
				must.NoError(t, h.mnt.Unmount(target))
			}
			// More failures than the in-line attempts: the background
			// retry gets the last, then the plugin answers.
			errs := make([]error, h.m.cfg.RetryAttempts+1)
			for i := range errs {
				errs[i] = status.Error(tc.code, "no")
			}
			h.fake.SetNextError(MethodNodeUnpublishVolume, errs...)
			err = h.m.Teardown(ctx, "t")
			h.waitIdle()
			switch {
			case tc.code == codes.NotFound:
				must.NoError(t, err)
				must.SliceEmpty(t, h.journalRecords())
			case tc.retry:
				must.ErrorContains(t, err, "retrying in the background")
				must.SliceEmpty(t, h.journalRecords())
				must.SliceEmpty(t, h.mountPaths())
			default:
				must.Error(t, err)
				must.StrNotContains(t, err.Error(), "background")
				must.True(t, containsEvent(h.eventMsgs(), "not retrying"))
				must.Len(t, 2, h.journalRecords())
			}
		})
	}
}

// After a restart, an uncertain ControllerPublishVolume is sent again
// only once the plugin is healthy: what it sends depends on the plugin's
// capabilities (readonly needs PUBLISH_READONLY), which a plugin not
// probed yet does not show. Sent before, a reader-only volume attached
// with readonly = true would be asked again with false, which the plugin
// refuses as incompatible.
func TestSpec_RecoverReissuesControllerPublishWhenHealthy(t *testing.T) {
	h := newHarness(t)
	v := volRecord{PluginID: "p", VolumeID: "vol1", StagingPath: h.m.StagingPath("p", "vol1"), NodeID: "node-1",
		AccessMode: AccessSingleNodeReaderOnly, AttachmentMode: AttachmentFileSystem, Controller: phasePublishing}
	must.NoError(t, h.m.journal.commit(volPut(v)))
	must.NoError(t, h.m.journal.commit(taskPut(taskRecord{TaskID: "task-a", Name: "data", PluginID: "p", VolumeID: "vol1",
		Target: h.m.TargetPath("task-a", "data"), Destination: "/data", AccessMode: AccessSingleNodeReaderOnly, ReadOnly: true,
		AttachmentMode: AttachmentFileSystem, State: phasePending})))
	// As the fingerprint shows a plugin it has not probed yet.
	h.setPlugin(PluginInfo{ID: "p", Socket: "/run/p.sock", HealthDescription: "plugin has not been probed yet"})
	h.restart()
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(h.logs.String(), "not healthy yet") && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	must.StrContains(t, h.logs.String(), `CSI plugin \"p\" is not healthy yet, so its capabilities are not known`)
	must.SliceEmpty(t, h.callsOf(MethodControllerPublishVolume))
	h.setPlugin(fullPlugin("p"))
	h.waitIdle()
	cp := h.callsOf(MethodControllerPublishVolume)
	must.SliceLen(t, 1, cp)
	must.True(t, cp[0].Readonly)
	must.Eq(t, 1, h.m.Users("p", "vol1"))
	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
}

// A live task whose target lost its mount across a restart is staged and
// published again once the plugin is healthy, not before: the calls'
// content follows capabilities a plugin not probed yet does not show.
func TestSpec_RecoverRepublishesWhenHealthy(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.NoError(t, h.mnt.Unmount(h.m.TargetPath("task-a", "data")))
	must.NoError(t, h.mnt.Unmount(h.m.StagingPath("p", "vol1")))
	h.setPlugin(PluginInfo{ID: "p", Socket: "/run/p.sock", HealthDescription: "plugin has not been probed yet"})
	h.restart()
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(h.logs.String(), "not healthy yet") && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	must.SliceEmpty(t, h.fake.Methods())
	h.setPlugin(fullPlugin("p"))
	h.waitIdle()
	must.Eq(t, []string{MethodNodeStageVolume, MethodNodePublishVolume}, h.fake.Methods())
	must.Eq(t, h.m.StagingPath("p", "vol1"), h.callsOf(MethodNodePublishVolume)[0].StagingPath)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
}

// RESOURCE_EXHAUSTED from CreateVolume (cannot provision in the node's
// topology) and ControllerPublishVolume (the node has its most volumes
// attached) is final: the CSI spec's tables say the caller "MUST ensure"
// the cause is addressed before retrying, and the same request sent again
// at once addresses nothing. The setup fails after one attempt, with the
// plugin's code.
func TestSpec_ResourceExhaustedFinalForCreateAndAttach(t *testing.T) {
	for _, method := range []string{MethodCreateVolume, MethodControllerPublishVolume} {
		t.Run(method, func(t *testing.T) {
			h := newHarness(t)
			h.fake.SetNextError(method, status.Error(codes.ResourceExhausted, "full"))
			_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{sizedReq(mib)})
			must.Eq(t, codes.ResourceExhausted, Code(err))
			must.Eq(t, 1, h.fake.Count(method))
			h.waitIdle()
			must.SliceEmpty(t, h.mountPaths())
		})
	}
}

// "The CO is responsible for ensuring that there is no more than one call
// 'in-flight' per volume at a given time" (CSI spec, Concurrency). The
// stats loop's NodeGetVolumeStats is a call on the volume too: while
// another call on it is in flight (a second task's NodePublishVolume of a
// volume a task has, a teardown's NodeUnpublishVolume), its sample is
// skipped and the volume keeps its place; it is sampled at its next turn.
// And no call on the volume starts while a sample is in flight.
func TestSpec_StatsNotBesideAnotherCallOnTheVolume(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(statsPlugin("p"))
	ctx := context.Background()
	multi := req("data", "vol1", "/data")
	multi.AccessMode = AccessMultiNodeMultiWriter
	_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi})
	must.NoError(t, err)
	h.m.stats = newStatsLoop(time.Minute)
	now := time.Now()
	statsPassWait(h.m, ctx, now)
	waitCount := func(method string, n int) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); h.fake.Count(method) < n; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s was not called %d times", method, n)
			}
		}
	}

	// A second task's publish in flight: no sample.
	release := h.fake.HangMethod(MethodNodePublishVolume)
	defer release()
	setupDone := make(chan error, 1)
	go func() {
		_, err := h.m.Setup(ctx, "b", []VolumeRequest{multi})
		setupDone <- err
	}()
	waitCount(MethodNodePublishVolume, 2)
	now = now.Add(time.Minute)
	statsPassWait(h.m, ctx, now)
	must.Eq(t, 0, h.fake.Count(MethodNodeGetVolumeStats))
	release()
	must.NoError(t, <-setupDone)

	// The next turn samples it.
	now = now.Add(time.Minute)
	statsPassWait(h.m, ctx, now)
	must.Eq(t, 1, h.fake.Count(MethodNodeGetVolumeStats))

	// A sample in flight: a teardown's NodeUnpublishVolume waits for it.
	releaseStats := h.fake.HangMethod(MethodNodeGetVolumeStats)
	defer releaseStats()
	now = now.Add(time.Minute)
	h.m.statsPass(ctx, now)
	waitCount(MethodNodeGetVolumeStats, 2)
	tornDown := make(chan error, 1)
	go func() { tornDown <- h.m.Teardown(ctx, "b") }()
	// The teardown waits for the volume's lock, which the sample holds:
	// seen waiting there, it has called nothing.
	key := volKey{"p", "vol1"}.String()
	for deadline := time.Now().Add(20 * time.Second); lockRefs(h.m.locks, key) < 2; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the teardown did not wait for the volume's lock")
		}
	}
	must.Eq(t, 0, h.fake.Count(MethodNodeUnpublishVolume))
	releaseStats()
	must.NoError(t, <-tornDown)
	h.m.stats.wg.Wait()
	must.Eq(t, 1, h.fake.Count(MethodNodeUnpublishVolume))
	must.NoError(t, h.m.Teardown(ctx, "a"))
}

// lockRefs is how many hold or wait for key's lock.
func lockRefs(k *keyLocks, key string) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	if l, ok := k.locks[key]; ok {
		return l.refs
	}
	return 0
}
