//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
	"golang.org/x/sys/unix"
)

// A task Nomad forgot while the client was down (its job purged, the
// client's state without the allocation, as an agent interrupted while it
// collected the allocation leaves it): Nomad never recovers nor destroys
// it. The driver started by the client ends it once the dangling_tasks
// grace is over, and says so in the agent's log.
func TestAgentForgottenTaskEndedAsDangling(t *testing.T) {
	if testDriver != DriverName {
		t.Skip("dangling_tasks is the csi driver's")
	}
	t.Parallel()
	a := StartAgent(t, AgentOptions{Persistent: true, Drivers: []string{testDriver},
		DriverConfig: `dangling_tasks {
  grace  = "3s"
  period = "1s"
}`})

	job := a.RunJob(t, "restart", vars())
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "tick 1", 20*time.Second)
	shPID := taskShellPID(t, al.ID, "t")
	tasks := filepath.Join(a.DriverRoot, "tasks")
	before, err := os.ReadDir(tasks)
	must.NoError(t, err)
	must.SliceLen(t, 1, before)

	// The client goes (its task keeps running); the job is purged
	// meanwhile, and the client's state forgets the allocation.
	must.NoError(t, a.Stop(30*time.Second))
	out, err := a.Nomad("job", "stop", "-purge", job.ID)
	must.NoError(t, err, must.Sprint(out))
	must.NoError(t, os.Remove(filepath.Join(a.DataDir, "client", "state.db")))
	must.NoError(t, unix.Kill(shPID, 0), must.Sprint("the task must outlive its client for this case"))
	must.NoError(t, a.startProc(a.client))
	must.NoError(t, a.waitReady(90*time.Second))

	must.Wait(t, wait.InitialSuccess(wait.ErrorFunc(func() error {
		if unix.Kill(shPID, 0) == nil {
			return fmt.Errorf("task process %d still alive", shPID)
		}
		ents, err := os.ReadDir(tasks)
		if err != nil {
			return err
		}
		if len(ents) != 0 {
			return fmt.Errorf("task state directories left: %d", len(ents))
		}
		if !strings.Contains(a.Log(), "ended a dangling task") {
			return fmt.Errorf("no dangling task in the agent's log yet")
		}
		return nil
	}), wait.Timeout(Scaled(60*time.Second)), wait.Gap(200*time.Millisecond)))
	must.StrContains(t, a.Log(), al.ID)
}

// Only the driver goes, under an agent that runs on: Nomad starts it anew
// and recovers a task once the task's runner next needs the driver. A task
// restored at the agent's restart whose template waits for a Nomad
// variable that is gone is not recovered until the template renders, long
// after the dangling_tasks grace: the new driver process leaves it to
// Nomad, and the task runs on.
func TestDriverRestartLeavesTheAgentsTaskToNomad(t *testing.T) {
	if testDriver != DriverName {
		t.Skip("dangling_tasks is the csi driver's")
	}
	t.Parallel()
	a := StartAgent(t, AgentOptions{Persistent: true, Drivers: []string{testDriver},
		DriverConfig: `dangling_tasks {
  grace  = "3s"
  period = "1s"
}`})

	job, out, err := a.SubmitJob(t, "template_var", vars())
	must.NoError(t, err, must.Sprint(out))
	t.Cleanup(func() { a.stopJobs([]string{job.ID}, time.Minute) })
	out, err = a.Nomad("var", "put", "nomad/jobs/"+job.ID, "k=v")
	must.NoError(t, err, must.Sprint(out))
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "tick 1", 20*time.Second)
	shPID := taskShellPID(t, al.ID, "t")

	// The variable goes; the agent restarts and recovers the task, whose
	// template hook then waits.
	out, err = a.Nomad("var", "purge", "nomad/jobs/"+job.ID)
	must.NoError(t, err, must.Sprint(out))
	must.NoError(t, a.Restart())
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return strings.Contains(a.Log(), "task recovered")
	}), wait.Timeout(Scaled(60*time.Second)), wait.Gap(200*time.Millisecond)))
	must.NoError(t, unix.Kill(shPID, 0), must.Sprint("the task must outlive the agent's restart for this case"))

	// The driver alone dies; the agent starts it anew. Once the grace is
	// over it has judged the task, and left it.
	old := a.KillDriver(t)
	a.WaitDriverBack(t, old, 60*time.Second)
	var log string
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		log = a.Log()
		return strings.Contains(log, "ended a dangling task") || strings.Contains(log, "left to Nomad")
	}), wait.Timeout(Scaled(60*time.Second)), wait.Gap(200*time.Millisecond)))
	must.StrNotContains(t, log, "ended a dangling task", must.Sprintf("the driver ended the running agent's task:\n%s", a.driverLogLines(30)))
	must.NoError(t, unix.Kill(shPID, 0), must.Sprint("the driver ended a task the running agent holds"))

	// The variable comes back, for the stop.
	out, err = a.Nomad("var", "put", "nomad/jobs/"+job.ID, "k=v")
	must.NoError(t, err, must.Sprint(out))
}
