package csihook

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// recoveryTrace is what a recovery did, in a form two versions of the
// code can be compared by: each CSI call with its volume, paths and
// secrets, the journal's records after it, the events that tell a task
// to restart, and whether the volume's staging counts as verified.
type recoveryTrace struct {
	Calls    []string
	Journal  []string
	Restarts int
	Verified bool
}

func traceCalls(h *harness) []string {
	var out []string
	for _, c := range h.fake.Calls() {
		keys := make([]string, 0, len(c.Secrets))
		for k, v := range c.Secrets {
			keys = append(keys, k+"="+v)
		}
		sort.Strings(keys)
		// The paths of vol1 and of task a's "data" by what they are.
		name := strings.NewReplacer(h.m.StagingPath("p", "vol1"), "<staging>", h.m.TargetPath("a", "data"), "<target>")
		out = append(out, fmt.Sprintf("%s %s staging=%s target=%s secrets=%v", c.Method, c.VolumeID,
			name.Replace(c.StagingPath), name.Replace(c.TargetPath), keys))
	}
	return out
}

func countRestartEvents(h *harness) int {
	n := 0
	for _, e := range h.eventMsgs() {
		if strings.Contains(e, "restart the task") {
			n++
		}
	}
	return n
}

// TestRecover_Table is recovery after a restart, case by case: the CSI
// calls it makes (and the secrets they carry), the journal it leaves, the
// tasks it tells to restart and whether it takes the volume's staging as
// verified.
func TestRecover_Table(t *testing.T) {
	k := volKey{"p", "vol1"}
	type setup struct {
		// controller: the plugin attaches (ControllerPublish).
		controller bool
		secrets    bool
	}
	cases := []struct {
		name string
		setup
		// before changes the volume's record before the restart.
		before func(v *volRecord)
		// stagingGone, taskLost unmount the staging path and task a's
		// target after the restart.
		stagingGone, taskLost bool
		want                  recoveryTrace
	}{
		{name: "staged, all mounted", want: recoveryTrace{
			Journal: []string{"task a/data published", "vol p/vol1 staged/"}, Verified: true}},
		{name: "staged, staging gone", stagingGone: true, want: recoveryTrace{
			Calls:   []string{`NodeStageVolume vol1 staging=<staging> target= secrets=[]`},
			Journal: []string{"task a/data published", "vol p/vol1 staged/"}, Verified: true}},
		{name: "staged, staging gone, secrets", setup: setup{secrets: true}, stagingGone: true, want: recoveryTrace{
			Journal: []string{"task a/data published", "vol p/vol1 staged/"}}},
		{name: "staged, task lost", taskLost: true, want: recoveryTrace{
			Calls: []string{`NodeStageVolume vol1 staging=<staging> target= secrets=[]`,
				`NodePublishVolume vol1 staging=<staging> target=<target> secrets=[]`},
			Journal: []string{"task a/data published", "vol p/vol1 staged/"}, Verified: true}},
		{name: "staged, task lost, secrets", setup: setup{secrets: true}, taskLost: true, want: recoveryTrace{
			Journal: []string{"task a/data published", "vol p/vol1 staged/"}, Restarts: 1}},
		{name: "staged, staging gone and task lost", stagingGone: true, taskLost: true, want: recoveryTrace{
			Calls: []string{`NodeStageVolume vol1 staging=<staging> target= secrets=[]`,
				`NodePublishVolume vol1 staging=<staging> target=<target> secrets=[]`},
			Journal: []string{"task a/data published", "vol p/vol1 staged/"}, Verified: true}},
		{name: "refused, all mounted", before: refuse, want: recoveryTrace{
			Journal: []string{"task a/data published", "vol p/vol1 refused/"}}},
		{name: "refused, task lost", before: refuse, taskLost: true, want: recoveryTrace{
			Calls: []string{`NodeStageVolume vol1 staging=<staging> target= secrets=[]`,
				`NodePublishVolume vol1 staging=<staging> target=<target> secrets=[]`},
			Journal: []string{"task a/data published", "vol p/vol1 staged/"}, Verified: true}},
		{name: "refused, task lost, secrets", setup: setup{secrets: true}, before: refuse, taskLost: true, want: recoveryTrace{
			Journal: []string{"task a/data published", "vol p/vol1 refused/"}, Restarts: 1}},
		{name: "staging, secrets", setup: setup{secrets: true}, before: func(v *volRecord) { v.Stage = phaseStaging },
			want: recoveryTrace{
				Calls:   []string{`NodeStageVolume vol1 staging=<staging> target= secrets=[token=` + canary + `]`},
				Journal: []string{"task a/data published", "vol p/vol1 staged/"}, Verified: true}},
		{name: "staging, staging gone", before: func(v *volRecord) { v.Stage = phaseStaging }, stagingGone: true,
			want: recoveryTrace{
				Calls:   []string{`NodeStageVolume vol1 staging=<staging> target= secrets=[]`},
				Journal: []string{"task a/data published", "vol p/vol1 staged/"}, Verified: true}},
		{name: "attached, staging gone, secrets", setup: setup{controller: true, secrets: true}, stagingGone: true,
			want: recoveryTrace{
				Calls:   []string{`NodeStageVolume vol1 staging=<staging> target= secrets=[token=` + canary + `]`},
				Journal: []string{"task a/data published", "vol p/vol1 staged/published"}, Verified: true}},
		{name: "attaching, staged, secrets", setup: setup{controller: true, secrets: true},
			before: func(v *volRecord) { v.Controller = phasePublishing }, want: recoveryTrace{
				Calls:   []string{`ControllerPublishVolume vol1 staging= target= secrets=[token=` + canary + `]`},
				Journal: []string{"task a/data published", "vol p/vol1 staged/published"}, Verified: true}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			if !tc.controller {
				stagingPlugin(h)
			}
			ctx := context.Background()
			r := multi(req("data", "vol1", "/data"))
			if !tc.secrets {
				r.Secrets = nil
			}
			_, err := h.m.Setup(ctx, "a", []VolumeRequest{r})
			must.NoError(t, err)
			if tc.before != nil {
				v, ok := h.m.vol(k)
				must.True(t, ok)
				tc.before(&v)
				must.NoError(t, h.m.commit(volPut(v)))
			}

			h.restart()
			if tc.stagingGone {
				must.NoError(t, h.mnt.Unmount(h.m.StagingPath("p", "vol1")))
			}
			if tc.taskLost {
				must.NoError(t, h.mnt.Unmount(h.m.TargetPath("a", "data")))
			}
			h.fake.ResetCalls()
			must.NoError(t, h.m.Recover(func(string) bool { return true }))
			h.waitIdle()
			got := recoveryTrace{Calls: traceCalls(h), Journal: h.journalRecords(), Restarts: countRestartEvents(h),
				Verified: h.m.isVerified(k)}
			must.Eq(t, tc.want, got)
		})
	}
}

// refuse makes the volume's record one whose last stage the plugin
// refused, as the journal holds it: without its secrets.
func refuse(v *volRecord) {
	v.Stage = phaseStageRefused
	v.Secrets = nil
}
