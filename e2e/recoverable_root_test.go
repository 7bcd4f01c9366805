//go:build e2e

package e2e

// A start that failed for a passing reason is retried by the job's restart
// block: the driver's start error says it is recoverable, so Nomad's task
// runner restarts the task instead of failing the allocation (a registry
// down for a few seconds must not end a job).

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
)

// TestRecoverableRegistryDown: an image task whose registry is down when
// it starts shows a Driver Failure that says the registry is unreachable,
// then a Restarting event, and runs once the registry is back. Before
// start errors said whether they are recoverable, the allocation failed
// at the first failure, whatever the job's restart block said.
func TestRecoverableRegistryDown(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	reg, img, _ := registryWithFixture(t)
	// A tag this node never pulled: no image of the store stands in.
	ref, err := reg.Push("csi/fixture:later", img)
	must.NoError(t, err)
	a := imageAgent(t, reg, "24h")

	reg.Stop()
	job := a.RunJob(t, "image", map[string]string{"Image": ref, "Username": reg.Username, "Password": reg.Password,
		"Count": "1", "Timeout": "2m", "RestartAttempts": "5"})
	defer a.StopJob(t, job.ID)

	// until waits for an event of type typ, failing at once when the
	// allocation fails. Nomad keeps a task's last 10 events only, the
	// failed pull's retries make 4 of them, and the task, which exits 1
	// (--help), is restarted again and again once it runs, 4 more each
	// time: each poll adds the events it has not seen to events, so that
	// the failure and the restart are still there when a slow poll (a
	// loaded machine) comes after several restarts. types are their
	// types, all their text.
	var (
		events []TaskEvent
		seen   = map[string]bool{}
		types  []string
		all    string
	)
	defer func() {
		if t.Failed() {
			t.Logf("events:\n%s", all)
		}
	}()
	until := func(typ string) {
		t.Helper()
		must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
			allocs, err := a.JobAllocations(job.ID)
			if err != nil || len(allocs) != 1 {
				return false
			}
			al, err := a.allocation(allocs[0].ID)
			if err != nil {
				return false
			}
			for _, e := range al.Events("") {
				if key := fmt.Sprint(e.Time, " ", e.Text()); !seen[key] {
					seen[key] = true
					events = append(events, e)
				}
			}
			types = types[:0]
			texts := make([]string, 0, len(events))
			for _, e := range events {
				types = append(types, e.Type)
				texts = append(texts, e.Text())
			}
			all = strings.Join(texts, "\n")
			must.NotEq(t, StatusFailed, al.ClientStatus, must.Sprintf("the allocation failed; events:\n%s", all))
			return slices.Contains(types, typ)
		}), wait.Timeout(3*time.Minute), wait.Gap(250*time.Millisecond)), must.Sprintf("no %s event", typ))
	}
	until("Restarting")
	must.NoError(t, reg.Start())
	// The restart pulls the image and starts the task.
	until("Started")
	t.Logf("events:\n%s", all)

	failure := slices.Index(types, "Driver Failure")
	restarting := slices.Index(types, "Restarting")
	started := slices.Index(types, "Started")
	must.NonNegative(t, failure, must.Sprint("no Driver Failure event"))
	must.Less(t, restarting, failure, must.Sprint("the Driver Failure came after the restart"))
	must.Less(t, started, restarting, must.Sprint("the task started before it was restarted"))
	must.StrContains(t, all, "unreachable")
	// The restart's pull; a slow poll may have missed its event, not the
	// next restart's, which finds the image pulled.
	must.True(t, strings.Contains(all, "Pulled image "+ref) || strings.Contains(all, "Image "+ref+" is present"),
		must.Sprint("no pull after the registry came back"))
	must.StrNotContains(t, all, "Not Restarting")
	must.StrNotContains(t, all, reg.Password)
}
