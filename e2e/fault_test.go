//go:build e2e

package e2e

// The fault suite: real agents, the real driver, the e2e fixture plugin
// (e2e/csiplugin) with fault rules (e2e/csiplugin/faults.go) that hang or
// fail a chosen call of a chosen volume. For each fault the task must end
// as a user expects (started after recovery, or failed with a reason in
// its events), a later task must use the same volume, and nothing may be
// left behind: no mount under the driver's staging and publish roots, no
// cgroup of the fault's allocations under the driver's cgroup parent, no
// process of them, no journal record of the volume. The counts go into a
// table, printed in the test log and written to build/faults.md.
//
//	make faults          # every fault (a few minutes)
//	make faults-short    # a representative subset, run by make test
//
// The groups run in parallel, each on its own agent; the faults of a group
// run one after another, since a driver or agent kill touches every task
// of its agent.

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

var faultRows faultTable

// faultWait bounds each wait of the suite: a recovery retries in the
// background with a backoff of seconds.
const faultWait = 90 * time.Second

func TestFaults(t *testing.T) {
	if os.Getenv("E2E_FAULTS") == "" {
		// Its own targets run it (faults-short is part of make test), on an
		// otherwise idle machine: it kills agents and fills disks.
		t.Skip("the fault suite runs with make faults or make faults-short (E2E_FAULTS=1)")
	}
	t.Parallel()
	requireCSI(t)
	csiBin(t, "csi-fixture")
	command := "make faults"
	if testing.Short() {
		command = "make faults-short"
	}
	t.Cleanup(func() {
		table := faultRows.Markdown(command)
		t.Logf("fault table:\n%s", table)
		root, err := RepoRoot()
		if err == nil {
			err = os.WriteFile(filepath.Join(root, "build", "faults.md"), []byte(table), 0o644)
		}
		if err != nil {
			t.Errorf("failed to write build/faults.md: %v", err)
		}
	})
	t.Run("driver", func(t *testing.T) { t.Parallel(); faultDriverGroup(t) })
	t.Run("codes", func(t *testing.T) { t.Parallel(); faultCodesGroup(t) })
	if testing.Short() {
		return
	}
	t.Run("agent", func(t *testing.T) { t.Parallel(); faultAgentGroup(t) })
	t.Run("disk", func(t *testing.T) { t.Parallel(); faultDiskGroup(t) })
}

// faultCase is one fault being run: the jobs and volumes it made, and its
// row of the table.
type faultCase struct {
	t    *testing.T
	a    *Agent
	fx   *VolFixture
	row  *faultRow
	jobs []string
	vols []string // names the volumes were created under
	// before are the mounts under the staging and publish roots when the
	// case began: what an earlier fault of the agent left is its own.
	before []string
}

// runFault runs fn as a subtest and then, whatever happened, stops the
// case's jobs, waits for their volumes to be torn down and counts what is
// left.
func runFault(t *testing.T, a *Agent, fx *VolFixture, group, fault string, fn func(c *faultCase)) {
	t.Run(strings.NewReplacer(" ", "_", ",", "").Replace(fault), func(t *testing.T) {
		c := &faultCase{t: t, a: a, fx: fx, row: &faultRow{Group: group, Fault: fault, Outcome: "did not get far"},
			before: a.VolMounts()}
		faultRows.add(c.row)
		start := time.Now()
		defer func() {
			c.finish()
			t.Logf("%s: %s in %v", fault, c.row.Outcome, time.Since(start).Round(time.Millisecond))
		}()
		fn(c)
	})
}

// outcome records what the case saw so far.
func (c *faultCase) outcome(format string, args ...any) {
	c.row.Outcome = fmt.Sprintf(format, args...)
	c.t.Logf("outcome: %s", c.row.Outcome)
}

func (c *faultCase) vol(name, dest string, create bool) VolSpec {
	if !contains(c.vols, name) {
		c.vols = append(c.vols, name)
	}
	return VolSpec{Name: "data", Plugin: c.fx.ID, ID: name, Dest: dest, Access: "single-node-writer", Create: create, CreateType: "dir"}
}

func (c *faultCase) run(j VolJob) Job {
	job := c.a.RunVolJob(c.t, j)
	c.jobs = append(c.jobs, job.ID)
	return job
}

// volIDs are the names and fixture ids of the case's volumes.
func (c *faultCase) volIDs() []string {
	var ids []string
	for _, n := range c.vols {
		ids = append(ids, n)
		if id := c.fx.VolumeID(n); id != "" {
			ids = append(ids, id)
		}
	}
	return ids
}

func (c *faultCase) allocIDs() []string {
	var ids []string
	for _, j := range c.jobs {
		allocs, _ := c.a.JobAllocations(j)
		for _, al := range allocs {
			ids = append(ids, al.ID)
		}
	}
	return ids
}

// finish releases the fixture, stops the case's jobs (bringing the agent
// back first if the case left it down), waits for the leftovers to go and
// records them.
func (c *faultCase) finish() {
	t, a := c.t, c.a
	if c.fx != nil {
		if err := c.fx.ClearFaults(); err != nil {
			t.Errorf("failed to clear the fault rules: %v", err)
		}
	}
	if a.PID() == 0 {
		if err := a.StartClient(); err != nil {
			t.Errorf("failed to start the client agent again: %v", err)
		}
	}
	for _, j := range c.jobs {
		_, _ = a.Nomad("job", "stop", "-detach", j)
	}
	deadline := time.Now().Add(faultWait)
	for _, j := range c.jobs {
		for time.Now().Before(deadline) {
			allocs, err := a.JobAllocations(j)
			if err == nil && allTerminal(allocs) {
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	allocs, vols := c.allocIDs(), c.volIDs()
	if t.Failed() {
		for _, id := range allocs {
			if al, err := a.allocation(id); err == nil {
				t.Logf("%s", al.Describe())
			}
		}
		t.Logf("driver log lines:\n%s", a.driverLogLines(60))
	}
	var left FaultLeft
	for {
		left = a.faultLeftovers(allocs, vols, false)
		var mounts []string
		for _, m := range left.Mounts {
			if !contains(c.before, m) {
				mounts = append(mounts, m)
			}
		}
		left.Mounts = mounts
		// Other files in the journal directory (a *.bad copy of a
		// damaged log) are not records: they go in the note.
		var recs, files []string
		for _, l := range left.Journal {
			if strings.HasPrefix(l, "file ") {
				files = append(files, l)
			} else {
				recs = append(recs, l)
			}
		}
		left.Journal = recs
		if len(files) > 0 {
			c.row.Note = strings.Join(files, "; ")
		}
		if left.empty() || time.Now().After(deadline) {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	c.row.Left = left
	if !left.empty() {
		t.Errorf("left behind after the fault: mounts %v; cgroups %v; processes %v; journal records %v",
			left.Mounts, left.Cgroups, left.Procs, left.Journal)
	}
	c.row.Pass = !t.Failed()
	if t.Failed() && !strings.HasPrefix(c.row.Outcome, "FAILED") {
		c.row.Outcome = "FAILED after: " + c.row.Outcome
	}
}

func (l FaultLeft) empty() bool {
	return len(l.Mounts)+len(l.Cgroups)+len(l.Procs)+len(l.Journal) == 0
}

// faultOneInstance checks that the job's only allocation runs one instance
// of its task (one sleep process) and that the journal holds one task
// record of the volume: a retried start ran the task once.
func (c *faultCase) faultOneInstance(jobID, name string) *Allocation {
	t := c.t
	al := c.a.WaitAlloc(t, jobID, faultWait, StatusRunning)
	for deadline := time.Now().Add(faultWait); ; time.Sleep(200 * time.Millisecond) {
		if al = c.a.Allocation(t, al.ID); al.Task("t") != nil && al.Task("t").State == "running" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("task t is not running within %v:\n%s", faultWait, al.Describe())
		}
	}
	c.a.WaitLogs(t, al.ID, "t", "started", faultWait)
	allocs, err := c.a.JobAllocations(jobID)
	must.NoError(t, err)
	must.Len(t, 1, allocs, must.Sprint("allocations of the job"))
	var sleeps []int
	for _, pid := range TaskPIDs(al.ID, "t") {
		if p, err := ReadProc(pid); err == nil && p.Comm == "sleep" {
			sleeps = append(sleeps, pid)
		}
	}
	must.Len(t, 1, sleeps, must.Sprintf("instances of the task (sleep processes) in allocation %s", al.ID))
	id := c.fx.VolumeID(name)
	st, err := c.a.VolJournal()
	must.NoError(t, err)
	var users []string
	for _, tk := range st.Tasks {
		if tk.VolumeID == id {
			users = append(users, tk.TaskID+" "+tk.State)
		}
	}
	must.Len(t, 1, users, must.Sprintf("task records of volume %s in the journal", id))
	return al
}

// laterTask runs a batch job with the same volume (no create block) that
// reads back what the first task wrote, and waits for it to complete.
func (c *faultCase) laterTask(name, dest, canary string) {
	t := c.t
	script := "echo later > " + dest + "/later && cat " + dest + "/later"
	want := "later"
	if canary != "" {
		script = "cat " + dest + "/f"
		want = canary
	}
	job := c.run(VolJob{Script: script, Volumes: []VolSpec{c.vol(name, dest, false)}})
	al := c.a.WaitAlloc(t, job.ID, faultWait, StatusComplete)
	must.StrContains(t, c.a.AllocLogs(t, al.ID, "t", false), want)
}

// waitVolumeClear waits until the journal has no record of the volume and
// nothing is mounted under the driver's staging and publish roots.
func (c *faultCase) waitVolumeClear(name string) {
	t := c.t
	id := c.fx.VolumeID(name)
	// Its staging path, and its publish targets while the journal still
	// names them.
	paths := append(c.a.VolJournalPaths(id), filepath.Join("staging", c.fx.ID, faultShortHash(id)))
	left := c.a.WaitVolJournalClear(faultWait, name, id)
	must.SliceEmpty(t, left, must.Sprintf("journal records of volume %s", name))
	must.SliceEmpty(t, c.a.WaitVolMountsGone(faultWait, paths...), must.Sprintf("mounts of volume %s", name))
}

// faultBadCopies lists the copies of a damaged journal the driver kept.
func faultBadCopies(t *testing.T, a *Agent) []string {
	t.Helper()
	bad, err := filepath.Glob(filepath.Join(a.DriverRoot, "journal", "*.bad"))
	must.NoError(t, err)
	return bad
}

// faultShortHash is how csihook names a volume's staging directory.
func faultShortHash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:8])
}

// ---- The driver plugin killed during each CSI call ----

var (
	faultSetupCalls    = []string{"CreateVolume", "ControllerPublishVolume", "NodeStageVolume", "NodePublishVolume"}
	faultTeardownCalls = []string{"NodeUnpublishVolume", "NodeUnstageVolume", "ControllerUnpublishVolume"}
	faultShortCalls    = map[string]bool{"NodeStageVolume": true, "NodeUnpublishVolume": true}
)

func faultDriverGroup(t *testing.T) {
	a := volAgent(t, false)
	// ControllerPublishVolume and ControllerUnpublishVolume are called
	// only for a plugin that publishes.
	fx := a.StartVolFixture(t, "fxdrv", VolFixtureOptions{Args: []string{"--controller-publish"}})
	for _, m := range faultSetupCalls {
		if testing.Short() && !faultShortCalls[m] {
			continue
		}
		runFault(t, a, fx, "driver", "driver killed during "+m, func(c *faultCase) { faultKillDriverSetup(c, m) })
	}
	for _, m := range faultTeardownCalls {
		if testing.Short() && !faultShortCalls[m] {
			continue
		}
		runFault(t, a, fx, "driver", "driver killed during "+m, func(c *faultCase) { faultKillDriverTeardown(c, m) })
	}
	runFault(t, a, fx, "plugin", "plugin killed during NodeStageVolume", faultKillPlugin)
	if testing.Short() {
		return
	}
	runFault(t, a, fx, "plugin", "plugin job stopped while its volume is in use", faultStopPlugin)
}

// The driver dies while StartTask waits on a hung setup call. Nomad starts
// a new driver and retries StartTask with the same task id: the task must
// run once, with its volume, and everything must go when it stops.
func faultKillDriverSetup(c *faultCase, method string) {
	t, a, fx := c.t, c.a, c.fx
	name := volUniq("kd-" + strings.ToLower(strings.TrimSuffix(method, "Volume")))
	dest := filepath.Join(volDir(a, name), "data")
	must.NoError(t, fx.SetFaults(method+" "+name+" hang"))
	job := c.run(VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{c.vol(name, dest, true)}})
	fx.WaitCallFor(t, method, name, 1, faultWait)
	c.outcome("%s hung", method)
	old := a.KillDriver(t)
	must.NoError(t, fx.ClearFaults())
	a.WaitDriverBack(t, old, faultWait)
	c.outcome("driver back after the kill")
	al := c.faultOneInstance(job.ID, name)
	canary := "kept-" + name
	must.StrContains(t, volExec(t, a, al.ID, "echo "+canary+" > "+dest+"/f && cat "+dest+"/f"), canary)
	c.outcome("task started once after the driver came back")
	a.VolStopAndWait(t, job.ID, faultWait)
	c.waitVolumeClear(name)
	c.laterTask(name, dest, canary)
	c.outcome("task started once after recovery; torn down on stop; a later task read its data")
}

// The driver dies while DestroyTask waits on a hung teardown call: the new
// driver must finish the teardown from its journal.
func faultKillDriverTeardown(c *faultCase, method string) {
	t, a, fx := c.t, c.a, c.fx
	name := volUniq("kd-" + strings.ToLower(strings.TrimSuffix(method, "Volume")))
	dest := filepath.Join(volDir(a, name), "data")
	job := c.run(VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{c.vol(name, dest, true)}})
	al := a.WaitAlloc(t, job.ID, faultWait, StatusRunning)
	canary := "kept-" + name
	must.StrContains(t, volExec(t, a, al.ID, "echo "+canary+" > "+dest+"/f && cat "+dest+"/f"), canary)
	must.NoError(t, fx.SetFaults(method+" "+name+" hang"))
	a.StopJob(t, job.ID)
	fx.WaitCallFor(t, method, name, 1, faultWait)
	c.outcome("%s hung during the stop", method)
	old := a.KillDriver(t)
	must.NoError(t, fx.ClearFaults())
	a.WaitDriverBack(t, old, faultWait)
	al = a.WaitAllocID(t, al.ID, faultWait, StatusComplete, StatusFailed)
	c.outcome("task stopped (%s)", al.ClientStatus)
	c.waitVolumeClear(name)
	id := fx.VolumeID(name)
	must.Positive(t, fx.Count("ControllerUnpublishVolume", id), must.Sprintf("calls: %v", fx.VolumeCalls(id)))
	c.laterTask(name, dest, canary)
	c.outcome("task stopped (%s); teardown finished by the new driver; a later task read the data", al.ClientStatus)
}

// The plugin process dies (SIGKILL) while it serves a call; Nomad restarts
// it and the driver's retries reach the new one.
func faultKillPlugin(c *faultCase) {
	t, a, fx := c.t, c.a, c.fx
	name := volUniq("kp")
	dest := filepath.Join(volDir(a, name), "data")
	must.NoError(t, fx.SetFaults("NodeStageVolume "+name+" hang"))
	job := c.run(VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{c.vol(name, dest, true)}})
	fx.WaitCallFor(t, "NodeStageVolume", name, 1, faultWait)
	pid := fx.PID()
	must.Positive(t, pid)
	must.NoError(t, unix.Kill(pid, unix.SIGKILL))
	must.NoError(t, fx.ClearFaults())
	c.outcome("plugin pid %d killed during NodeStageVolume", pid)
	a.WaitVolPluginHealthy(t, fx.ID, faultWait)
	al := c.faultOneInstance(job.ID, name)
	canary := "kept-" + name
	must.StrContains(t, volExec(t, a, al.ID, "echo "+canary+" > "+dest+"/f && cat "+dest+"/f"), canary)
	a.VolStopAndWait(t, job.ID, faultWait)
	c.waitVolumeClear(name)
	c.laterTask(name, dest, canary)
	c.outcome("task started once the restarted plugin answered; torn down on stop; a later task read its data")
}

// The plugin's job is stopped while a task uses its volume; the task then
// stops. Teardown waits for a plugin with that id and finishes once one
// is back.
func faultStopPlugin(c *faultCase) {
	t, a := c.t, c.a
	name := volUniq("sp")
	dest := filepath.Join(volDir(a, name), "data")
	job := c.run(VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{c.vol(name, dest, true)}})
	al := a.WaitAlloc(t, job.ID, faultWait, StatusRunning)
	canary := "kept-" + name
	must.StrContains(t, volExec(t, a, al.ID, "echo "+canary+" > "+dest+"/f && cat "+dest+"/f"), canary)
	a.VolStopAndWait(t, c.fx.JobID, faultWait)
	a.VolStopAndWait(t, job.ID, faultWait)
	volWaitEvent(t, a, al.ID, "retrying", faultWait)
	id := c.fx.VolumeID(name)
	must.NotEq(t, 0, len(a.VolJournalMentions(id)), must.Sprint("the journal forgot a volume it could not tear down"))
	c.outcome("task stopped with the plugin gone; teardown retrying")
	// The same job again: the driver keeps a plugin id to the job that
	// set its volumes up until they are released.
	out, err := a.Nomad("job", "start", "-detach", c.fx.JobID)
	must.NoError(t, err, must.Sprintf("nomad job start %s: %s", c.fx.JobID, out))
	a.WaitVolPluginHealthy(t, c.fx.ID, faultWait)
	c.waitVolumeClear(name)
	c.laterTask(name, dest, canary)
	c.outcome("teardown finished once the plugin was back; a later task read the data")
}

// ---- The client agent killed (SIGKILL) during a volume task's start and
// stop, and the journal damaged while the driver is stopped ----

func faultAgentGroup(t *testing.T) {
	a := volAgent(t, true)
	fx := a.StartVolFixture(t, "fxagent", VolFixtureOptions{})
	runFault(t, a, fx, "agent", "agent killed during a volume task's start", faultKillAgentStart)
	runFault(t, a, fx, "agent", "agent killed during a volume task's stop", faultKillAgentStop)
	runFault(t, a, fx, "journal", "journal with a torn tail", func(c *faultCase) { faultJournal(c, false) })
	runFault(t, a, fx, "journal", "journal with a corrupt frame in the middle", func(c *faultCase) { faultJournal(c, true) })
}

// The agent dies while StartTask waits on a hung NodePublishVolume; the
// driver lives on, finishes that start for nobody, and the restarted
// agent starts the task again under a new id. The task must run once and
// the first invocation's hold on the volume must go.
func faultKillAgentStart(c *faultCase) {
	t, a, fx := c.t, c.a, c.fx
	name := volUniq("ka-start")
	dest := filepath.Join(volDir(a, name), "data")
	must.NoError(t, fx.SetFaults("NodePublishVolume "+name+" hang"))
	job := c.run(VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{c.vol(name, dest, true)}})
	fx.WaitCallFor(t, "NodePublishVolume", name, 1, faultWait)
	must.NoError(t, a.KillClient())
	must.NoError(t, fx.ClearFaults())
	c.outcome("agent killed during NodePublishVolume")
	must.NoError(t, a.StartClient())
	al := c.faultOneInstance(job.ID, name)
	canary := "kept-" + name
	must.StrContains(t, volExec(t, a, al.ID, "echo "+canary+" > "+dest+"/f && cat "+dest+"/f"), canary)
	a.VolStopAndWait(t, job.ID, faultWait)
	c.waitVolumeClear(name)
	c.laterTask(name, dest, canary)
	c.outcome("task running once after the agent restart; torn down on stop; a later task read its data")
}

// The agent dies while DestroyTask waits on a hung NodeUnpublishVolume.
func faultKillAgentStop(c *faultCase) {
	t, a, fx := c.t, c.a, c.fx
	name := volUniq("ka-stop")
	dest := filepath.Join(volDir(a, name), "data")
	job := c.run(VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{c.vol(name, dest, true)}})
	al := a.WaitAlloc(t, job.ID, faultWait, StatusRunning)
	canary := "kept-" + name
	must.StrContains(t, volExec(t, a, al.ID, "echo "+canary+" > "+dest+"/f && cat "+dest+"/f"), canary)
	must.NoError(t, fx.SetFaults("NodeUnpublishVolume "+name+" hang"))
	a.StopJob(t, job.ID)
	fx.WaitCallFor(t, "NodeUnpublishVolume", name, 1, faultWait)
	must.NoError(t, a.KillClient())
	must.NoError(t, fx.ClearFaults())
	c.outcome("agent killed during NodeUnpublishVolume")
	must.NoError(t, a.StartClient())
	al = a.WaitAllocID(t, al.ID, faultWait, StatusComplete, StatusFailed)
	c.waitVolumeClear(name)
	c.laterTask(name, dest, canary)
	c.outcome("task stopped (%s) after the agent restart; teardown finished; a later task read the data", al.ClientStatus)
}

// The client stops (the driver with it) while a volume task runs; the
// journal is damaged; the client starts again. A torn tail is a batch a
// crash cut short; a corrupt frame in the middle is one of an earlier
// task's batches. The running task keeps its volume and everything is torn
// down when it stops.
func faultJournal(c *faultCase, corrupt bool) {
	t, a := c.t, c.a
	if corrupt {
		// Earlier history in the log: a task that used a volume and ended.
		early := volUniq("jr-early")
		earlyDest := filepath.Join(volDir(a, early), "data")
		ej := c.run(VolJob{Script: "echo early > " + earlyDest + "/f", Volumes: []VolSpec{c.vol(early, earlyDest, true)}})
		a.WaitAlloc(t, ej.ID, faultWait, StatusComplete)
		c.waitVolumeClear(early)
	}
	name := volUniq("jr")
	dest := filepath.Join(volDir(a, name), "data")
	job := c.run(VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{c.vol(name, dest, true)}})
	al := a.WaitAlloc(t, job.ID, faultWait, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "started", faultWait)
	pids := TaskPIDs(al.ID, "t")
	canary := "kept-" + name
	must.StrContains(t, volExec(t, a, al.ID, "echo "+canary+" > "+dest+"/f && cat "+dest+"/f"), canary)
	driverPID := a.DriverPluginPID()
	must.NoError(t, a.Stop(30*time.Second))
	for deadline := time.Now().Add(10 * time.Second); procState(driverPID) != "?" && procState(driverPID) != "Z"; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the driver pid %d outlived its agent", driverPID)
		}
	}
	var what string
	var err error
	if corrupt {
		what, err = a.CorruptJournalFrame(func(n int) int {
			if n < 3 {
				return -1
			}
			return n / 3
		})
	} else {
		what, err = a.TearJournalTail()
	}
	must.NoError(t, err)
	c.outcome("driver stopped; %s", what)
	must.NoError(t, a.StartClient())
	al = a.WaitAllocID(t, al.ID, faultWait, StatusRunning)
	must.Eq(t, pids, TaskPIDs(al.ID, "t"), must.Sprint("the task's processes changed across the restart"))
	must.StrContains(t, volExec(t, a, al.ID, "cat "+dest+"/f"), canary)
	if corrupt {
		// The driver keeps a copy of the damaged log for the operator
		// (it holds secrets: owner only) and goes on without it; the
		// operator removes it once they have looked.
		bad := faultBadCopies(t, a)
		must.SliceLen(t, 1, bad, must.Sprintf("copies of the damaged journal: %v", bad))
		fi, err := os.Stat(bad[0])
		must.NoError(t, err)
		must.Eq(t, os.FileMode(0o600), fi.Mode().Perm(), must.Sprintf("mode of %s", bad[0]))
		must.NoError(t, os.Remove(bad[0]))
		c.outcome("driver started on the damaged journal (%s); a copy kept 0600 for the operator", what)
	} else {
		// A torn tail is what any crash mid-write leaves: nothing to keep.
		must.SliceEmpty(t, faultBadCopies(t, a), must.Sprint("copies of a journal with a torn tail"))
	}
	a.VolStopAndWait(t, job.ID, faultWait)
	c.waitVolumeClear(name)
	c.laterTask(name, dest, canary)
	c.outcome("driver started on the damaged journal (%s); the task kept its volume; torn down on stop; a later task read its data", what)
}

// ---- root_dir on a small file system that fills up ----

func faultDiskGroup(t *testing.T) {
	var fsDir string
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Prepare: func(a *Agent) error {
		fsDir = a.DriverRoot
		return unix.Mount("tmpfs", a.DriverRoot, "tmpfs", 0, "size=16m,mode=0700")
	}})
	// The tmpfs at root_dir is the fault's; everything else must go.
	t.Cleanup(func() { volFinalCheck(t, a, fsDir) })
	fx := a.StartVolFixture(t, "fxdisk", VolFixtureOptions{})
	runFault(t, a, fx, "disk", "root_dir on a full file system", func(c *faultCase) { faultFullDisk(c, fsDir) })
}

// fillFS writes a file in dir until the file system is full and returns
// its path.
func fillFS(dir string) (string, error) {
	p := filepath.Join(dir, "filler")
	f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return p, err
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for {
		if _, err := f.Write(buf); err != nil {
			if strings.Contains(err.Error(), "no space left") {
				return p, nil
			}
			return p, err
		}
	}
}

// A volume task runs; root_dir fills up; a second volume task starts (it
// must start, or fail saying the file system is full); the driver is killed and
// comes back on the full disk; the first task stops; space is freed. The
// teardowns must finish and a later task must use the volume.
func faultFullDisk(c *faultCase, dir string) {
	t, a := c.t, c.a
	name := volUniq("full")
	dest := filepath.Join(volDir(a, name), "data")
	job := c.run(VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{c.vol(name, dest, true)}})
	al := a.WaitAlloc(t, job.ID, faultWait, StatusRunning)
	canary := "kept-" + name
	must.StrContains(t, volExec(t, a, al.ID, "echo "+canary+" > "+dest+"/f && cat "+dest+"/f"), canary)
	filler, err := fillFS(dir)
	t.Cleanup(func() { _ = os.Remove(filler) })
	must.NoError(t, err)

	second := volUniq("full2")
	secondDest := filepath.Join(volDir(a, second), "data")
	j2 := c.run(VolJob{Script: "echo second", Volumes: []VolSpec{c.vol(second, secondDest, true)}})
	al2 := a.WaitAlloc(t, j2.ID, faultWait, StatusComplete, StatusFailed)
	if al2.ClientStatus == StatusFailed {
		// Refused at once, naming the full file system (diskfull.go), or
		// failed on the way with the kernel's word for it.
		msg := volDriverError(al2)
		if !strings.Contains(msg, "has no free space left") && !strings.Contains(msg, "no space left on device") {
			t.Fatalf("the task on the full disk failed for another reason: %s\n%s", msg, al2.Describe())
		}
	}
	secondOutcome := fmt.Sprintf("a task started on the full disk: %s %s", al2.ClientStatus, volDriverError(al2))

	old := a.KillDriver(t)
	a.WaitDriverBack(t, old, faultWait)
	a.VolStopAndWait(t, job.ID, faultWait)
	c.outcome("%s; driver killed and back on the full disk; first task stopped", secondOutcome)
	must.NoError(t, os.Remove(filler))
	c.waitVolumeClear(name)
	c.waitVolumeClear(second)
	c.laterTask(name, dest, canary)
	c.outcome("%s; after space was freed the teardowns finished and a later task read the data", secondOutcome)
}

// ---- A plugin that answers every call with an error code ----

// faultCodes are the gRPC codes a plugin can answer with; retryable ones
// (Unavailable, ResourceExhausted, Aborted, DeadlineExceeded) are retried
// first.
var faultCodes = []string{"Canceled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists",
	"PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
	"Internal", "Unavailable", "DataLoss", "Unauthenticated"}

var faultShortCodes = map[string]bool{"Unavailable": true, "InvalidArgument": true}

func faultCodesGroup(t *testing.T) {
	a := volAgent(t, false)
	fx := a.StartVolFixture(t, "fxcodes", VolFixtureOptions{})
	var codes []string
	for _, code := range faultCodes {
		if !testing.Short() || faultShortCodes[code] {
			codes = append(codes, code)
		}
	}
	// The volumes exist before the plugin starts failing: every call of
	// the task's setup fails then, the first being NodeStageVolume.
	names := map[string]string{}
	var vols []VolSpec
	for _, code := range codes {
		names[code] = volUniq("code-" + strings.ToLower(code))
		v := VolSpec{Name: "v" + strings.ToLower(code), Plugin: fx.ID, ID: names[code], Dest: filepath.Join(volDir(a, names[code]), "data"),
			Access: "single-node-writer", Create: true, CreateType: "dir"}
		vols = append(vols, v)
	}
	mk := a.RunVolJob(t, VolJob{Script: "true", Volumes: vols})
	a.WaitAlloc(t, mk.ID, faultWait, StatusComplete)
	for _, code := range codes {
		runFault(t, a, fx, "codes", "plugin answers every call with "+code, func(c *faultCase) { faultCode(c, code, names[code]) })
	}
}

// The task fails; its event names the code and says what to do; once the
// plugin answers again, a later task uses the volume and nothing is left.
func faultCode(c *faultCase, code, name string) {
	t, a, fx := c.t, c.a, c.fx
	dest := filepath.Join(volDir(a, name), "data")
	must.NoError(t, fx.SetFaults("* "+name+" fail "+code))
	job := c.run(VolJob{Script: "echo SHOULD-NOT-RUN", Volumes: []VolSpec{c.vol(name, dest, false)}})
	al := a.WaitAlloc(t, job.ID, faultWait, StatusFailed)
	msg := volDriverError(al)
	c.outcome("task failed: %s", msg)
	for _, e := range al.Events("t") {
		must.NotEq(t, "Started", e.Type, must.Sprint("the task started"))
	}
	// "...: <Code>: injected <Code> failure of <Method>: <what to do>"
	hint := regexp.MustCompile(`: ` + code + `: injected ` + code + ` failure of \w+: (\S.*)$`).FindStringSubmatch(msg)
	must.SliceLen(t, 2, hint, must.Sprintf("the task's error names the code and what to do: %q\n%s", msg, al.Describe()))
	must.StrContains(t, eventsText(al, "t"), "("+code, must.Sprintf("a volume event names the code:\n%s", al.Describe()))
	must.NoError(t, fx.ClearFaults())
	c.laterTask(name, dest, "")
	what, _, _ := strings.Cut(hint[1], " (undoing")
	c.outcome("task failed naming %s and what to do (%s); a later task used the volume", code, what)
}
