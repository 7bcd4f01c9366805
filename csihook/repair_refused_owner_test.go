package csihook

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A repair stages a refused volume again with the secrets of a task it
// repairs, not with those of the refused stage: another job of the
// namespace whose setup staged the volume with a wrong token, refused,
// would otherwise have every later repair of the tasks that use the
// volume send that token again, and refused again, until they restart.
func TestRepairStale_RestagesARefusedVolumeWithATasksSecrets(t *testing.T) {
	h := newHarness(t, noRepairBackoff)
	stagingPlugin(h)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.NoError(t, err)

	// The plugin refuses a repair's stage once: the volume is refused,
	// and task a's mount is dead.
	h.mnt.SetStale(h.m.StagingPath("p", "vol1"), true)
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.Internal, "mount failed"))
	_, err = h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "Internal: mount failed")
	must.Eq(t, []string{"task a/data published", "vol p/vol1 refused/"}, h.journalRecords())

	// Task b of another job stages it with a wrong token, refused.
	rb := multi(req("data", "vol1", "/data"))
	rb.Secrets = map[string]string{"token": "wrong"}
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.PermissionDenied, "bad token"))
	_, err = h.m.Setup(ctx, "b", []VolumeRequest{rb})
	must.ErrorContains(t, err, "PermissionDenied")
	must.Eq(t, []string{"task a/data published", "vol p/vol1 refused/"}, h.journalRecords())

	h.fake.ResetCalls()
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceLen(t, 1, rep)
	must.Eq(t, []map[string]string{{"token": canary}}, stageSecrets(h))
	must.Eq(t, []string{"task a/data published", "vol p/vol1 staged/"}, h.journalRecords())
	must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))

	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, "a"))
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume}, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}

// A task's teardown beside another task that still uses a volume whose
// stage was refused does not say the volume stays staged: the plugin said
// it holds no stage of it. Nor does it after a driver restart, whose
// recovery tears down the volume of a task that is gone.
func TestTeardown_RefusedVolumeIsNotSaidToStayStaged(t *testing.T) {
	for _, restart := range []bool{false, true} {
		t.Run(fmt.Sprintf("restart=%v", restart), func(t *testing.T) {
			h := newHarness(t, noRepairBackoff)
			stagingPlugin(h)
			ctx := context.Background()
			for _, id := range []string{"a", "b"} {
				_, err := h.m.Setup(ctx, id, []VolumeRequest{multi(req("data", "vol1", "/data"))})
				must.NoError(t, err)
			}
			h.mnt.SetStale(h.m.StagingPath("p", "vol1"), true)
			h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.Internal, "mount failed"))
			_, err := h.m.RepairStale(ctx, "p")
			must.ErrorContains(t, err, "Internal: mount failed")
			must.Eq(t, []string{"task a/data published", "task b/data published", "vol p/vol1 refused/"}, h.journalRecords())

			if restart {
				h.restart()
				must.NoError(t, h.m.Recover(func(id string) bool { return id != "a" }))
				h.waitIdle()
			} else {
				must.NoError(t, h.m.Teardown(ctx, "a"))
			}
			var torn []string
			for _, e := range h.eventMsgs() {
				if strings.HasPrefix(e, "Unpublished") {
					torn = append(torn, e)
				}
			}
			must.Eq(t, []string{`Unpublished volume "data"`}, torn)
			must.Eq(t, []string{"task b/data published", "vol p/vol1 refused/"}, h.journalRecords())

			must.NoError(t, h.m.Teardown(ctx, "b"))
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
		})
	}
}

// A volume attached by ControllerPublishVolume keeps in its record the
// secrets it was attached with when a stage with other secrets is
// refused: the ControllerUnpublishVolume of its last teardown takes them.
// A job of the namespace that staged a refused volume with a wrong token
// left the record with that token, and the detach of the other job's
// volume was refused, retried for ever.
func TestSetup_RefusedStageKeepsTheSecretsTheVolumeWasAttachedWith(t *testing.T) {
	h := newHarness(t, noRepairBackoff)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi(req("data", "vol1", "/data"))})
	must.NoError(t, err)
	h.mnt.SetStale(h.m.StagingPath("p", "vol1"), true)
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.Internal, "mount failed"))
	_, err = h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "Internal: mount failed")
	must.Eq(t, []string{"task a/data published", "vol p/vol1 refused/published"}, h.journalRecords())

	rb := multi(req("data", "vol1", "/data"))
	rb.Secrets = map[string]string{"token": "wrong"}
	h.fake.ResetCalls()
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.PermissionDenied, "bad token"))
	_, err = h.m.Setup(ctx, "b", []VolumeRequest{rb})
	must.ErrorContains(t, err, "PermissionDenied")
	must.Eq(t, []map[string]string{rb.Secrets}, stageSecrets(h))
	must.Eq(t, []string{"task a/data published", "vol p/vol1 refused/published"}, h.journalRecords())
	must.Eq(t, canary, diskVolSecrets(t, h.root)["token"])

	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, "a"))
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}, h.fake.Methods())
	must.Eq(t, canary, h.fake.Calls()[2].Secrets["token"])
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}
