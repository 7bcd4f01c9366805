package csihook

import (
	"context"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A repair of a dead staging mount stages the volume again. Refused with
// a final code, the volume's record says the stage was refused and the
// journal drops its secrets at once; the task records stay, a driver
// restart stages nothing (the tasks hear to restart, as a repair that
// would need the secrets tells them), and the teardowns still unstage
// after the last task. An outcome the driver cannot know leaves the
// record staging with its secrets, and the restart stages it again with
// them and publishes the tasks' volumes again.
func TestRepairStale_RefusedRestageDropsSecrets(t *testing.T) {
	cases := []struct {
		name      string
		stageErr  error
		wantStage string
		// wantRecover are the calls of recovery after a restart.
		wantRecover []string
	}{
		{
			name: "refused", stageErr: status.Error(codes.FailedPrecondition, "device gone"),
			wantStage: phaseStageRefused,
		},
		{
			name: "uncertain", stageErr: status.Error(codes.Unavailable, "transport is closing"),
			wantStage:   phaseStaging,
			wantRecover: []string{MethodNodeStageVolume, MethodNodePublishVolume, MethodNodePublishVolume},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			setCompactDelay(t, time.Millisecond)
			h := newHarness(t, noRepairBackoff)
			stagingPlugin(h)
			ctx := context.Background()
			for _, id := range []string{"a", "b"} {
				_, err := h.m.Setup(ctx, id, []VolumeRequest{multi(req("data", "vol1", "/data"))})
				must.NoError(t, err)
			}
			waitJournalWithout(t, h.root, canary)
			h.mnt.SetStale(h.m.StagingPath("p", "vol1"), true)
			h.fake.ResetCalls()
			h.fake.SetError(MethodNodeStageVolume, tc.stageErr)
			rep, err := h.m.RepairStale(ctx, "p")
			h.fake.SetError(MethodNodeStageVolume, nil)
			must.ErrorContains(t, err, Code(tc.stageErr).String())
			must.SliceEmpty(t, rep)
			must.Positive(t, h.fake.Count(MethodNodeStageVolume))
			for _, c := range h.fake.Calls() {
				if c.Method == MethodNodeStageVolume {
					must.Eq(t, canary, c.Secrets["token"])
				}
			}
			must.Eq(t, []string{"task a/data published", "task b/data published", "vol p/vol1 " + tc.wantStage + "/"}, h.journalRecords())
			if tc.wantStage == phaseStaging {
				must.Eq(t, canary, diskVolSecrets(t, h.root)["token"])
			} else {
				must.MapEmpty(t, diskVolSecrets(t, h.root))
				waitJournalWithout(t, h.root, canary)
			}
			must.Eq(t, 2, h.m.Users("p", "vol1"))

			h.restart()
			h.fake.ResetCalls()
			must.NoError(t, h.m.Recover(func(string) bool { return true }))
			h.waitIdle()
			if len(tc.wantRecover) > 0 {
				must.Eq(t, tc.wantRecover, h.fake.Methods())
				must.Eq(t, canary, h.fake.Calls()[0].Secrets["token"])
				must.Eq(t, []string{"task a/data published", "task b/data published", "vol p/vol1 staged/"}, h.journalRecords())
				waitJournalWithout(t, h.root, canary)
			} else {
				must.SliceEmpty(t, h.fake.Methods())
				must.True(t, containsEvent(h.eventMsgs(), "restart the task"), must.Sprint(h.eventMsgs()))
				must.Eq(t, []string{"task a/data published", "task b/data published", "vol p/vol1 refused/"}, h.journalRecords())
			}

			h.fake.ResetCalls()
			must.NoError(t, h.m.Teardown(ctx, "a"))
			must.Eq(t, []string{MethodNodeUnpublishVolume}, h.fake.Methods())
			h.fake.ResetCalls()
			must.NoError(t, h.m.Teardown(ctx, "b"))
			must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume}, h.fake.Methods())
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
		})
	}
}

// The next repair of a volume whose repair's stage was refused stages it
// again, with the secrets this process still holds, before it publishes
// the dead targets: a publish needs the stage. Before, it published them
// without one.
func TestRepairStale_NextRepairStagesARefusedVolume(t *testing.T) {
	h := newHarness(t, noRepairBackoff)
	stagingPlugin(h)
	ctx := context.Background()
	for _, id := range []string{"a", "b"} {
		_, err := h.m.Setup(ctx, id, []VolumeRequest{multi(req("data", "vol1", "/data"))})
		must.NoError(t, err)
	}
	staging := h.m.StagingPath("p", "vol1")
	h.mnt.SetStale(staging, true)
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.Internal, "mount failed"))
	_, err := h.m.RepairStale(ctx, "p")
	must.ErrorContains(t, err, "Internal: mount failed")
	must.Eq(t, []string{"task a/data published", "task b/data published", "vol p/vol1 refused/"}, h.journalRecords())

	h.fake.ResetCalls()
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	must.SliceLen(t, 2, rep)
	// The dead targets are taken again first (the plugin finds nothing
	// there).
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnpublishVolume,
		MethodNodeStageVolume, MethodNodePublishVolume, MethodNodePublishVolume}, h.fake.Methods())
	for _, c := range h.fake.Calls()[2:] {
		must.Eq(t, staging, c.StagingPath, must.Sprint(c.Method))
		must.Eq(t, canary, c.Secrets["token"], must.Sprint(c.Method))
	}
	must.Eq(t, []string{"task a/data published", "task b/data published", "vol p/vol1 staged/"}, h.journalRecords())
	must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))
	must.True(t, h.m.publishedAt(h.m.TargetPath("b", "data")))

	must.NoError(t, h.m.Teardown(ctx, "a"))
	must.NoError(t, h.m.Teardown(ctx, "b"))
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}
