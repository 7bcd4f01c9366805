//go:build e2e

// Package bench measures nomad-driver-csi against Nomad's own exec and
// raw_exec drivers on one real agent, and prints one table:
//
//   - submit -> running for a trivial service job (one /bin/sleep task),
//     median of -runs runs per driver (after one unmeasured warm-up each),
//     with the ratios csi/exec and csi/raw_exec: "submit" is the moment
//     the job is registered over the HTTP API, "running" is the task's
//     StartedAt as recorded by the client (same host, same clock);
//   - with csi, the same for the csi task as root, isolated (csi-root) and
//     privileged (csi-privileged), interleaved with the others, and their
//     ratio: what isolation costs (see isolation_test.go);
//   - the RSS (VmRSS) of the nomad-driver-csi plugin process, a child of
//     the agent, when idle and with 20 csi tasks running, and the summed
//     RSS and PSS of the driver's per-task supervisor processes at 20 tasks.
//
// It is a benchmark so that plain "go test" never runs it. It runs once,
// whatever b.N, and takes about a minute with the default 5 runs:
//
//	go test -tags e2e -run '^$' -bench . -benchtime 1x ./e2e/bench/ -args -runs 5
//
// Like the e2e tests it needs root and build/nomad, and builds the driver
// into build/plugins first (set E2E_SKIP_BUILD=1 to use the one there).
package bench

import (
	"flag"
	"fmt"
	"math"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

var runs = flag.Int("runs", 5, "measured submit->running runs per driver")

var driverList = flag.String("drivers", "csi,exec,raw_exec", "drivers to compare (without csi, only the harness is exercised)")

func BenchmarkDriverOverhead(b *testing.B) {
	setup(b)
	drivers := strings.Split(*driverList, ",")
	withCSI := false
	for _, d := range drivers {
		withCSI = withCSI || d == "csi"
	}
	a := startIsolationAgent(b, e2e.AgentOptions{Drivers: drivers})
	if withCSI {
		// Variants of the csi task, run as the drivers are.
		drivers = append(drivers, variantIsolated, variantPrivileged)
	}

	// Warm-up: one unmeasured run per driver (first exec run, page cache).
	for _, d := range drivers {
		startOne(b, a, d)
	}
	time.Sleep(2 * time.Second)
	idleRSS := int64(-1)
	if withCSI {
		idleRSS = pluginRSS(b, a)
	}

	samples := map[string][]time.Duration{}
	for i := 0; i < *runs; i++ {
		for _, d := range drivers {
			samples[d] = append(samples[d], startOne(b, a, d))
		}
	}
	med := map[string]time.Duration{}
	for _, d := range drivers {
		med[d] = median(samples[d])
		b.ReportMetric(float64(med[d].Microseconds())/1000, d+"-ms")
	}

	// 20 csi tasks at once.
	busyRSS, supCount, supRSS, supPSS, manyElapsed := int64(-1), 0, int64(-1), int64(-1), time.Duration(0)
	if withCSI {
		manyStart := time.Now()
		job := submit(b, a, "csi", 20)
		waitRunning(b, a, job, 20, 3*time.Minute)
		manyElapsed = time.Since(manyStart)
		time.Sleep(2 * time.Second)
		busyRSS = pluginRSS(b, a)
		supCount, supRSS, supPSS = supervisorsRSS(a)
		stop(b, a, job)
	}

	ratio := func(x, y time.Duration) string {
		if x == 0 || y == 0 {
			return "n/a"
		}
		return fmt.Sprintf("%.2f", float64(x)/float64(y))
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%-44s %s\n", "metric", "value")
	fmt.Fprintf(&sb, "%-44s %s\n", strings.Repeat("-", 44), strings.Repeat("-", 24))
	for _, d := range drivers {
		fmt.Fprintf(&sb, "%-44s %v  (runs: %s)\n", "submit->running median, "+d, med[d].Round(time.Millisecond), list(samples[d]))
	}
	fmt.Fprintf(&sb, "%-44s %s\n", "ratio csi/exec", ratio(med["csi"], med["exec"]))
	fmt.Fprintf(&sb, "%-44s %s\n", "ratio csi/raw_exec", ratio(med["csi"], med["raw_exec"]))
	fmt.Fprintf(&sb, "%-44s %s\n", "ratio csi as root: isolated/privileged", ratio(med[variantIsolated], med[variantPrivileged]))
	fmt.Fprintf(&sb, "%-44s %s\n", "plugin RSS, idle", kb(idleRSS))
	fmt.Fprintf(&sb, "%-44s %s\n", "plugin RSS, 20 csi tasks running", kb(busyRSS))
	fmt.Fprintf(&sb, "%-44s %d processes, RSS %s, PSS %s\n", "task supervisors, 20 csi tasks running", supCount, kb(supRSS), kb(supPSS))
	fmt.Fprintf(&sb, "%-44s %v\n", "submit->20 csi tasks running", manyElapsed.Round(time.Millisecond))
	fmt.Print(sb.String())
}

func kb(v int64) string {
	if v < 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.1f MiB", float64(v)/1024)
}

func list(ds []time.Duration) string {
	var parts []string
	for _, d := range ds {
		parts = append(parts, strconv.FormatInt(d.Milliseconds(), 10))
	}
	return strings.Join(parts, ",") + " ms"
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// percentile is the p-th percentile (0 < p <= 100) of ds, by the
// nearest-rank method: the smallest value at least p % of ds are at or
// below.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	rank := int(math.Ceil(p / 100 * float64(len(s))))
	return s[min(max(rank, 1), len(s))-1]
}

// startOne runs a one-task sleep job on driver d (or a variant of the csi
// task, see taskVariants), returns submit->running, and stops and purges
// the job before returning.
func startOne(b *testing.B, a *e2e.Agent, d string) time.Duration {
	b.Helper()
	t0 := time.Now()
	job := submit(b, a, d, 1)
	// A limit, not a measure: exec's first start builds its chroot, which
	// once took over a minute (a fresh machine, just after ManyTasks).
	started := waitRunning(b, a, job, 1, 5*time.Minute)
	stop(b, a, job)
	return started[0].Sub(t0)
}

// submit renders e2e/jobs/sleep.hcl for driver (or a variant of the csi
// task, see taskVariants), registers it (see register) and returns the
// job ID.
func submit(b *testing.B, a *e2e.Agent, driver string, count int) string {
	b.Helper()
	job, err := a.RenderJob("sleep", map[string]string{"Driver": variantDriver(driver), "Count": strconv.Itoa(count)})
	if err != nil {
		b.Fatal(err)
	}
	register(b, a, job, taskVariants[driver])
	return job.ID
}

// register parses a rendered job through the agent (not timed), changes
// its tasks with tweak (when not nil) and registers it: the "submit"
// instant is just before the call.
func register(b *testing.B, a *e2e.Agent, job e2e.Job, tweak func(task map[string]any)) {
	b.Helper()
	hcl, err := os.ReadFile(job.File)
	if err != nil {
		b.Fatal(err)
	}
	var parsed map[string]any
	if err := a.PutJSON("POST", "/v1/jobs/parse", map[string]any{"JobHCL": string(hcl), "Canonicalize": true}, &parsed); err != nil {
		b.Fatalf("failed to parse %s: %v", job.File, err)
	}
	if tweak != nil {
		tweakTasks(b, parsed, tweak)
	}
	if err := a.PutJSON("POST", "/v1/jobs", map[string]any{"Job": parsed}, nil); err != nil {
		b.Fatalf("failed to register %s: %v", job.ID, err)
	}
}

// waitRunning polls until n allocations of the job have their task
// running and returns the tasks' StartedAt times.
func waitRunning(b *testing.B, a *e2e.Agent, jobID string, n int, timeout time.Duration) []time.Time {
	b.Helper()
	deadline := time.Now().Add(timeout)
	var last []e2e.AllocStub
	for time.Now().Before(deadline) {
		allocs, err := a.JobAllocations(jobID)
		if err == nil {
			last = allocs
			var started []time.Time
			for _, al := range allocs {
				if e2e.IsTerminal(al.ClientStatus) {
					full := a.Allocation(b, al.ID)
					b.Fatalf("allocation of %s ended while starting:\n%s", jobID, full.Describe())
				}
				if ts := al.TaskStates["t"]; ts != nil && ts.State == "running" && !ts.StartedAt.IsZero() {
					started = append(started, ts.StartedAt)
				}
			}
			if len(started) >= n {
				return started
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	b.Fatalf("job %s: fewer than %d tasks running after %v (%d allocations)", jobID, n, timeout, len(last))
	return nil
}

// stop deregisters the job, waits for its allocations to end, and purges
// it.
func stop(b *testing.B, a *e2e.Agent, jobID string) {
	b.Helper()
	path := "/v1/job/" + url.PathEscape(jobID)
	if err := a.PutJSON("DELETE", path, nil, nil); err != nil {
		b.Fatalf("failed to stop %s: %v", jobID, err)
	}
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		allocs, err := a.JobAllocations(jobID)
		if err != nil {
			b.Fatal(err)
		}
		done := true
		for _, al := range allocs {
			done = done && e2e.IsTerminal(al.ClientStatus)
		}
		if done {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := a.PutJSON("DELETE", path+"?purge=true", nil, nil); err != nil {
		b.Fatalf("failed to purge %s: %v", jobID, err)
	}
}

// pluginRSS reads VmRSS of the agent's nomad-driver-csi child, in kB.
func pluginRSS(b *testing.B, a *e2e.Agent) int64 {
	b.Helper()
	pid := a.DriverPluginPID()
	if pid == 0 {
		b.Fatalf("no nomad-driver-csi child of the agent (children: %v)", a.Children())
	}
	v, err := e2e.StatusField(pid, "VmRSS")
	if err != nil {
		b.Fatal(err)
	}
	return parseKB(v)
}

func parseKB(v string) int64 {
	n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
	if err != nil {
		return -1
	}
	return n
}

// supervisorsRSS counts the driver's per-task supervisors (see
// isSupervisor) and sums their VmRSS and their PSS (which does not count
// the shared binary 20 times).
func supervisorsRSS(a *e2e.Agent) (int, int64, int64) {
	return procsRSS(isSupervisor(a, nil))
}

// pssKB reads a process's proportional set size (shared pages split among
// the processes that map them) from /proc/PID/smaps_rollup, in kB.
func pssKB(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && k == "Pss" {
			return parseKB(v)
		}
	}
	return 0
}

func hasParent(pid, parent int) bool {
	p, err := e2e.ReadProc(pid)
	return err == nil && p.PPID == parent
}
