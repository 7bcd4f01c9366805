package csihook

import (
	"context"
	"testing"

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

// A plugin whose volume expansion is OFFLINE only (no VolumeExpansion
// ONLINE) must not get ControllerExpandVolume for a volume that is
// attached, staged or published on this node (CSI spec,
// ControllerExpandVolume). The request is refused before any call, naming
// what to do; once the volume is released the same request grows it. A
// plugin with ONLINE grows it in use.
func TestSpec_OfflineExpansionWaitsForRelease(t *testing.T) {
	shared := func(min int64) VolumeRequest {
		r := sizedReq(min)
		r.AccessMode = AccessMultiNodeMultiWriter
		return r
	}
	for _, online := range []bool{false, true} {
		name := "offline"
		if online {
			name = "online"
		}
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			p := expandPlugin(true, false)
			p.OnlineExpansion = online
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
// the volume as it is, told so, and the node's part is not owed any more:
// no later setup asks again.
func TestSpec_NodeExpandFailedPreconditionNotRetried(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(expandPlugin(true, true))
	must.NoError(t, h.setupAndRelease("t1", sizedReq(64*mib)))
	h.fake.SetNextError(MethodNodeExpandVolume, status.Error(codes.FailedPrecondition, "ext4 cannot grow online here"))
	h.fake.ResetCalls()
	must.NoError(t, h.setupAndRelease("t2", sizedReq(128*mib)))
	must.SliceLen(t, 1, h.callsOf(MethodControllerExpandVolume))
	must.SliceLen(t, 1, h.callsOf(MethodNodeExpandVolume))
	must.True(t, containsEvent(h.eventMsgs(), `Volume "data" was not grown on this node (FailedPrecondition: ext4 cannot grow online here): it grows at its next staging`),
		must.Sprint(h.eventMsgs()))

	h.restart()
	h.fake.ResetCalls()
	must.NoError(t, h.setupAndRelease("t3", sizedReq(128*mib)))
	must.SliceEmpty(t, h.callsOf(MethodNodeExpandVolume))
	must.SliceEmpty(t, h.callsOf(MethodControllerExpandVolume))
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())
}
