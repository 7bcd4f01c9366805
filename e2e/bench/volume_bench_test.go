//go:build e2e

package bench

// BenchmarkVolumes measures CSI volume tasks of the csi driver on one real
// agent, with the e2e fixture plugin (e2e/csiplugin) run as a plugin task,
// and prints one table:
//
//   - one volume task (a dir volume, already created): submit -> running,
//     and the driver's own window, from its "Staging volume" event to
//     Nomad's "Started" event (NodeStage + NodePublish + starting the
//     process), median of -vruns runs; beside the same task without a
//     volume, and against the floor measured in the same run: the same
//     NodeStageVolume + NodePublishVolume issued directly to the same
//     plugin socket with csihook's client, plus a bare fork/exec of
//     /bin/true; and the same volume task privileged, interleaved: what
//     isolation costs a volume task's start (see isolation_test.go);
//   - 50 volume tasks at once (one job, count = 50, a dir volume per
//     allocation): submit -> all running, and the driver's RSS idle and
//     with the 50 running;
//   - the same 49 tasks submitted together with one task whose plugin (a
//     second fixture, --hang NodeStageVolume) never answers: the 49 must
//     not wait for it.
//
// It runs once, whatever b.N, in about two minutes:
//
//	go test -tags e2e -run '^$' -bench Volumes -benchtime 1x ./e2e/bench/ -args -vruns 7
//
// Like the e2e tests it needs root and build/nomad; it builds the driver
// and build/csi first (E2E_SKIP_BUILD=1 uses what is there).

import (
	"context"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

var volRuns = flag.Int("vruns", 7, "measured runs of the one-volume task, the no-volume task and the floor")

var volMany = flag.Int("vmany", 50, "volume tasks started at once")

func BenchmarkVolumes(b *testing.B) {
	setup(b, e2e.VolBuildCSIBinaries)
	var a *e2e.Agent
	b.Cleanup(func() {
		if a != nil {
			_ = e2e.VolDetachLoops(a.Dir)
		}
	})
	a = startIsolationAgent(b, e2e.AgentOptions{AllowPrivileged: true})
	var jobs []string
	b.Cleanup(func() { volStopAll(b, a, jobs) })
	fx := a.StartVolFixture(b, "fixture", e2e.VolFixtureOptions{})
	time.Sleep(2 * time.Second)
	idleRSS := pluginRSS(b, a)

	// ---- one volume task, against its floor ----
	one := "bench-one"
	vol := e2e.VolSpec{Name: "data", Plugin: fx.ID, ID: one, Dest: filepath.Join(a.Dir, "dst", "one"), Access: "single-node-writer"}
	warm := vol
	warm.Create, warm.CreateType = true, "dir"
	volOne(b, a, fx, warm, "", nil) // creates the volume; unmeasured
	startOne(b, a, "csi")           // warm-up of the plain task
	volID := fx.VolumeID(one)
	volOne(b, a, fx, vol, volID, taskVariants[variantPrivileged]) // warm-up of the privileged task

	var withVol, window, setupVol, csiPart, noVol, setupNoVol, csiFloor, execFloor, syncFloor []time.Duration
	var withVolPriv, windowPriv []time.Duration
	client, err := csihook.DialUnix(filepath.Join(a.DriverRoot, "plugins", fx.ID, "csi.sock"))
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	for i := 0; i < *volRuns; i++ {
		s := volOne(b, a, fx, vol, volID, nil)
		withVol, window, setupVol = append(withVol, s.submitToRunning), append(window, s.stagingToStarted), append(setupVol, s.setupToStarted)
		csiPart = append(csiPart, s.stagingToPublished)
		// The same task privileged: root either way (volume_task.hcl).
		s = volOne(b, a, fx, vol, volID, taskVariants[variantPrivileged])
		withVolPriv, windowPriv = append(withVolPriv, s.submitToRunning), append(windowPriv, s.stagingToStarted)
		p := plainOne(b, a)
		noVol, setupNoVol = append(noVol, p.submitToRunning), append(setupNoVol, p.setupToStarted)
		csiFloor = append(csiFloor, floorCSI(b, client, a, volID))
		execFloor = append(execFloor, floorExec(b))
		syncFloor = append(syncFloor, floorJournalCommit(b, a.DriverRoot))
	}
	floor := median(csiFloor) + median(execFloor)

	// ---- many volume tasks at once ----
	manyVol := e2e.VolSpec{Name: "data", Plugin: fx.ID, ID: "bench-many-${NOMAD_ALLOC_INDEX}", Interpolate: true,
		Dest: filepath.Join(a.Dir, "dst", "many"), Access: "single-node-writer", Create: true, CreateType: "dir"}
	t0 := time.Now()
	manyJob := volSubmit(b, a, &jobs, e2e.VolJob{Type: "service", Count: *volMany, Script: "exec sleep 3600", Volumes: []e2e.VolSpec{manyVol}}, nil)
	manyStarted := waitRunning(b, a, manyJob, *volMany, 5*time.Minute)
	manyTimes := since(t0, manyStarted)
	time.Sleep(2 * time.Second)
	busyRSS := pluginRSS(b, a)
	stop(b, a, manyJob)
	volWaitIdle(b, a, 2*time.Minute)

	// The same number of tasks without a volume, for comparison.
	t0 = time.Now()
	plainJob := volSubmit(b, a, &jobs, e2e.VolJob{Type: "service", Count: *volMany, Script: "exec sleep 3600"}, nil)
	plainTimes := since(t0, waitRunning(b, a, plainJob, *volMany, 5*time.Minute))
	stop(b, a, plainJob)

	// ---- the same minus one, beside one task whose plugin hangs ----
	hang := a.StartVolFixture(b, "fxhang", e2e.VolFixtureOptions{Args: []string{"--hang", "NodeStageVolume"}})
	hangVol := e2e.VolSpec{Name: "data", Plugin: hang.ID, ID: "bench-hung", Dest: filepath.Join(a.Dir, "dst", "hung"),
		Access: "single-node-writer", Create: true, CreateType: "dir"}
	t0 = time.Now()
	hungJob := volSubmit(b, a, &jobs, e2e.VolJob{Type: "service", Script: "exec sleep 3600", Volumes: []e2e.VolSpec{hangVol}}, nil)
	restJob := volSubmit(b, a, &jobs, e2e.VolJob{Type: "service", Count: *volMany - 1, Script: "exec sleep 3600", Volumes: []e2e.VolSpec{manyVol}}, nil)
	restStarted := waitRunning(b, a, restJob, *volMany-1, 5*time.Minute)
	restTimes := since(t0, restStarted)
	hungState := "not running"
	if allocs, err := a.JobAllocations(hungJob); err == nil && len(allocs) > 0 {
		if ts := allocs[0].TaskStates["t"]; ts != nil {
			hungState = ts.State
		}
	}
	stagesHung := hang.Count("NodeStageVolume", "")
	// ---- report ----
	ratio := func(x, y time.Duration) string { return fmt.Sprintf("%.2fx", float64(x)/float64(y)) }
	sorted49 := append([]time.Duration(nil), manyTimes...)
	sort.Slice(sorted49, func(i, j int) bool { return sorted49[i] < sorted49[j] })
	sorted49 = sorted49[:len(sorted49)-1]
	var sb strings.Builder
	row := func(k, format string, args ...any) { fmt.Fprintf(&sb, "%-52s %s\n", k, fmt.Sprintf(format, args...)) }
	fmt.Fprintf(&sb, "\n%-52s %s\n%s %s\n", "metric", "value", strings.Repeat("-", 52), strings.Repeat("-", 30))
	row("1 volume task: submit->running", "%v  (%s)", median(withVol).Round(time.Millisecond), list(withVol))
	row("same task, no volume: submit->running", "%v  (%s)", median(noVol).Round(time.Millisecond), list(noVol))
	row("1 volume task: Task Setup->Started", "%v  (%s)", median(setupVol).Round(time.Millisecond), list(setupVol))
	row("same task, no volume: Task Setup->Started", "%v  (%s)", median(setupNoVol).Round(time.Millisecond), list(setupNoVol))
	row("driver window: Staging event->Started", "%v  (%s)", median(window).Round(100*time.Microsecond), list(window))
	row("floor: NodeStage+NodePublish direct", "%v  (%s)", median(csiFloor).Round(100*time.Microsecond), listMicros(csiFloor))
	row("floor: fork/exec /bin/true", "%v  (%s)", median(execFloor).Round(10*time.Microsecond), listMicros(execFloor))
	row("floor: sum", "%v", floor.Round(100*time.Microsecond))
	row("  of which Staging->Published (CSI + journal)", "%v  (%s)", median(csiPart).Round(100*time.Microsecond), list(csiPart))
	row("  of which Published->Started (process + Nomad)", "%v", (median(window) - median(csiPart)).Round(100*time.Microsecond))
	row("floor: one journal commit (600 B write+fdatasync)", "%v  (%s)", median(syncFloor).Round(100*time.Microsecond), listMicros(syncFloor))
	row("driver window p90", "%v", percentile(window, 90).Round(100*time.Microsecond))
	row("ratio driver window / floor", "%s (target <= 1.2x)", ratio(median(window), floor))
	row("ratio driver window p90 / floor", "%s (target <= 1.5x)", ratio(percentile(window, 90), floor))
	row("ratio Staging->Published / CSI floor", "%s", ratio(median(csiPart), median(csiFloor)))
	row("ratio volume-task setup->started / floor", "%s", ratio(median(setupVol), floor))
	row("added by the volume: submit->running", "%v", (median(withVol) - median(noVol)).Round(time.Millisecond))
	row("same volume task privileged: submit->running", "%v  (%s)", median(withVolPriv).Round(time.Millisecond), list(withVolPriv))
	row("privileged: Staging event->Started", "%v  (%s)", median(windowPriv).Round(100*time.Microsecond), list(windowPriv))
	row("ratio isolated / privileged: Staging->Started", "%s (target <= 1.1x)", ratio(median(window), median(windowPriv)))
	row("ratio isolated / privileged: submit->running", "%s", ratio(median(withVol), median(withVolPriv)))
	row(fmt.Sprintf("%d volume tasks at once: submit->all running", *volMany), "%v (median task %v)", maxDur(manyTimes).Round(time.Millisecond), median(manyTimes).Round(time.Millisecond))
	row(fmt.Sprintf("%d tasks without volumes: submit->all running", *volMany), "%v (median task %v)", maxDur(plainTimes).Round(time.Millisecond), median(plainTimes).Round(time.Millisecond))
	row(fmt.Sprintf("first %d of those: median / slowest", *volMany-1), "%v / %v", median(sorted49).Round(time.Millisecond), maxDur(sorted49).Round(time.Millisecond))
	row(fmt.Sprintf("%d beside 1 hung NodeStage: median / slowest", *volMany-1), "%v / %v  (hung task: %s, %d NodeStage calls hanging)",
		median(restTimes).Round(time.Millisecond), maxDur(restTimes).Round(time.Millisecond), hungState, stagesHung)
	row("ratio with hang / without (slowest of 49)", "%s", ratio(maxDur(restTimes), maxDur(sorted49)))
	row("driver RSS, idle (1 plugin task)", "%s", kb(idleRSS))
	row(fmt.Sprintf("driver RSS, %d volume tasks running", *volMany), "%s", kb(busyRSS))
	fmt.Print(sb.String())
	stop(b, a, restJob)
	// Free the hung call: stop the job, run the plugin's own job again
	// without --hang on the same state (while a plugin's volumes are set
	// up on the node, the driver lets no other job serve its id), and let
	// the driver finish or undo the setup.
	if err := a.PutJSON("DELETE", "/v1/job/"+hungJob, nil, nil); err != nil {
		b.Fatal(err)
	}
	a.VolStopAndWait(b, hang.JobID, time.Minute)
	rerunWithoutArgs(b, a, hang.JobID, "--hang", "NodeStageVolume")
	a.WaitVolPluginHealthy(b, hang.ID, time.Minute)
	volWaitIdle(b, a, 3*time.Minute)

	b.ReportMetric(float64(median(window).Microseconds())/1000, "window-ms")
	b.ReportMetric(float64(percentile(window, 90).Microseconds())/1000, "window-p90-ms")
	b.ReportMetric(float64(floor.Microseconds())/1000, "floor-ms")
	b.ReportMetric(float64(median(windowPriv).Microseconds())/1000, "window-privileged-ms")
	b.ReportMetric(float64(median(withVol).Microseconds())/1000, "one-ms")
	b.ReportMetric(float64(median(withVolPriv).Microseconds())/1000, "one-privileged-ms")
}

// rerunWithoutArgs registers a stopped job again, as it was, with drop
// (consecutive arguments) taken out of its tasks' args.
func rerunWithoutArgs(b *testing.B, a *e2e.Agent, jobID string, drop ...string) {
	b.Helper()
	var job map[string]any
	if err := a.GetJSON("/v1/job/"+jobID, &job); err != nil {
		b.Fatalf("failed to read job %s: %v", jobID, err)
	}
	job["Stop"] = false
	tweakTasks(b, job, func(task map[string]any) {
		c := taskConfig(task)
		args, _ := c["args"].([]any)
		c["args"] = withoutArgs(args, drop...)
	})
	if err := a.PutJSON("POST", "/v1/jobs", map[string]any{"Job": job}, nil); err != nil {
		b.Fatalf("failed to run job %s again: %v", jobID, err)
	}
}

// withoutArgs returns args with the first run of drop taken out.
func withoutArgs(args []any, drop ...string) []any {
	for i := 0; i+len(drop) <= len(args); i++ {
		match := true
		for j, d := range drop {
			match = match && args[i+j] == d
		}
		if match {
			return append(args[:i:i], args[i+len(drop):]...)
		}
	}
	return args
}

type volSample struct {
	submitToRunning, stagingToStarted, setupToStarted, stagingToPublished time.Duration
}

// volOne runs a one-task service job with vol, its task changed by tweak
// (nil: as volume_task.hcl has it), measures it, stops it, and waits until
// the volume is unstaged again (volID "" skips that wait).
func volOne(b *testing.B, a *e2e.Agent, fx *e2e.VolFixture, vol e2e.VolSpec, volID string, tweak func(task map[string]any)) volSample {
	b.Helper()
	unstaged := fx.Count("NodeUnstageVolume", volID)
	var jobs []string
	t0 := time.Now()
	job := volSubmit(b, a, &jobs, e2e.VolJob{Type: "service", Script: "exec sleep 3600", Volumes: []e2e.VolSpec{vol}}, tweak)
	started := waitRunning(b, a, job, 1, time.Minute)
	s := volSample{submitToRunning: started[0].Sub(t0)}
	s.stagingToStarted, s.setupToStarted, s.stagingToPublished = eventWindows(b, a, job)
	stop(b, a, job)
	if volID != "" {
		deadline := time.Now().Add(time.Minute)
		for fx.Count("NodeUnstageVolume", volID) <= unstaged && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
	}
	return s
}

// plainOne is volOne for the same task without a volume.
func plainOne(b *testing.B, a *e2e.Agent) volSample {
	b.Helper()
	var jobs []string
	t0 := time.Now()
	job := volSubmit(b, a, &jobs, e2e.VolJob{Type: "service", Script: "exec sleep 3600"}, nil)
	started := waitRunning(b, a, job, 1, time.Minute)
	s := volSample{submitToRunning: started[0].Sub(t0)}
	_, s.setupToStarted, _ = eventWindows(b, a, job)
	stop(b, a, job)
	return s
}

// eventWindows reads the task's events: the first "Staging volume" event
// to "Started", "Task Setup" to "Started", and "Staging volume" to the
// last "Published volume".
func eventWindows(b *testing.B, a *e2e.Agent, jobID string) (time.Duration, time.Duration, time.Duration) {
	b.Helper()
	allocs, err := a.JobAllocations(jobID)
	if err != nil || len(allocs) == 0 {
		b.Fatalf("no allocation of %s: %v", jobID, err)
	}
	al := a.Allocation(b, allocs[0].ID)
	var setup, staging, published, started int64
	for _, e := range al.Events("t") {
		switch {
		case e.Type == "Driver" && strings.HasPrefix(e.DisplayMessage, "Published volume"):
			published = e.Time
		case e.Type == "Task Setup" && setup == 0:
			setup = e.Time
		case e.Type == "Driver" && staging == 0 && strings.HasPrefix(e.DisplayMessage, "Staging volume"):
			staging = e.Time
		case e.Type == "Started":
			started = e.Time
		}
	}
	if started == 0 || setup == 0 {
		b.Fatalf("missing events:\n%s", al.Describe())
	}
	var window, csiPart time.Duration
	if staging != 0 {
		window, csiPart = time.Duration(started-staging), time.Duration(published-staging)
	}
	return window, time.Duration(started - setup), csiPart
}

// volSubmit renders a workload job, registers it over the API with its
// task changed by tweak (see register) and returns its ID.
func volSubmit(b *testing.B, a *e2e.Agent, jobs *[]string, j e2e.VolJob, tweak func(task map[string]any)) string {
	b.Helper()
	job, err := a.RenderVolJob(j)
	if err != nil {
		b.Fatal(err)
	}
	*jobs = append(*jobs, job.ID)
	register(b, a, job, tweak)
	return job.ID
}

// floorCSI stages and publishes the volume directly through the plugin's
// socket (timed), then unpublishes and unstages it (not timed). The paths
// are under the driver's stage root, where the plugin's mounts reach the
// host, as the driver's own do.
func floorCSI(b *testing.B, c csihook.Client, a *e2e.Agent, volID string) time.Duration {
	b.Helper()
	base := filepath.Join(a.DriverRoot, "mnt", "bench-floor")
	stg, target := filepath.Join(base, "staging"), filepath.Join(base, "publish", "data")
	if err := os.MkdirAll(filepath.Dir(target), 0o700); err != nil {
		b.Fatal(err)
	}
	vc := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	t0 := time.Now()
	if _, err := c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: volID, StagingTargetPath: stg, VolumeCapability: vc}); err != nil {
		b.Fatalf("NodeStageVolume: %v", err)
	}
	if _, err := c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: volID, StagingTargetPath: stg, TargetPath: target, VolumeCapability: vc}); err != nil {
		b.Fatalf("NodePublishVolume: %v", err)
	}
	d := time.Since(t0)
	if _, err := c.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: target}); err != nil {
		b.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := c.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: stg}); err != nil {
		b.Fatalf("NodeUnstageVolume: %v", err)
	}
	return d
}

// floorExec times a bare fork/exec/wait of /bin/true.
func floorExec(b *testing.B) time.Duration {
	b.Helper()
	t0 := time.Now()
	if err := exec.Command("/bin/true").Run(); err != nil {
		b.Fatal(err)
	}
	return time.Since(t0)
}

// floorJournalCommit times what the journal does per commit: write a
// frame of about 600 bytes (the size of a task record's) over zeros in a
// file preallocated ahead of it, and fdatasync it. The file is in dir, on
// the journal's file system; making and zero-filling it is not timed.
func floorJournalCommit(b *testing.B, dir string) time.Duration {
	b.Helper()
	f, err := os.CreateTemp(dir, "bench-floor-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if _, err = f.Write(make([]byte, 256<<10)); err == nil {
		err = f.Sync()
	}
	if err != nil {
		b.Fatal(err)
	}
	frame := []byte(strings.Repeat("x", 600))
	t0 := time.Now()
	if _, err = f.WriteAt(frame, 0); err == nil {
		err = unix.Fdatasync(int(f.Fd()))
	}
	elapsed := time.Since(t0)
	if err != nil {
		b.Fatal(err)
	}
	return elapsed
}

// volWaitIdle waits until the driver's journal holds no volume or task
// record.
func volWaitIdle(b *testing.B, a *e2e.Agent, timeout time.Duration) {
	b.Helper()
	if left := a.WaitVolJournalClear(timeout); len(left) > 0 {
		b.Fatalf("volumes still set up after %v: %v", timeout, left)
	}
}

// volStopAll stops the workloads still registered (through StopJob, which
// stops a job again when Nomad's scheduler left an allocation of it
// running), purges them, then checks nothing is left mounted under the
// staging and publish roots.
func volStopAll(b *testing.B, a *e2e.Agent, jobs []string) {
	for _, id := range jobs {
		path := "/v1/job/" + url.PathEscape(id)
		if err := a.GetJSON(path, &map[string]any{}); err != nil {
			if !strings.Contains(err.Error(), "404") {
				b.Errorf("failed to read job %s: %v", id, err)
			}
			continue // purged already
		}
		a.StopJob(b, id)
		if err := a.PutJSON("DELETE", path+"?purge=true", nil, nil); err != nil {
			b.Errorf("failed to purge job %s: %v", id, err)
		}
	}
	if left := a.WaitVolMountsGone(time.Minute); len(left) > 0 {
		b.Errorf("volume mounts left under %s: %v", a.DriverRoot, left)
	}
}

func since(t0 time.Time, ts []time.Time) []time.Duration {
	out := make([]time.Duration, len(ts))
	for i, t := range ts {
		out[i] = t.Sub(t0)
	}
	return out
}

func maxDur(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		m = max(m, d)
	}
	return m
}

func listMicros(ds []time.Duration) string {
	parts := make([]string, len(ds))
	for i, d := range ds {
		parts[i] = fmt.Sprintf("%.2f", float64(d.Microseconds())/1000)
	}
	return strings.Join(parts, ",") + " ms"
}
