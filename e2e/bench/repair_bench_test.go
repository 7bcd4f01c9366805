//go:build e2e

package bench

// BenchmarkRepairStale measures how long a FUSE-backed volume stays dead
// in a running task once its plugin is back: a service task uses a "fuse"
// volume of the e2e fixture (served by the fixture process itself); the
// fixture is killed with SIGKILL, Nomad restarts it (restart delay 1s), and
// the driver repairs the dead mounts and attaches the fresh one in the
// running task. The window is from the plugin's "healthy" event (the
// driver's, when it finds the restarted plugin answering) to the task's
// "repaired" event, from the events' own times; beside it, the same
// volume's first setup in that task ("Staging volume" → "Published
// volume"), which the repair redoes plus the attach. Median of -rruns
// kills:
//
//	go test -tags e2e -run '^$' -bench RepairStale -benchtime 1x ./e2e/bench/ -args -rruns 5
//
// Like the e2e tests it needs root, build/nomad and build/csi.

import (
	"flag"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

var repairRuns = flag.Int("rruns", 5, "plugin kills measured by BenchmarkRepairStale")

func BenchmarkRepairStale(b *testing.B) {
	setup(b, e2e.VolBuildCSIBinaries)
	a := startIsolationAgent(b, e2e.AgentOptions{AllowPrivileged: true})
	var jobs []string
	b.Cleanup(func() { volStopAll(b, a, jobs) })
	fx := a.StartVolFixture(b, "fxrepair", e2e.VolFixtureOptions{})
	dest := filepath.Join(a.Dir, "dst", "repair")
	job := a.RunVolJob(b, e2e.VolJob{Type: "service", Script: "echo started; exec sleep 3600", Volumes: []e2e.VolSpec{{
		Name: "data", Plugin: fx.ID, ID: "bench-repair", Dest: dest, Access: "single-node-writer", Create: true, CreateType: "fuse"}}})
	jobs = append(jobs, job.ID)
	al := a.WaitAlloc(b, job.ID, 2*time.Minute, e2e.StatusRunning)
	if out, err := a.AllocExec(al.ID, "t", "/bin/sh", "-c", "echo kept > "+dest+"/file"); err != nil {
		b.Fatalf("write: %v: %s", err, out)
	}
	first := a.Allocation(b, al.ID)
	staging, _ := eventAt(first.Events("t"), 0, `Staging volume "data"`)
	published, _ := eventAt(first.Events("t"), 0, `Published volume "data"`)
	setupWin := time.Duration(published - staging)

	var windows []time.Duration
	for i := 0; i < *repairRuns; i++ {
		pid := fx.PID()
		if pid <= 0 {
			b.Fatalf("run %d: the plugin is not running", i)
		}
		killed := time.Now().UnixNano()
		if err := unix.Kill(pid, unix.SIGKILL); err != nil {
			b.Fatal(err)
		}
		var healthy, repaired int64
		deadline := time.Now().Add(2 * time.Minute)
		for repaired == 0 {
			if time.Now().After(deadline) {
				b.Fatalf("run %d: no repair within 2m:\n%s", i, a.Allocation(b, al.ID).Describe())
			}
			time.Sleep(100 * time.Millisecond)
			repaired, _ = eventAt(a.Allocation(b, al.ID).Events("t"), killed, `Volume "data" repaired`)
		}
		healthy, _ = eventAt(a.Allocation(b, fx.AllocID).Events("plugin"), killed, fmt.Sprintf("CSI plugin %q healthy", fx.ID))
		if healthy == 0 || healthy > repaired {
			b.Fatalf("run %d: no plugin healthy event before the repair", i)
		}
		if out, err := a.AllocExec(al.ID, "t", "/bin/cat", dest+"/file"); err != nil || !strings.Contains(out, "kept") {
			b.Fatalf("run %d: the task cannot read its file after the repair: %v: %s", i, err, out)
		}
		windows = append(windows, time.Duration(repaired-healthy))
	}
	if st := a.Allocation(b, al.ID).Task("t"); st.Restarts != 0 {
		b.Fatalf("the task restarted %d times", st.Restarts)
	}
	b.ReportMetric(float64(median(windows).Microseconds())/1000, "repair-ms")
	b.ReportMetric(float64(setupWin.Microseconds())/1000, "setup-ms")
	b.ReportMetric(float64((slowest(windows)-fastest(windows)).Microseconds())/1000, "repair-spread-ms")
	b.Logf("plugin healthy -> repaired in the running task: %s; first setup (Staging -> Published) %v",
		spread(windows), setupWin)
}

// eventAt returns the time (ns) of the first event after after whose text
// holds substr, 0 when none.
func eventAt(events []e2e.TaskEvent, after int64, substr string) (int64, bool) {
	for _, e := range events {
		if e.Time > after && strings.Contains(e.Text(), substr) {
			return e.Time, true
		}
	}
	return 0, false
}
