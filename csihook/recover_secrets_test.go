package csihook

import (
	"context"
	"testing"

	"github.com/shoenig/test/must"
)

// callSecrets are the secrets of each call the fake saw, in order.
func callSecrets(h *harness) []map[string]string {
	var out []map[string]string
	for _, c := range h.fake.Calls() {
		out = append(out, c.Secrets)
	}
	return out
}

// A driver restart stages a volume set up with secrets again only with
// them, as a repair does: the journal dropped them once the volume was
// staged, and a NodeStageVolume without them would be refused (leaving
// the volume refused for its other tasks) or stage with less than the
// job gave. Neither a staging path found no mount nor a live task whose
// mount is gone makes recovery send one; the task that lost its mount
// is told to restart, and the next setup stages the volume with its own
// request's secrets. A volume set up without secrets is staged again as
// before.
func TestRecover_StagesNoVolumeAgainWithoutItsSecrets(t *testing.T) {
	cases := []struct {
		name string
		// taskLost unmounts task a's target too.
		taskLost bool
		secrets  bool
		// wantRecover are the calls of recovery.
		wantRecover []string
	}{
		{name: "staging gone", secrets: true},
		{name: "staging and a task's mount gone", taskLost: true, secrets: true},
		{name: "staging gone/without secrets", wantRecover: []string{MethodNodeStageVolume}},
		{name: "staging and a task's mount gone/without secrets", taskLost: true,
			wantRecover: []string{MethodNodeStageVolume, MethodNodePublishVolume}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			stagingPlugin(h)
			ctx := context.Background()
			r := multi(req("data", "vol1", "/data"))
			if !tc.secrets {
				r.Secrets = nil
			}
			_, err := h.m.Setup(ctx, "a", []VolumeRequest{r})
			must.NoError(t, err)

			h.restart()
			must.NoError(t, h.mnt.Unmount(h.m.StagingPath("p", "vol1")))
			if tc.taskLost {
				must.NoError(t, h.mnt.Unmount(h.m.TargetPath("a", "data")))
			}
			h.fake.ResetCalls()
			must.NoError(t, h.m.Recover(func(string) bool { return true }))
			h.waitIdle()
			if len(tc.wantRecover) == 0 {
				must.SliceEmpty(t, h.fake.Methods(), must.Sprintf("calls %v, their secrets %v", h.fake.Methods(), callSecrets(h)))
			} else {
				must.Eq(t, tc.wantRecover, h.fake.Methods())
			}
			must.Eq(t, []string{"task a/data published", "vol p/vol1 staged/"}, h.journalRecords())
			if tc.secrets && tc.taskLost {
				must.True(t, containsEvent(h.eventMsgs(), "restart the task"), must.Sprint(h.eventMsgs()))
			}
			if !tc.secrets {
				return
			}

			// The next task to use it stages it, with its own secrets.
			h.fake.ResetCalls()
			rb := multi(req("data", "vol1", "/data"))
			rb.Secrets = map[string]string{"token": "b-" + canary}
			_, err = h.m.Setup(ctx, "b", []VolumeRequest{rb})
			must.NoError(t, err)
			must.Eq(t, []string{MethodNodeStageVolume, MethodNodePublishVolume}, h.fake.Methods())
			must.Eq(t, []map[string]string{rb.Secrets}, stageSecrets(h))

			h.fake.ResetCalls()
			must.NoError(t, h.m.Teardown(ctx, "a"))
			must.NoError(t, h.m.Teardown(ctx, "b"))
			must.Eq(t, MethodNodeUnstageVolume, h.fake.Methods()[len(h.fake.Methods())-1])
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
		})
	}
}
