package csihook

import (
	"context"
	"errors"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

const mib = 1 << 20

func sizedReq(min int64) VolumeRequest {
	r := req("data", "scratch", "/data")
	r.Create = &CreateRequest{CapacityMin: min}
	return r
}

func expandPlugin(ctrl, node bool) PluginInfo {
	p := fullPlugin("p")
	p.ControllerExpand, p.NodeExpand = ctrl, node
	return p
}

// setupAndRelease sets a task up with r and tears it down again.
func (h *harness) setupAndRelease(taskID string, r VolumeRequest) error {
	h.t.Helper()
	ctx := context.Background()
	if _, err := h.m.Setup(ctx, taskID, []VolumeRequest{r}); err != nil {
		return err
	}
	must.NoError(h.t, h.m.Teardown(ctx, taskID))
	return nil
}

func (h *harness) callsOf(method string) []FakeCall {
	var out []FakeCall
	for _, c := range h.fake.Calls() {
		if c.Method == method {
			out = append(out, c)
		}
	}
	return out
}

// Raising capacity_min grows the volume: ControllerExpandVolume, then,
// once published, NodeExpandVolume at the task's target; CreateVolume is
// not called again for it. A restart keeps the new size: the same request
// expands nothing.
func TestExpand_GrowsThenRemembers(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(expandPlugin(true, true))
	must.NoError(t, h.setupAndRelease("t1", sizedReq(64*mib)))
	h.fake.ResetCalls()

	_, err := h.m.Setup(context.Background(), "t2", []VolumeRequest{sizedReq(128 * mib)})
	must.NoError(t, err)
	must.SliceEmpty(t, h.callsOf(MethodCreateVolume))
	ce := h.callsOf(MethodControllerExpandVolume)
	must.SliceLen(t, 1, ce)
	must.Eq(t, "id-scratch", ce[0].VolumeID)
	must.Eq(t, int64(128*mib), ce[0].CapacityRange.GetRequiredBytes())
	must.Eq(t, canary, ce[0].Secrets["token"])
	ne := h.callsOf(MethodNodeExpandVolume)
	must.SliceLen(t, 1, ne)
	must.Eq(t, h.m.TargetPath("t2", "data"), ne[0].TargetPath)
	must.Eq(t, h.m.StagingPath("p", "id-scratch"), ne[0].StagingPath)
	must.Eq(t, int64(128*mib), ne[0].CapacityRange.GetRequiredBytes())
	// Node expansion comes after the publish.
	methods := h.fake.Methods()
	must.Eq(t, MethodNodeExpandVolume, methods[len(methods)-1])
	events := h.eventMsgs()
	must.True(t, containsEvent(events, `Expanding volume "data" from 64 MiB to 128 MiB`), must.Sprintf("%v", events))
	must.True(t, containsEvent(events, `Expanded volume "data" to 128 MiB`), must.Sprintf("%v", events))
	must.NoError(t, h.m.Teardown(context.Background(), "t2"))

	h.restart()
	h.fake.ResetCalls()
	must.NoError(t, h.setupAndRelease("t3", sizedReq(128*mib)))
	must.SliceEmpty(t, h.callsOf(MethodControllerExpandVolume))
	must.SliceEmpty(t, h.callsOf(MethodNodeExpandVolume))
	must.StrNotContains(t, h.logs.String(), canary)
}

// A smaller capacity_min is refused before any call, naming the field.
func TestExpand_ShrinkRefused(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(expandPlugin(true, true))
	must.NoError(t, h.setupAndRelease("t1", sizedReq(128*mib)))
	h.fake.ResetCalls()

	_, err := h.m.Setup(context.Background(), "t2", []VolumeRequest{sizedReq(64 * mib)})
	must.ErrorIs(t, err, ErrInvalid)
	must.ErrorContains(t, err, `volume "data": create.capacity_min "64 MiB" (67108864 bytes) is smaller than the "128 MiB" (134217728 bytes) volume "scratch" was created or last expanded with: volumes cannot shrink`)
	must.SliceEmpty(t, h.fake.Calls())
	must.SliceEmpty(t, h.journalRecords())
}

// A plugin that cannot expand is refused with the field to keep.
func TestExpand_PluginCannot(t *testing.T) {
	h := newHarness(t)
	must.NoError(t, h.setupAndRelease("t1", sizedReq(64*mib)))
	h.fake.ResetCalls()
	_, err := h.m.Setup(context.Background(), "t2", []VolumeRequest{sizedReq(128 * mib)})
	must.ErrorIs(t, err, ErrInvalid)
	must.ErrorContains(t, err, `CSI plugin "p" cannot expand volumes (no EXPAND_VOLUME capability): keep create.capacity_min at "64 MiB"`)
	must.SliceEmpty(t, h.fake.Calls())
}

// When NodeExpandVolume fails after the controller grew the volume, the
// journal owes the node's part: after a restart the same request calls
// NodeExpandVolume only, not the controller again.
func TestExpand_NodePartSurvivesRestart(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(expandPlugin(true, true))
	must.NoError(t, h.setupAndRelease("t1", sizedReq(64*mib)))
	h.fake.SetError(MethodNodeExpandVolume, status.Error(codes.Internal, "resize2fs failed"))
	_, err := h.m.Setup(context.Background(), "t2", []VolumeRequest{sizedReq(128 * mib)})
	must.Error(t, err)
	must.Eq(t, codes.Internal, Code(err))
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())

	h.fake.SetError(MethodNodeExpandVolume, nil)
	h.restart()
	h.fake.ResetCalls()
	must.NoError(t, h.setupAndRelease("t3", sizedReq(128*mib)))
	must.SliceEmpty(t, h.callsOf(MethodControllerExpandVolume))
	must.SliceEmpty(t, h.callsOf(MethodCreateVolume))
	must.SliceLen(t, 1, h.callsOf(MethodNodeExpandVolume))

	// Done now: nothing more is owed.
	h.fake.ResetCalls()
	must.NoError(t, h.setupAndRelease("t4", sizedReq(128*mib)))
	must.SliceEmpty(t, h.callsOf(MethodNodeExpandVolume))
}

// Without the node capability the controller's part is all; the task is
// told the file system grows at the next staging. A node-only plugin
// expands on the node alone.
func TestExpand_OneSideOnly(t *testing.T) {
	t.Run("controller_only", func(t *testing.T) {
		h := newHarness(t)
		h.setPlugin(expandPlugin(true, false))
		must.NoError(t, h.setupAndRelease("t1", sizedReq(64*mib)))
		h.fake.ResetCalls()
		must.NoError(t, h.setupAndRelease("t2", sizedReq(128*mib)))
		must.SliceLen(t, 1, h.callsOf(MethodControllerExpandVolume))
		must.SliceEmpty(t, h.callsOf(MethodNodeExpandVolume))
		must.True(t, containsEvent(h.eventMsgs(), `Volume "data" grows on this node at its next staging`))
	})
	t.Run("node_only", func(t *testing.T) {
		h := newHarness(t)
		h.setPlugin(expandPlugin(false, true))
		must.NoError(t, h.setupAndRelease("t1", sizedReq(64*mib)))
		h.fake.ResetCalls()
		must.NoError(t, h.setupAndRelease("t2", sizedReq(128*mib)))
		must.SliceEmpty(t, h.callsOf(MethodControllerExpandVolume))
		must.SliceLen(t, 1, h.callsOf(MethodNodeExpandVolume))
	})
	t.Run("controller_failure_fails_setup", func(t *testing.T) {
		h := newHarness(t)
		h.setPlugin(expandPlugin(true, true))
		must.NoError(t, h.setupAndRelease("t1", sizedReq(64*mib)))
		h.fake.SetNextError(MethodControllerExpandVolume, status.Error(codes.OutOfRange, "too big"))
		_, err := h.m.Setup(context.Background(), "t2", []VolumeRequest{sizedReq(128 * mib)})
		must.True(t, errors.Is(err, err) && Code(err) == codes.OutOfRange, must.Sprintf("%v", err))
		must.ErrorContains(t, err, "change create.capacity_min or create.capacity_max")
		h.waitIdle()
		must.SliceEmpty(t, h.journalRecords())
	})
}
