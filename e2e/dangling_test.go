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
