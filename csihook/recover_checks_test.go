package csihook

import (
	"context"
	"fmt"
	"testing"

	"github.com/shoenig/test/must"
)

// Recovery asks the mount table once about each staged volume's staging
// path: the check that decides whether a volume is staged again
// (stagingHeld) is the one ensureVolume goes by, not asked again there.
// Volumes whose staging is still mounted are left as they are; one whose
// staging mount is gone is staged again, with that one check too.
func TestRecover_ChecksEachStagingOnce(t *testing.T) {
	const n = 4
	h := newHarness(t)
	stagingPlugin(h)
	ctx := context.Background()
	for i := range n {
		r := multi(req("data", fmt.Sprintf("vol%d", i), "/data"))
		// Staged again after the restart only without secrets: the
		// journal keeps none once a volume is staged.
		r.Secrets = nil
		_, err := h.m.Setup(ctx, fmt.Sprintf("t%d", i), []VolumeRequest{r})
		must.NoError(t, err)
	}

	h.restart()
	// The last volume's staging mount is gone: it is staged again.
	gone := h.m.StagingPath("p", fmt.Sprintf("vol%d", n-1))
	must.NoError(t, h.mnt.Unmount(gone))
	h.mnt.ResetActions()
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	h.waitIdle()

	checks := map[string]int{}
	want := map[string]int{}
	for i := range n {
		path := h.m.StagingPath("p", fmt.Sprintf("vol%d", i))
		checks[path], want[path] = h.mnt.MountPointChecks(path), 1
	}
	// The fake plugin's NodeStageVolume looks at its staging path too.
	want[gone]++
	must.Eq(t, want, checks, must.Sprint("mount-point checks of each staging path during recovery"))
	must.Eq(t, []string{MethodNodeStageVolume}, h.fake.Methods())
	must.Eq(t, fmt.Sprintf("vol%d", n-1), h.fake.Calls()[0].VolumeID)
	must.StrContains(t, h.logs.String(), "staging from before a restart not found mounted; staging again")
	for i := range n {
		must.SliceContains(t, h.journalRecords(), fmt.Sprintf("vol p/vol%d staged/", i))
	}
}
