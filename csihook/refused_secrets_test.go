package csihook

import (
	"context"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// stageSecrets are the secrets of each NodeStageVolume the fake saw, in
// order.
func stageSecrets(h *harness) []map[string]string {
	var out []map[string]string
	for _, c := range h.fake.Calls() {
		if c.Method == MethodNodeStageVolume {
			out = append(out, c.Secrets)
		}
	}
	return out
}

// A stage refused beside a task that has the volume leaves it refused;
// the next task to use the volume stages it with its own request's
// secrets, not with those of the refused stage this process still holds.
// Those may be what the plugin refused: an expired token, or a wrong one
// another job of the namespace gave, which would keep the volume refused
// for every job after it until the driver restarts or the volume's last
// task stops.
func TestSetup_StagesARefusedVolumeWithItsOwnSecrets(t *testing.T) {
	cases := []struct {
		name string
		// lose makes the volume need a stage again before task b starts.
		lose func(h *harness, p *stageForgetting)
	}{
		{name: "plugin forgot its stage", lose: func(h *harness, p *stageForgetting) { p.forget() }},
		{name: "staging mount gone after a driver restart", lose: func(h *harness, p *stageForgetting) {
			h.restart()
			must.NoError(t, h.mnt.Unmount(h.m.StagingPath("p", "vol1")))
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var p *stageForgetting
			h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return p, nil } })
			p = &stageForgetting{FakeClient: h.fake, staged: map[string]bool{}}
			stagingPlugin(h)
			ctx := context.Background()
			ra := multi(req("data", "vol1", "/data"))
			_, err := h.m.Setup(ctx, "a", []VolumeRequest{ra})
			must.NoError(t, err)
			tc.lose(h, p)

			rb := multi(req("data", "vol1", "/data"))
			rb.Secrets = map[string]string{"token": "wrong"}
			h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.PermissionDenied, "bad token"))
			_, err = h.m.Setup(ctx, "b", []VolumeRequest{rb})
			must.ErrorContains(t, err, "PermissionDenied")
			must.Eq(t, []string{"task a/data published", "vol p/vol1 refused/"}, h.journalRecords())

			h.fake.ResetCalls()
			rc := multi(req("data", "vol1", "/data"))
			rc.Secrets = map[string]string{"token": "c-" + canary}
			_, err = h.m.Setup(ctx, "c", []VolumeRequest{rc})
			must.NoError(t, err)
			must.Eq(t, []map[string]string{rc.Secrets}, stageSecrets(h))
			must.Eq(t, []string{"task a/data published", "task c/data published", "vol p/vol1 staged/"}, h.journalRecords())
			must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))

			must.NoError(t, h.m.Teardown(ctx, "a"))
			h.fake.ResetCalls()
			must.NoError(t, h.m.Teardown(ctx, "c"))
			must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume}, h.fake.Methods())
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
		})
	}
}
