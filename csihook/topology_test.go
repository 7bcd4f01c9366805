package csihook

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
)

func zonedPlugin(zone string, max int64) PluginInfo {
	p := fullPlugin("p")
	if zone != "" {
		p.Topology = map[string]string{"zone": zone, "rack": "r1"}
		p.AccessibilityConstraints = true
	}
	p.MaxVolumes = max
	return p
}

// CreateVolume asks for the node's topology as requisite and preferred.
func TestTopology_CreateAsksForNode(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(zonedPlugin("a", 0))
	must.NoError(t, h.setupAndRelease("t1", sizedReq(mib)))
	cv := h.callsOf(MethodCreateVolume)
	must.SliceLen(t, 1, cv)
	want := map[string]string{"zone": "a", "rack": "r1"}
	must.SliceLen(t, 1, cv[0].Accessibility.GetRequisite())
	must.Eq(t, want, cv[0].Accessibility.GetRequisite()[0].GetSegments())
	must.SliceLen(t, 1, cv[0].Accessibility.GetPreferred())
	must.Eq(t, want, cv[0].Accessibility.GetPreferred()[0].GetSegments())

	// A plugin without topology gets no requirement.
	h2 := newHarness(t)
	must.NoError(t, h2.setupAndRelease("t1", sizedReq(mib)))
	must.Nil(t, h2.callsOf(MethodCreateVolume)[0].Accessibility)
}

// A volume created accessible only elsewhere is refused before anything
// is staged or published; one accessible here (a subset of the node's
// segments) is used.
func TestTopology_CreatedElsewhereRefused(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(zonedPlugin("a", 0))
	h.fake.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{"zone": "b"}}}
	_, err := h.m.Setup(context.Background(), "t1", []VolumeRequest{sizedReq(mib)})
	must.Eq(t, codes.FailedPrecondition, Code(err))
	must.ErrorContains(t, err, `the plugin created the volume accessible from {zone=b}, which does not include node "n1" ({rack=r1, zone=a})`)
	must.Eq(t, []string{MethodCreateVolume}, h.fake.Methods())
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())

	h2 := newHarness(t)
	h2.setPlugin(zonedPlugin("a", 0))
	h2.fake.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{"zone": "b"}}, {Segments: map[string]string{"zone": "a"}}}
	must.NoError(t, h2.setupAndRelease("t1", sizedReq(mib)))
}

// max_volumes_per_node counts the plugin's volumes on the node: a new one
// past it is refused before any call; a volume already there is shared.
func TestTopology_MaxVolumesPerNode(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(zonedPlugin("", 1))
	shared := func(vol string) VolumeRequest {
		r := req("data", vol, "/data")
		r.AccessMode = AccessMultiNodeMultiWriter
		return r
	}
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "t1", []VolumeRequest{shared("v1")})
	must.NoError(t, err)
	h.fake.ResetCalls()
	_, err = h.m.Setup(ctx, "t2", []VolumeRequest{shared("v2")})
	must.ErrorIs(t, err, ErrConflict)
	must.ErrorContains(t, err, `CSI plugin "p" may have at most 1 volumes on node "n1" (max_volumes_per_node from NodeGetInfo); 1 are there and this task needs 1 more`)
	must.SliceEmpty(t, h.fake.Calls())
	_, err = h.m.Setup(ctx, "t3", []VolumeRequest{shared("v1")})
	must.NoError(t, err)

	// Two new volumes in one task count as two.
	h2 := newHarness(t)
	h2.setPlugin(zonedPlugin("", 1))
	b := shared("v2")
	b.Name, b.Destination = "other", "/other"
	_, err = h2.m.Setup(ctx, "t1", []VolumeRequest{shared("v1"), b})
	must.ErrorContains(t, err, "0 are there and this task needs 2 more")
}

// Two starts at once cannot both take the last place under
// max_volumes_per_node: the first one's volume counts from its check on,
// while its CreateVolume is still in flight (no record of the volume is
// there yet); once it has ended, its place is counted by the journal or
// free again.
func TestTopology_MaxVolumesPerNodeConcurrentStarts(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(zonedPlugin("", 1))
	ctx := context.Background()
	created := func(name string) VolumeRequest {
		r := req("data", name, "/data")
		r.Create = &CreateRequest{CapacityMin: mib}
		return r
	}
	release := h.fake.HangMethod(MethodCreateVolume)
	done := make(chan error, 1)
	go func() {
		_, err := h.m.Setup(ctx, "t1", []VolumeRequest{created("v1")})
		done <- err
	}()
	for deadline := time.Now().Add(20 * time.Second); len(h.fake.Calls()) == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first start made no call")
		}
	}
	_, err := h.m.Setup(ctx, "t2", []VolumeRequest{created("v2")})
	must.ErrorIs(t, err, ErrConflict)
	must.ErrorContains(t, err, "1 are there and this task needs 1 more")
	release()
	must.NoError(t, <-done)
	must.NoError(t, h.m.Teardown(ctx, "t1"))
	h.waitIdle()
	// Released with the setup's end and the teardown: the place is free.
	_, err = h.m.Setup(ctx, "t3", []VolumeRequest{created("v2")})
	must.NoError(t, err)
	h.m.mu.Lock()
	must.MapEmpty(t, h.m.reserved)
	h.m.mu.Unlock()
}

// A plugin that answers CreateVolume with megabytes of accessible
// topology does not put them into the task's error and events.
func TestTopology_CreatedElsewhereMessageBounded(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(zonedPlugin("a", 0))
	for i := range 20000 {
		h.fake.AccessibleTopology = append(h.fake.AccessibleTopology,
			&csi.Topology{Segments: map[string]string{"zone": fmt.Sprintf("elsewhere-%d", i)}})
	}
	_, err := h.m.Setup(context.Background(), "t1", []VolumeRequest{sizedReq(mib)})
	must.Eq(t, codes.FailedPrecondition, Code(err))
	must.ErrorContains(t, err, "the plugin created the volume accessible from {zone=elsewhere-0} or")
	must.LessEq(t, 4*MaxErrorMessage, len(err.Error()))
	var oe *OpError
	must.True(t, errors.As(err, &oe))
	must.LessEq(t, 4*MaxErrorMessage, len(oe.Event()))
}

// Topology keys are case-insensitive (CSI spec, message Topology: "Keys
// MUST be case-insensitive"): a volume the plugin answers with "Zone"
// where NodeGetInfo said "zone" is accessible from this node, and a
// different value under a differently spelled key is still elsewhere.
func TestTopology_KeysCaseInsensitive(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(zonedPlugin("a", 0))
	h.fake.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{"Zone": "a", "RACK": "r1"}}}
	must.NoError(t, h.setupAndRelease("t1", sizedReq(mib)))

	h2 := newHarness(t)
	h2.setPlugin(zonedPlugin("a", 0))
	h2.fake.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{"Zone": "b"}}}
	_, err := h2.m.Setup(context.Background(), "t1", []VolumeRequest{sizedReq(mib)})
	must.Eq(t, codes.FailedPrecondition, Code(err))
	h2.waitIdle()
}
