//go:build e2e

package e2e

import (
	"fmt"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// 23. Volume blocks as a weight: each field of a volume block has its
// limit, but a hostile job repeats blocks at those limits (here 17
// volumes with 63 KiB of context each, 1 MiB and more together, well
// within what Nomad hands the driver in one call). Each would be a journal
// record kept in memory and on disk and a set of plugin calls: a job of
// many such tasks would fill the driver's memory or the journal's disk and
// stall the teardown of every other allocation's volumes. The task is
// refused before any plugin call, with an error naming the limit, and
// the plugin never hears of its volumes.
func TestEscapeVolumeBlocksTooLarge(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "escbig", VolFixtureOptions{})
	u := escUniq()
	pad := strings.Repeat("x", 63<<10)
	var vols []VolSpec
	for i := range 17 {
		vols = append(vols, VolSpec{Name: fmt.Sprintf("v%02d", i), Plugin: fx.ID, ID: fmt.Sprintf("escape-big-%s-%02d", u, i),
			Dest: fmt.Sprintf("/v%02d", i), Create: true, CreateType: "dir", Context: map[string]string{"pad": pad}})
	}
	job := escRun(t, a, escJob{Script: `echo ran`, Volumes: vols})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusComplete, StatusFailed)
	text := eventsText(al, "t")
	t.Logf("the task (%s) events:\n%.2000s", al.ClientStatus, text)
	must.Eq(t, StatusFailed, al.ClientStatus, must.Sprint("a task whose volume blocks hold more than 1 MiB together ran"))
	must.StrContains(t, text, "the task's volume blocks hold")
	must.StrContains(t, text, "they must hold at most 1048576")
	for _, c := range fx.Calls() {
		if strings.Contains(c, "escape-big-"+u) || strings.HasPrefix(c, "CreateVolume") {
			t.Errorf("the plugin was called for the refused task's volumes: %s", c)
		}
	}
}
