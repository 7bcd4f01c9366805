//go:build e2e

package bench

// BenchmarkManyTasks packs one node: -many (500) volume tasks of the csi
// driver, one fresh volume each, submitted at once as one job on one
// agent, against as many raw_exec tasks (the same
// sleep, no volume) on the same agent in the same run, one driver after the
// other (-many-rounds 2 alternates the order: raw_exec, csi, csi, raw_exec).
// Both ask for cpu = 4 and memory = 16, so that a two-CPU node places them
// all (at cpu = 20 it places about 250). -many-plugin says whose volumes:
//
//   - fixture (the default): a dir volume of e2e/csiplugin, which bind
//     mounts it at the staging path and again at the target, and syncs
//     its records; its own teardown of 500 volumes at once takes several
//     times a raw_exec stop;
//   - mock: csi-test's mock driver behind csi-targetshim (e2e.StartVolMock),
//     which records the calls, makes the target directory and mounts
//     nothing: its calls cost about a round trip, and what a stop takes
//     beyond raw_exec's is the driver's own.
//
// For each driver it reports:
//
//   - submit -> all running: registration of the job to the last task's
//     StartedAt;
//   - stop -> all torn down: the job's deregistration to the last task's
//     FinishedAt, and for csi to the moment the driver's journal holds no
//     volume or task record and nothing is mounted under its staging and
//     publish roots (polled every 100 ms);
//   - the floor of both, in the same round: the same volumes staged and
//     published straight through the plugin's socket, all at once, then
//     unpublished and unstaged (the plugin's own work, which a stop of
//     raw_exec tasks does not have);
//   - with all running: the driver's RSS, of it the anonymous part (what
//     the Go runtime holds; the rest is its binary's pages), its
//     goroutines and its runtime memory by class (its debug stats file:
//     heap objects, free and released heap, stacks), the same once the
//     csi tasks stopped, the mounts under its root_dir, and the per-task processes'
//     summed RSS and PSS: the csi supervisors (the spare included) against
//     raw_exec's executors ("nomad executor"), and Nomad's logmon, which
//     every task of either driver has;
//   - what is left once all is stopped that was not there before the
//     first round: mounts, journal records, task cgroups, supervisors but
//     the spare and the plugin's, executors. Anything left fails the
//     benchmark.
//
// -many-plugin-cpu sets the plugin task's cpu (a granted plugin weighs at
// least plugin_cpu_shares; the report reads its weight from its cgroup);
// -many-parent-shares, on cgroup v1, the cpu.shares of the driver's
// cgroup_parent, which weighs against each thread of the root group.
//
// With -many-profiles DIR it keeps the driver's goroutine, CPU and heap
// profiles (its debug stats files) with all csi tasks running and after
// their stop, for go tool pprof.
//
// Its short form, -many 50, is part of make test (make bench-many-short).
//
//	go test -tags e2e -run '^$' -bench ManyTasks -benchtime 1x ./e2e/bench/ -args -many 500
//	go test -tags e2e -run '^$' -bench ManyTasks -benchtime 1x ./e2e/bench/ -args -many 500 -many-plugin mock
//
// Like the e2e tests it needs root and build/nomad; it builds the driver
// and build/csi first (E2E_SKIP_BUILD=1 uses what is there).

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/debugstats"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

var manyN = flag.Int("many", 500, "tasks of each driver BenchmarkManyTasks starts at once")

var manyRounds = flag.Int("many-rounds", 1, "rounds of BenchmarkManyTasks (each: both drivers, the order alternating)")

var manyPlugin = flag.String("many-plugin", "fixture", "the plugin of BenchmarkManyTasks' volumes: fixture (real bind mounts) or mock (csi-test's mock driver, no mounts)")

var manyPluginCPU = flag.Int("many-plugin-cpu", 100, "the cpu (MHz, and so the CPU weight) of BenchmarkManyTasks' plugin task")

var manyParentShares = flag.Int("many-parent-shares", 0, "cgroup v1 only, a diagnosis: the cpu.shares of the driver's cgroup_parent (default 1024, the weight of one thread of the root group), written once the plugin runs; 0 leaves it")

var manyProfiles = flag.String("many-profiles", "", "copy the driver's goroutine, CPU and heap profiles (debug stats) here, with all csi tasks running and after their stop")

// manyRun is one driver's round.
type manyRun struct {
	driver          string
	running, torn   time.Duration    // submit -> all running; stop -> all torn down
	floorUp         time.Duration    // the volumes staged and published straight through the plugin, all at once
	floorDown       time.Duration    // and unpublished and unstaged
	dead            time.Duration    // stop -> the last task dead
	tornLate        time.Duration    // stop -> torn down, read after the stop's events (the earlier figure)
	stopSteps       string           // when the tasks' stop events came (csi)
	stopCPU         manyCPU          // the CPU time the stop took, by process
	medianStart     time.Duration    // submit -> a task running, the median task
	procs           int              // supervisors (csi) or executors (raw_exec)
	procRSS, procPS int64            // their summed RSS and PSS, kB
	driverRSS       int64            // the csi driver's RSS, kB
	driverAnon      int64            // of which anonymous (the Go runtime's), kB
	driverThreads   int              // the csi driver's OS threads
	goroutines      int              // the csi driver's goroutines
	driverMem       manyMem          // the csi driver's runtime memory, from its debug stats
	afterRSS        int64            // the csi driver's RSS once its tasks stopped, kB
	afterAnon       int64            // of which anonymous, kB
	afterThreads    int              // and its threads
	afterStats      debugstats.Stats // its debug stats then
	mounts          int              // under the csi driver's root_dir
	logmons         int              // Nomad's logmon processes (one per task, either driver)
	logRSS, logPSS  int64            // their summed RSS and PSS, kB
}

func BenchmarkManyTasks(b *testing.B) {
	if *manyPlugin != "fixture" && *manyPlugin != "mock" {
		b.Fatalf("-many-plugin %q: want fixture or mock", *manyPlugin)
	}
	setup(b, e2e.VolBuildCSIBinaries)
	n := *manyN
	stats := manyStatsFile(b)
	env := []string{debugstats.Env + "=" + stats}
	if *manyProfiles != "" {
		// Only then: the CPU profile costs the driver about 1 MiB.
		env = append(env, debugstats.ProfilesEnv+"=1")
	}
	var a *e2e.Agent
	b.Cleanup(func() {
		if a != nil {
			_ = e2e.VolDetachLoops(a.Dir)
		}
	})
	a = startIsolationAgent(b, e2e.AgentOptions{
		Drivers: []string{"csi", "raw_exec"},
		// Terminal allocations are collected only past this many: the
		// default (50) would have the client collecting while it starts.
		ClientConfig: fmt.Sprintf("gc_max_allocs = %d", 4*n+100),
		Env:          env,
	})
	// A plugin serving hundreds of volumes at once gets the memory for it
	// (the e2e jobs' 128 MB, enough for a few dozen, had the fixture
	// killed).
	var fx *e2e.VolFixture
	if *manyPlugin == "mock" {
		fx = a.StartVolMock(b, "mock", e2e.VolFixtureOptions{MemoryMB: 1024, CPU: *manyPluginCPU})
	} else {
		fx = a.StartVolFixture(b, "fixture", e2e.VolFixtureOptions{MemoryMB: 1024, CPU: *manyPluginCPU})
	}
	if *manyParentShares > 0 {
		// The plugin task runs under it, so it exists by now; the agent's
		// cgroup_parent is its own and goes with it.
		f := filepath.Join("/sys/fs/cgroup/cpu", a.DriverCgroupParent(), "cpu.shares")
		if err := os.WriteFile(f, []byte(strconv.Itoa(*manyParentShares)), 0o644); err != nil {
			b.Fatalf("-many-parent-shares: %v", err)
		}
	}
	var jobs []string
	b.Cleanup(func() { volStopAll(b, a, jobs) })
	time.Sleep(2 * time.Second)
	idleRSS := pluginRSS(b, a)
	idleAnon, idleThreads := driverAnonRSS(a), driverThreads(a)
	idleStats := manyStats(b, a, stats)
	plugins := pluginSupervisors(a)
	before := map[string]bool{}
	for _, l := range manyLeft(a, plugins) {
		before[l] = true
	}

	var rounds [][2]manyRun
	for i := 0; i < *manyRounds; i++ {
		order := []string{"raw_exec", "csi"}
		if i%2 == 1 {
			order = []string{"csi", "raw_exec"}
		}
		var round [2]manyRun
		for _, d := range order {
			r := manyRound(b, a, fx, &jobs, stats, plugins, d, n, i)
			if d == "csi" {
				round[0] = r
			} else {
				round[1] = r
			}
		}
		rounds = append(rounds, round)
	}
	var left []string
	for _, l := range manyLeft(a, plugins) {
		if !before[l] {
			left = append(left, l)
		}
	}

	ratio := func(x, y time.Duration) string { return fmt.Sprintf("%.2fx", float64(x)/float64(y)) }
	mib := func(kB int64) float64 { return float64(kB) / 1024 }
	var sb strings.Builder
	row := func(k, format string, args ...any) { fmt.Fprintf(&sb, "%-60s %s\n", k, fmt.Sprintf(format, args...)) }
	fmt.Fprintf(&sb, "\n%-60s %s\n%s %s\n", "metric", "value", strings.Repeat("-", 60), strings.Repeat("-", 30))
	row("the csi tasks' plugin (-many-plugin)", "%s", *manyPlugin)
	var csiRun, rawRun, csiTorn, rawTorn []time.Duration
	for i, r := range rounds {
		c, x := r[0], r[1]
		csiRun, rawRun = append(csiRun, c.running), append(rawRun, x.running)
		csiTorn, rawTorn = append(csiTorn, c.torn), append(rawTorn, x.torn)
		p := fmt.Sprintf("round %d: ", i+1)
		row(p+fmt.Sprintf("%d csi volume tasks: submit->all running", n), "%v (median task %v)", c.running.Round(time.Millisecond), c.medianStart.Round(time.Millisecond))
		row(p+fmt.Sprintf("%d raw_exec tasks: submit->all running", n), "%v (median task %v)", x.running.Round(time.Millisecond), x.medianStart.Round(time.Millisecond))
		row(p+"ratio csi / raw_exec, submit->all running", "%s (target <= 1.1x)", ratio(c.running, x.running))
		row(p+"csi: stop->all volumes torn down", "%v (the last task dead after %v)", c.torn.Round(time.Millisecond), c.dead.Round(time.Millisecond))
		row(p+"csi: the same, read after the stop's events (as until now)", "%v", c.tornLate.Round(time.Millisecond))
		row(p+"csi: stop->task events, median / last", "%s", c.stopSteps)
		row(p+"raw_exec: stop->all tasks dead", "%v", x.torn.Round(time.Millisecond))
		row(p+"CPU of the stop, csi: "+manyCPUColumns, "%s", c.stopCPU)
		row(p+"CPU of the stop, raw_exec: "+manyCPUColumns, "%s", x.stopCPU)
		row(p+"ratio csi / raw_exec, stop->all torn down", "%s (target <= 1.1x)", ratio(c.torn, x.torn))
		row(p+fmt.Sprintf("floor: the %d volumes straight through the plugin, all at once", n), "NodeStage+NodePublish %v, NodeUnpublish+NodeUnstage %v",
			c.floorUp.Round(time.Millisecond), c.floorDown.Round(time.Millisecond))
		row(p+"ratio csi stop / (raw_exec stop + teardown floor)", "%s", ratio(c.torn, x.torn+c.floorDown))
		row(p+fmt.Sprintf("driver RSS / goroutines, %d csi tasks", n), "%.1f MiB (target <= %.1f MiB) / %d", mib(c.driverRSS), 40+0.1*float64(n), c.goroutines)
		row(p+fmt.Sprintf("driver RSS / goroutines, %d raw_exec tasks", n), "%.1f MiB / %d", mib(x.driverRSS), x.goroutines)
		row(p+fmt.Sprintf("driver RSS anonymous, %d csi / %d raw_exec tasks", n, n), "%.1f / %.1f MiB", mib(c.driverAnon), mib(x.driverAnon))
		row(p+fmt.Sprintf("driver threads, %d csi / %d raw_exec tasks", n, n), "%d / %d", c.driverThreads, x.driverThreads)
		row(p+fmt.Sprintf("driver Go memory, %d csi tasks: %s", n, manyMemColumns), "%s", c.driverMem)
		row(p+fmt.Sprintf("driver Go memory, %d raw_exec tasks", n), "%s", x.driverMem)
		row(p+"driver after the csi stop: RSS, anonymous / goroutines / threads", "%.1f, %.1f MiB / %d / %d", mib(c.afterRSS), mib(c.afterAnon), c.afterStats.Goroutines, c.afterThreads)
		row(p+"driver Go memory after the csi stop", "%s", manyMem(c.afterStats.Memory))
		row(p+"csi supervisors (the spare too): count, RSS, PSS", "%d, %.1f MiB, %.1f MiB", c.procs, mib(c.procRSS), mib(c.procPS))
		row(p+"raw_exec executors: count, RSS, PSS", "%d, %.1f MiB, %.1f MiB", x.procs, mib(x.procRSS), mib(x.procPS))
		row(p+"per task: supervisor PSS / executor PSS", "%.2f MiB (target <= 1.5 MiB) / %.2f MiB", perTask(c.procPS, c.procs), perTask(x.procPS, x.procs))
		row(p+"per task: supervisor RSS / executor RSS", "%.2f MiB / %.2f MiB", perTask(c.procRSS, c.procs), perTask(x.procRSS, x.procs))
		row(p+"logmons (csi / raw_exec): count, PSS per task", "%d, %.2f MiB / %d, %.2f MiB", c.logmons, perTask(c.logPSS, c.logmons), x.logmons, perTask(x.logPSS, x.logmons))
		row(p+fmt.Sprintf("mounts under root_dir, %d csi tasks", n), "%d", c.mounts)
	}
	row("driver RSS / goroutines, idle", "%.1f MiB / %d", mib(idleRSS), idleStats.Goroutines)
	row("driver RSS anonymous / threads / Go memory, idle", "%.1f MiB / %d / %s", mib(idleAnon), idleThreads, manyMem(idleStats.Memory))
	row("the plugin task's CPU weight, from its cgroup (-many-plugin-cpu, plugin_cpu_shares)", "%s", pluginCPUWeight(fx))
	if *manyParentShares > 0 {
		row("the driver's cgroup_parent's cpu.shares (-many-parent-shares)", "%d", *manyParentShares)
	}
	restarts := pluginRestarts(b, a, fx)
	row("plugin task restarts (figures with a restart are not comparable)", "%d", restarts)
	row("left after the last stop", "%d (%s)", len(left), strings.Join(left, "; "))
	fmt.Print(sb.String())
	if len(left) > 0 {
		b.Fatalf("left after every task stopped: %v", left)
	}

	last := rounds[len(rounds)-1]
	b.ReportMetric(float64(median(csiRun).Milliseconds()), "many-csi-ms")
	b.ReportMetric(float64(median(rawRun).Milliseconds()), "many-raw-ms")
	b.ReportMetric(float64(median(csiTorn).Milliseconds()), "many-csi-stop-ms")
	b.ReportMetric(float64(median(rawTorn).Milliseconds()), "many-raw-stop-ms")
	b.ReportMetric(float64((last[1].torn + last[0].floorDown).Milliseconds()), "many-stop-floor-ms")
	b.ReportMetric(mib(last[0].driverRSS), "many-driver-MiB")
	b.ReportMetric(mib(idleRSS), "idle-driver-MiB")
	b.ReportMetric(float64(last[0].goroutines), "many-goroutines")
	b.ReportMetric(perTask(last[0].procPS, last[0].procs), "supervisor-pss-MiB")
	b.ReportMetric(perTask(last[1].procPS, last[1].procs), "executor-pss-MiB")
	b.ReportMetric(float64(len(left)), "left")
}

func perTask(kB int64, n int) float64 {
	if n == 0 {
		return 0
	}
	return float64(kB) / 1024 / float64(n)
}

// manyRound runs n tasks of driver at once, samples them, and stops them.
func manyRound(b *testing.B, a *e2e.Agent, fx *e2e.VolFixture, jobs *[]string, stats string, plugins map[int]bool, driver string, n, round int) manyRun {
	b.Helper()
	r := manyRun{driver: driver}
	small := func(task map[string]any) {
		res, _ := task["Resources"].(map[string]any)
		if res == nil {
			res = map[string]any{}
			task["Resources"] = res
		}
		res["CPU"], res["MemoryMB"] = 4, 16
	}
	t0 := time.Now()
	var job string
	if driver == "csi" {
		vol := e2e.VolSpec{Name: "data", Plugin: fx.ID, ID: fmt.Sprintf("many-%d-${NOMAD_ALLOC_INDEX}", round), Interpolate: true,
			Dest: filepath.Join(a.Dir, "dst", "many"), Access: "single-node-writer", Create: true}
		if fx.StateDir != "" {
			vol.CreateType = "dir" // the fixture's
		}
		job = volSubmit(b, a, jobs, e2e.VolJob{Type: "service", Count: n, Script: "exec sleep 3600", Volumes: []e2e.VolSpec{vol}}, small)
	} else {
		rendered, err := a.RenderJob("sleep", map[string]string{"Driver": driver, "Count": strconv.Itoa(n)})
		if err != nil {
			b.Fatal(err)
		}
		*jobs = append(*jobs, rendered.ID)
		register(b, a, rendered, small)
		job = rendered.ID
	}
	started := manyWait(b, a, job, n, 15*time.Minute, func(ts *e2e.TaskState) (time.Time, bool) {
		return ts.StartedAt, ts.State == "running" && !ts.StartedAt.IsZero()
	})
	times := since(t0, started)
	r.running, r.medianStart = maxDur(times), median(times)

	time.Sleep(2 * time.Second)
	r.driverRSS = pluginRSS(b, a)
	r.driverAnon, r.driverThreads = driverAnonRSS(a), driverThreads(a)
	st := manyStats(b, a, stats)
	r.goroutines, r.driverMem = st.Goroutines, st.Memory
	if driver == "csi" {
		r.procs, r.procRSS, r.procPS = procsRSS(isSupervisor(a, plugins))
	} else {
		r.procs, r.procRSS, r.procPS = procsRSS(isNomadHelper(a, "executor"))
	}
	r.logmons, r.logRSS, r.logPSS = procsRSS(isNomadHelper(a, "logmon"))
	if m, err := e2e.MountsUnder(a.DriverRoot); err == nil {
		r.mounts = len(m)
	}
	if driver == "csi" {
		manyKeepProfiles(b, stats, fmt.Sprintf("round%d-running", round+1))
	}

	cpu0 := manyCPUOf(a, fx)
	t1 := time.Now()
	var torn <-chan manyTeardown
	if driver == "csi" {
		torn = manyWatchTeardown(a, 15*time.Minute)
	}
	if err := a.PutJSON("DELETE", "/v1/job/"+url.PathEscape(job), nil, nil); err != nil {
		b.Fatalf("failed to stop %s: %v", job, err)
	}
	finished := manyWait(b, a, job, n, 15*time.Minute, func(ts *e2e.TaskState) (time.Time, bool) {
		return ts.FinishedAt, ts.State == "dead" && !ts.FinishedAt.IsZero()
	})
	r.dead = maxDur(since(t1, finished))
	r.torn = r.dead
	if driver == "csi" {
		td := <-torn
		if len(td.left) > 0 {
			b.Fatalf("volumes still set up 15 minutes after the stop: %v", td.left)
		}
		r.torn = max(r.torn, td.at.Sub(t1))
	}
	r.stopCPU = manyCPUOf(a, fx).sub(cpu0)
	if driver == "csi" {
		read := time.Now()
		r.stopSteps = manyStopSteps(b, a, job, t1)
		r.stopSteps += fmt.Sprintf(" (read in %v after the teardown)", time.Since(read).Round(time.Millisecond))
		// What the benchmark reported until the teardown was watched
		// beside the stop: the first poll after reading the events.
		for len(a.VolJournalLeft()) > 0 || len(a.VolMounts()) > 0 {
			time.Sleep(100 * time.Millisecond)
		}
		r.tornLate = time.Since(t1)
		r.floorUp, r.floorDown = manyFloor(b, a, fx, round, n)
		time.Sleep(2 * time.Second)
		r.afterRSS, r.afterAnon, r.afterThreads = pluginRSS(b, a), driverAnonRSS(a), driverThreads(a)
		r.afterStats = manyStats(b, a, stats)
		manyKeepProfiles(b, stats, fmt.Sprintf("round%d-stopped", round+1))
	}
	if err := a.PutJSON("DELETE", "/v1/job/"+url.PathEscape(job)+"?purge=true", nil, nil); err != nil {
		b.Fatalf("failed to purge %s: %v", job, err)
	}
	// The next round starts from a quiet node.
	time.Sleep(5 * time.Second)
	return r
}

// manyTeardown is what manyWatchTeardown saw: when nothing was set up any
// more, or what was still after its timeout.
type manyTeardown struct {
	at   time.Time
	left []string
}

// manyWatchTeardown polls, every 100 ms from now on, the driver's journal
// and the mounts under its staging and publish roots until neither holds
// anything, and sends the end of the poll that saw them so (the teardown
// ended before it, within a poll and its interval); or, after timeout,
// what is left. It runs beside the stop: what the benchmark reads of the
// stop meanwhile (the tasks' states, then their events, one request per
// allocation) must not count as teardown.
func manyWatchTeardown(a *e2e.Agent, timeout time.Duration) <-chan manyTeardown {
	out := make(chan manyTeardown, 1)
	go func() {
		deadline := time.Now().Add(timeout)
		for {
			// The mounts only once the journal is clear (the driver
			// drops a record only after its unmount): reading the mount
			// table every 100 ms took a tenth of the two CPUs of the stop
			// of 200 tasks.
			left := a.VolJournalLeft()
			if len(left) == 0 {
				left = a.VolMounts()
			}
			if len(left) == 0 {
				out <- manyTeardown{at: time.Now()}
				return
			}
			if time.Now().After(deadline) {
				out <- manyTeardown{left: left}
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	return out
}

// manyCPU is CPU time (user + system, in ns) of the processes a stop
// keeps busy: the agent itself, the rest of its tree but the driver's
// (raw_exec's executors and their tasks, every task's logmon), the driver
// itself, the rest of its tree but the plugin task's processes (the
// supervisors, with the tasks and namespaces they take down), and the
// plugin task's processes. A live process counts with what its threads
// used (its CPU-time clock, in ns) and with its reaped children's time;
// a process reaped between two samples counts through its parent's
// reaped children's time, whole: the difference of two samples is what
// the processes used between them.
//
// Per-process clock ticks (/proc/PID/stat) are no base for that: each is
// rounded down to 10 ms, and a supervisor has used about 3 ms when the
// stop begins, so 500 of them read 0 before the stop and their whole
// lives after it (5 s of the start's CPU counted as the stop's).
type manyCPU struct {
	agent, agentChildren, driver, driverChildren, plugin int64
	// pluginWait is how long the plugin's threads waited for a CPU while
	// runnable (/proc/PID/task/TID/schedstat), in ns.
	pluginWait int64
}

const manyCPUColumns = "agent / its children / driver / its children / plugin (waiting for a CPU)"

func (c manyCPU) sub(d manyCPU) manyCPU {
	return manyCPU{c.agent - d.agent, c.agentChildren - d.agentChildren, c.driver - d.driver, c.driverChildren - d.driverChildren,
		c.plugin - d.plugin, c.pluginWait - d.pluginWait}
}

func (c manyCPU) String() string {
	s := func(ns int64) string { return fmt.Sprintf("%.2fs", time.Duration(ns).Seconds()) }
	return fmt.Sprintf("%s / %s / %s / %s / %s (%.2fs)", s(c.agent), s(c.agentChildren), s(c.driver), s(c.driverChildren), s(c.plugin),
		time.Duration(c.pluginWait).Seconds())
}

func manyCPUOf(a *e2e.Agent, fx *e2e.VolFixture) manyCPU {
	agent, driver := a.PID(), a.DriverPluginPID()
	children := map[int][]int{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if p, err := e2e.ReadProc(pid); err == nil {
			children[p.PPID] = append(children[p.PPID], pid)
		}
	}
	plugin := map[int]bool{}
	for _, pid := range e2e.TaskPIDs(fx.AllocID, "plugin") {
		plugin[pid] = true
	}
	// tree sums the CPU of root's descendants but those in skip and
	// below them.
	tree := func(root int, skip func(int) bool) int64 {
		var sum int64
		todo := slices.Clone(children[root])
		for len(todo) > 0 {
			pid := todo[len(todo)-1]
			todo = todo[:len(todo)-1]
			if skip(pid) {
				continue
			}
			self, reaped := procCPU(pid)
			sum += self + reaped
			todo = append(todo, children[pid]...)
		}
		return sum
	}
	var c manyCPU
	var reaped int64
	c.agent, reaped = procCPU(agent)
	c.agentChildren = reaped + tree(agent, func(pid int) bool { return pid == driver })
	c.driver, reaped = procCPU(driver)
	c.driverChildren = reaped + tree(driver, func(pid int) bool { return plugin[pid] })
	for pid := range plugin {
		self, reaped := procCPU(pid)
		c.plugin += self + reaped
		c.pluginWait += procWait(pid)
	}
	return c
}

// procCPU reads a process's own CPU time, all its threads' (those that
// ended too), in ns from its CPU-time clock (clock_gettime of the clock
// clock_getcpuclockid(3) gives, the clock id made as the kernel does), and
// its reaped children's (clock ticks, as ns); 0 when it cannot be read.
func procCPU(pid int) (self, reaped int64) {
	f := procStat(pid)
	if len(f) < 15 {
		return 0, 0
	}
	n := func(k int) int64 { v, _ := strconv.ParseInt(f[k-3], 10, 64); return v }
	// USER_HZ is 100 on Linux: a tick is 10 ms.
	const tick = int64(10 * time.Millisecond)
	self = (n(14) + n(15)) * tick
	var ts unix.Timespec
	if err := unix.ClockGettime(int32(^pid<<3|2), &ts); err == nil {
		self = ts.Nano()
	}
	return self, (n(16) + n(17)) * tick
}

// procWait is how long a process's threads waited for a CPU while
// runnable, in ns: field 1 of /proc/PID/task/*/schedstat, summed.
func procWait(pid int) int64 {
	const k = 1
	threads, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	var sum int64
	for _, th := range threads {
		if b, err := os.ReadFile(th); err == nil {
			if f := strings.Fields(string(b)); len(f) > k {
				v, _ := strconv.ParseInt(f[k], 10, 64)
				sum += v
			}
		}
	}
	return sum
}

// procStat is /proc/PID/stat from field 3 (state) on (nil when it cannot
// be read).
func procStat(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	f, _ := wire.StatFields(string(b))
	return f
}

// pluginCPUWeight reads the plugin task's CPU weight from its cgroup:
// "cpu.shares N" on cgroup v1, "cpu.weight N" on v2, or why it could not.
func pluginCPUWeight(fx *e2e.VolFixture) string {
	file, w, err := e2e.TaskCPUWeight(fx.AllocID, "plugin")
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("%s %d", filepath.Base(file), w)
}

// pluginRestarts is how often the plugin's task was restarted.
func pluginRestarts(b *testing.B, a *e2e.Agent, fx *e2e.VolFixture) uint64 {
	b.Helper()
	al := a.Allocation(b, fx.AllocID)
	if ts := al.Task("plugin"); ts != nil {
		return ts.Restarts
	}
	return 0
}

// manyFloor stages and publishes the round's n volumes straight through
// the plugin's socket, all at once, and then unpublishes and unstages them
// all at once: what the plugin itself takes for the volumes of n tasks
// starting or stopping together, timed each way.
func manyFloor(b *testing.B, a *e2e.Agent, fx *e2e.VolFixture, round, n int) (up, down time.Duration) {
	b.Helper()
	client, err := csihook.DialUnix(filepath.Join(a.DriverRoot, "plugins", fx.ID, "csi.sock"))
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	vc := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	ids := map[string]string{}
	if fx.StateDir != "" {
		ids = fixtureVolumeIDs(b, fx)
	} else {
		// The mock keeps its volumes in memory: CreateVolume with the
		// name the task's create block gave answers the volume the
		// driver created.
		for i := range n {
			name := fmt.Sprintf("many-%d-%d", round, i)
			resp, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{vc}})
			if err != nil {
				b.Fatalf("CreateVolume %s: %v", name, err)
			}
			ids[name] = resp.GetVolume().GetVolumeId()
		}
	}
	type vol struct{ id, staging, target string }
	vols := make([]vol, n)
	for i := range vols {
		id := ids[fmt.Sprintf("many-%d-%d", round, i)]
		if id == "" {
			b.Fatalf("plugin %s has no volume many-%d-%d", fx.ID, round, i)
		}
		base := filepath.Join(a.DriverRoot, "mnt", "bench-floor-many", strconv.Itoa(i))
		vols[i] = vol{id, filepath.Join(base, "staging"), filepath.Join(base, "publish", "data")}
		if err := os.MkdirAll(filepath.Dir(vols[i].target), 0o700); err != nil {
			b.Fatal(err)
		}
	}
	// A failed call spoils the floor, not the round's figures: it is
	// reported as 0 and logged.
	failed := false
	all := func(call func(v vol) error) time.Duration {
		errs := make(chan error, n)
		t0 := time.Now()
		for _, v := range vols {
			go func() { errs <- call(v) }()
		}
		for range vols {
			if err := <-errs; err != nil && !failed {
				failed = true
				b.Logf("the floor failed: %v", err)
			}
		}
		return time.Since(t0)
	}
	up = all(func(v vol) error {
		if _, err := client.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: vc}); err != nil {
			return fmt.Errorf("NodeStageVolume %s: %w", v.id, err)
		}
		_, err := client.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: vc})
		if err != nil {
			return fmt.Errorf("NodePublishVolume %s: %w", v.id, err)
		}
		return nil
	})
	down = all(func(v vol) error {
		if _, err := client.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
			return fmt.Errorf("NodeUnpublishVolume %s: %w", v.id, err)
		}
		_, err := client.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
		if err != nil {
			return fmt.Errorf("NodeUnstageVolume %s: %w", v.id, err)
		}
		return nil
	})
	if failed {
		return 0, 0
	}
	return up, down
}

// fixtureVolumeIDs maps the names of the fixture's volumes to their ids,
// from its state directory (fx.VolumeID reads every record per name).
func fixtureVolumeIDs(b *testing.B, fx *e2e.VolFixture) map[string]string {
	b.Helper()
	files, err := filepath.Glob(filepath.Join(fx.StateDir, "meta", "*.json"))
	if err != nil {
		b.Fatal(err)
	}
	out := map[string]string{}
	for _, f := range files {
		var v struct {
			ID   string `json:"id"`
			Name string `json:"name"`
		}
		if data, err := os.ReadFile(f); err == nil && json.Unmarshal(data, &v) == nil {
			out[v.Name] = v.ID
		}
	}
	return out
}

// manyStopSteps says when, after t1, the job's tasks got the events of
// their stop: Nomad's "Killing" (it asks the driver to stop the task) and
// "Terminated" (the driver said the task exited), Nomad's "Killed", and
// the driver's "Unpublished" (its volume's teardown is done, as Nomad
// recorded it); the median task's and the last one's.
func manyStopSteps(b *testing.B, a *e2e.Agent, jobID string, t1 time.Time) string {
	b.Helper()
	allocs, err := a.JobAllocations(jobID)
	if err != nil {
		b.Fatal(err)
	}
	steps := []struct{ name, typ, prefix string }{
		{"Killing", "Killing", ""}, {"Terminated", "Terminated", ""},
		{"Killed", "Killed", ""}, {"Unpublished", "Driver", "Unpublished"},
	}
	at := make([][]time.Duration, len(steps))
	for _, stub := range allocs {
		al := a.Allocation(b, stub.ID)
		for i, st := range steps {
			for _, e := range al.Events("t") {
				if e.Type == st.typ && strings.HasPrefix(e.DisplayMessage, st.prefix) {
					at[i] = append(at[i], time.Unix(0, e.Time).Sub(t1))
					break
				}
			}
		}
	}
	var parts []string
	for i, st := range steps {
		parts = append(parts, fmt.Sprintf("%s %v / %v", st.name, median(at[i]).Round(time.Millisecond), maxDur(at[i]).Round(time.Millisecond)))
	}
	return strings.Join(parts, ", ")
}

// manyWait polls the job's allocations (every 250 ms: each poll lists
// them all) until n of them have their task in the state done says, and
// returns the times done reads from them.
func manyWait(b *testing.B, a *e2e.Agent, jobID string, n int, timeout time.Duration, done func(*e2e.TaskState) (time.Time, bool)) []time.Time {
	b.Helper()
	deadline := time.Now().Add(timeout)
	var last []e2e.AllocStub
	for time.Now().Before(deadline) {
		allocs, err := a.JobAllocations(jobID)
		if err == nil {
			last = allocs
			var ts []time.Time
			for _, al := range allocs {
				if st := al.TaskStates["t"]; st != nil {
					if t, ok := done(st); ok {
						ts = append(ts, t)
					}
				}
			}
			if len(ts) >= n {
				return ts
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
	states := map[string]int{}
	for _, al := range last {
		states[al.ClientStatus]++
	}
	b.Fatalf("job %s: fewer than %d tasks there after %v (%d allocations by client status: %v)", jobID, n, timeout, len(last), states)
	return nil
}

// manyStatsFile is where the driver writes its debug stats: in a
// directory of the benchmark's own, made before the agent starts, so that
// it is removed after the agent's Close (see e2e.OwnedTempDir), passed or
// failed, together with any process that still writes there.
func manyStatsFile(tb testing.TB) string {
	tb.Helper()
	return filepath.Join(e2e.OwnedTempDir(tb, "ncsb-"), "stats.json")
}

// manyStats reads the driver's debug stats file, waiting for one written
// after the call.
func manyStats(b *testing.B, a *e2e.Agent, path string) debugstats.Stats {
	b.Helper()
	began := time.Now()
	pid := a.DriverPluginPID()
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if st, err := debugstats.Read(path); err == nil && st.PID == pid && st.Time.After(began) {
			return st
		}
	}
	b.Fatalf("the driver (pid %d) wrote no debug stats to %s", pid, path)
	return debugstats.Stats{}
}

// driverAnonRSS is the driver's anonymous RSS (RssAnon, kB): its RSS
// without the pages of its binary and other files, which the kernel may
// share and drop.
func driverAnonRSS(a *e2e.Agent) int64 {
	v, err := e2e.StatusField(a.DriverPluginPID(), "RssAnon")
	if err != nil {
		return -1
	}
	return parseKB(v)
}

// driverThreads is the driver's OS thread count (-1 when unread). The Go
// runtime keeps every thread it made, each with 48 KiB of stacks of its own
// (the signal and the scheduler's), for the process's life.
func driverThreads(a *e2e.Agent) int {
	v, err := e2e.StatusField(a.DriverPluginPID(), "Threads")
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return -1
	}
	return n
}

// manyMem is the driver's runtime memory by class (debugstats.Stats.Memory).
type manyMem map[string]uint64

const manyMemColumns = "heap objects / unused / free / released / stacks / other runtime / total (GC goal; a new goroutine's stack)"

func (m manyMem) String() string {
	if len(m) == 0 {
		return "(not in this build's debug stats)"
	}
	mb := func(v uint64) string { return fmt.Sprintf("%.1f", float64(v)/(1<<20)) }
	var other uint64
	for k, v := range m {
		if !strings.HasPrefix(k, "heap/") && k != "total" && k != "gc-heap-goal" && k != "stack-start" {
			other += v
		}
	}
	return fmt.Sprintf("%s / %s / %s / %s / %s / %s / %s MiB (%s MiB; %d KiB)", mb(m["heap/objects"]), mb(m["heap/unused"]), mb(m["heap/free"]),
		mb(m["heap/released"]), mb(m["heap/stacks"]), mb(other), mb(m["total"]), mb(m["gc-heap-goal"]), m["stack-start"]/1024)
}

// isSupervisor says whether pid is one of the driver's supervisors but
// those in skip (the plugin task's): a child of the driver, run from its
// shim under root_dir/bin (or, for a driver without one, from the driver's
// binary).
func isSupervisor(a *e2e.Agent, skip map[int]bool) func(pid int, exe, cmdline string) bool {
	plugin := a.DriverPluginPID()
	bins := []string{filepath.Join(a.DriverRoot, "bin") + "/", filepath.Join(e2e.PluginDir(a.Root), "nomad-driver-csi")}
	return func(pid int, exe, cmdline string) bool {
		if pid == plugin || skip[pid] || !hasParent(pid, plugin) {
			return false
		}
		for _, b := range bins {
			if strings.HasPrefix(exe, b) {
				return true
			}
		}
		return false
	}
}

// pluginSupervisors are the supervisors running when no workload does but
// the spare: those of the plugin tasks.
func pluginSupervisors(a *e2e.Agent) map[int]bool {
	out := map[int]bool{}
	match := isSupervisor(a, nil)
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
		cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if match(pid, strings.TrimSuffix(exe, " (deleted)"), string(cmdline)) && !strings.Contains(string(cmdline), "\x00--spare-root\x00") {
			out[pid] = true
		}
	}
	return out
}

// isNomadHelper says whether pid is one of this agent's per-task Nomad
// processes of the kind ("executor": raw_exec's, "logmon": every task's).
func isNomadHelper(a *e2e.Agent, kind string) func(pid int, exe, cmdline string) bool {
	return func(pid int, exe, cmdline string) bool {
		args := strings.Split(cmdline, "\x00")
		return filepath.Base(exe) == "nomad" && len(args) > 1 && args[1] == kind && a.Owns(pid)
	}
}

// manyKeepProfiles copies the driver's debug stats profiles to
// -many-profiles, named after when.
func manyKeepProfiles(b *testing.B, stats, when string) {
	b.Helper()
	if *manyProfiles == "" {
		return
	}
	if err := os.MkdirAll(*manyProfiles, 0o755); err != nil {
		b.Fatal(err)
	}
	// A window that ends after now: the profiles cover the state sampled.
	time.Sleep(debugstats.ProfileWindow)
	for _, ext := range []string{".goroutines", ".cpu.pprof", ".heap.pprof"} {
		data, err := os.ReadFile(stats + ext)
		if err == nil {
			err = os.WriteFile(filepath.Join(*manyProfiles, when+ext), data, 0o644)
		}
		if err != nil {
			b.Logf("failed to keep %s: %v", stats+ext, err)
		}
	}
}

// procsRSS sums VmRSS and PSS, in kB, of the processes that match.
func procsRSS(match func(pid int, exe, cmdline string) bool) (int, int64, int64) {
	count, rss, pss := 0, int64(0), int64(0)
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
		if err != nil {
			continue
		}
		cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if !match(pid, strings.TrimSuffix(exe, " (deleted)"), string(cmdline)) {
			continue
		}
		v, err := e2e.StatusField(pid, "VmRSS")
		if err != nil {
			continue
		}
		count++
		rss += parseKB(v)
		pss += pssKB(pid)
	}
	return count, rss, pss
}

// manyLeft lists what the tasks left: mounts under the driver's root_dir
// (the plugin's socket directory aside), journal records, task cgroups
// under the driver's cgroup parent (but the waiting spare's, made ahead
// for its next task and empty), supervisors but the spare and the
// plugins', executors.
func manyLeft(a *e2e.Agent, plugins map[int]bool) []string {
	var left []string
	if m, err := e2e.MountsUnder(a.DriverRoot); err != nil {
		left = append(left, err.Error())
	} else {
		left = append(left, m...)
	}
	left = append(left, a.VolJournalLeft()...)
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/" + a.DriverCgroupParent())
	roots = append(roots, filepath.Join("/sys/fs/cgroup", a.DriverCgroupParent()))
	spareGroups := map[string]bool{}
	for _, root := range roots {
		entries, _ := os.ReadDir(root)
		for _, e := range entries {
			if !e.IsDir() {
				continue
			}
			dir := filepath.Join(root, e.Name())
			if strings.HasPrefix(e.Name(), wire.SpareGroupPrefix) {
				if procs, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil && len(strings.TrimSpace(string(procs))) == 0 {
					spareGroups[e.Name()] = true
					continue
				}
			}
			left = append(left, dir)
		}
	}
	if len(spareGroups) > 1 {
		left = append(left, fmt.Sprintf("%d groups made ahead by spares (one is the spare's): %v", len(spareGroups), slices.Sorted(maps.Keys(spareGroups))))
	}
	if n, _, _ := procsRSS(isSupervisor(a, plugins)); n > 1 {
		left = append(left, fmt.Sprintf("%d supervisors (one is the spare)", n))
	}
	if n, _, _ := procsRSS(isNomadHelper(a, "executor")); n > 0 {
		left = append(left, fmt.Sprintf("%d executors", n))
	}
	return left
}
