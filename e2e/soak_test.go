//go:build e2e

package e2e

// The soak: SOAK_CYCLES start/stop cycles of volume tasks against a real
// Persistent agent (a server and a client agent), with the client agent
// restarted now and then while volume tasks run. Each cycle runs one
// batch job (e2e/jobs/soak_cycle.hcl): three tasks with driver-managed
// volumes - one volume shared by the three, staged once and published per
// task, and one of each task's own - and two tasks sharing a native
// volume ("nomad volume create", group volume block and volume_mount)
// that Nomad stages through a plugin the csi driver runs. Every volume is
// a bind-mode (dir) volume of the fixture: no loop device, so the soak
// can run beside other e2e runs.
//
// Every SOAK_SAMPLE_EVERY cycles, once every workload is torn down, it
// samples the driver plugin process (fds, goroutines - from the debug
// stats file the driver writes when NOMAD_DRIVER_CSI_DEBUG_STATS names
// one -, threads, RSS, heap) and the host (mounts under root_dir and the
// agent's directory, cgroups of the soak's tasks under the driver's
// cgroup parent, task processes, journal bytes and records), and reports
// the least-squares slope per 100 cycles. At the end, with the plugins
// stopped, nothing may be left: no mount, cgroup, task process or journal
// record. Growth is asserted only loosely (fds and goroutines of one
// driver process within a small bound), never with timings.
//
//	SOAK_CYCLES=1000 go test -tags e2e -count=1 -run TestSoak -v -timeout 4h ./e2e/
//
// make soak runs 1000 cycles, make soak-short 20 with one restart.
// SOAK_SAMPLE_EVERY (default 100, or a quarter of a short run),
// SOAK_RESTART_EVERY (default 250, or half of a short run; 0: never) and
// SOAK_REPORT (a file for the table) shape it.

import (
	"fmt"
	"maps"
	"math"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/debugstats"
)

// The loose bounds on how much one driver process may grow between its
// first and last sample: a cache filling up (a CSI client per plugin, a
// gRPC connection) fits in them, a leak per cycle does not.
const (
	soakMaxFDGrowth        = 16
	soakMaxGoroutineGrowth = 32
)

// Per cycle: three tasks with driver-managed volumes, two with the native
// one.
const (
	soakManagedCount = 3
	soakNativeCount  = 2
)

type soakRun struct {
	t         *testing.T
	a         *Agent
	statsPath string
	dest      string
	batch     map[string]any // the parsed cycle job
	hold      map[string]any // the parsed service job run across a restart
	allocIDs  map[string]bool
	plugins   []string
	volume    string // the native volume, "" once deleted
	baseline  SoakSample
	samples   []SoakSample
	start     time.Time
	restarts  []int
}

func soakEnvInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		t.Fatalf("%s must be a whole number, got %q", name, v)
	}
	return n
}

func TestSoak(t *testing.T) {
	cycles := soakEnvInt(t, "SOAK_CYCLES", 0)
	if cycles == 0 {
		t.Skip("the soak runs when SOAK_CYCLES is set (make soak, make soak-short)")
	}
	requireCSI(t)
	root, err := RepoRoot()
	must.NoError(t, err)
	must.NoError(t, CheckFixture(root))
	sampleEvery := soakEnvInt(t, "SOAK_SAMPLE_EVERY", max(min(100, cycles/4), 1))
	restartEvery := soakEnvInt(t, "SOAK_RESTART_EVERY", min(250, cycles/2))

	s := &soakRun{t: t, statsPath: filepath.Join(t.TempDir(), "driver-stats.json"), allocIDs: map[string]bool{}}
	s.a = StartAgent(t, AgentOptions{AllowPrivileged: true, Persistent: true,
		Env: []string{debugstats.Env + "=" + s.statsPath}})
	// Runs before the agent's Close: on the way out of a failed soak, the
	// native volume is deleted while its plugin still runs.
	t.Cleanup(s.teardown)
	s.setup()

	s.start = time.Now()
	s.sample(0, "")
	s.baseline = s.samples[0]
	for i := 1; i <= cycles; i++ {
		if err := s.cycle(i); err != nil {
			s.report(cycles)
			t.Fatalf("cycle %d: %v", i, err)
		}
		if i%sampleEvery == 0 || i == cycles {
			s.sample(i, "")
		}
		if restartEvery > 0 && i%restartEvery == 0 && i < cycles {
			s.restart(i)
			s.sample(i, "restart")
		}
	}
	wall := time.Since(s.start)

	// Nothing left: the native volume deleted, the plugins stopped, the
	// terminal allocations collected.
	s.teardown()
	left := s.settle(2*time.Minute, true)
	end, err := s.a.takeSoakSample(s.statsPath, s.allocIDs)
	must.NoError(t, err)
	end.Cycle, end.Label, end.Elapsed = cycles, "end", time.Since(s.start)
	s.samples = append(s.samples, end)
	s.report(cycles)
	t.Logf("soak: %d cycles in %v (restarts after cycles %v)\n%s", cycles, wall.Round(time.Second), s.restarts, SoakTable(s.samples))
	test.SliceEmpty(t, left, test.Sprintf("left over once every job stopped: %v", left))
	test.Eq(t, 0, end.MountsRoot, test.Sprintf("mounts under root_dir: %v", end.Left))
	test.Eq(t, 0, end.MountsAgent, test.Sprintf("mounts under the agent's directory: %v", end.Left))
	test.Eq(t, 0, end.Cgroups, test.Sprintf("cgroups under the driver's cgroup parent: %v", end.Left))
	test.Eq(t, 0, end.Procs, test.Sprintf("task processes: %v", end.Left))
	test.Eq(t, 0, end.JournalRecords, test.Sprintf("journal records: %v", s.a.VolJournalLeft()))
	test.LessEq(t, 1, end.Spares, test.Sprintf("spare supervisors: %v", end.Left))
	// With the client agent stopped, its driver's spare goes too: no
	// process of the soak is left.
	must.NoError(t, s.a.Stop(30*time.Second))
	var procs, spares []string
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if procs, spares = s.a.soakProcs(s.allocIDs); len(procs)+len(spares) == 0 {
			break
		}
	}
	test.SliceEmpty(t, append(procs, spares...), test.Sprint("processes left once the client agent stopped"))

	// Loose bounds on growth within one driver process.
	for _, seg := range soakSegments(s.samples) {
		first, last := seg[0], seg[len(seg)-1]
		test.LessEq(t, first.FDs+soakMaxFDGrowth, last.FDs, test.Sprintf(
			"driver pid %d: fds grew from %d (cycle %d) to %d (cycle %d)", first.DriverPID, first.FDs, first.Cycle, last.FDs, last.Cycle))
		test.LessEq(t, first.Goroutines+soakMaxGoroutineGrowth, last.Goroutines, test.Sprintf(
			"driver pid %d: goroutines grew from %d (cycle %d) to %d (cycle %d); see %s.goroutines",
			first.DriverPID, first.Goroutines, first.Cycle, last.Goroutines, last.Cycle, s.statsPath))
	}
	// The shared volume was staged once for tasks that overlapped.
	fx := &VolFixture{StateDir: filepath.Join(s.a.Dir, "fx-soakfx"), CallLog: filepath.Join(s.a.Dir, "fx-soakfx", "calls.log")}
	id := fx.VolumeID("soak-shared")
	stages, publishes := fx.Count("NodeStageVolume", id), fx.Count("NodePublishVolume", id)
	t.Logf("shared volume %s: %d NodeStageVolume, %d NodePublishVolume", id, stages, publishes)
	test.Less(t, publishes, stages, test.Sprint("the shared volume was never published to two tasks under one staging"))
}

// setup starts the two plugins - the fixture as a driver-managed plugin
// and as a native one - creates the native volume and parses the jobs.
func (s *soakRun) setup() {
	t, a := s.t, s.a
	s.dest = filepath.Join(a.Dir, "dst")
	mp := a.RunJob(t, "native_managed_plugin", a.ManagedPluginVars("soakfx"))
	np := a.RunJob(t, "native_plugin", a.NativePluginVars("soaknat", true, ""))
	s.plugins = []string{mp.ID, np.ID}
	for _, id := range s.plugins {
		s.allocIDs[a.WaitAlloc(t, id, time.Minute, StatusRunning).ID] = true
	}
	nativeWaitNodeAttr(t, a, "driver.csi.plugin.soakfx.healthy", "true", time.Minute)
	if _, err := a.WaitNativePlugin("soaknat", 1, 1, time.Minute); err != nil {
		t.Fatal(err)
	}
	must.NoError(t, a.CreateNativeVolume("soak-native", "soaknat", "multi-node-multi-writer", "dir"))
	s.volume = "soak-native"
	script := strings.Join([]string{
		"set -e",
		"d=" + s.dest,
		`echo "$NOMAD_ALLOC_ID" > "$d/shared/$NOMAD_ALLOC_ID"`,
		`if [ -d "$d/own" ]; then echo "$NOMAD_ALLOC_ID" > "$d/own/last"; fi`,
		// Long enough for the tasks of a cycle to overlap on the shared
		// volume.
		"sleep 0.3",
		`rm "$d/shared/$NOMAD_ALLOC_ID"`,
	}, "\n")
	s.batch = s.parse("batch", script, soakManagedCount, soakNativeCount)
	s.hold = s.parse("service", script+"\nexec sleep 3600", 2, 1)
}

// parse renders e2e/jobs/soak_cycle.hcl and parses it once; each cycle
// registers a copy under its own id.
func (s *soakRun) parse(typ, script string, managed, native int) map[string]any {
	a := s.a
	job, err := a.RenderJob("soak_cycle", map[string]string{
		"Type": typ, "Script": script, "ManagedCount": strconv.Itoa(managed), "NativeCount": strconv.Itoa(native),
		"ManagedPlugin": "soakfx", "SharedVolume": "soak-shared", "OwnVolumePrefix": "soak-own",
		"NativeVolume": "soak-native", "Dest": s.dest,
	})
	must.NoError(s.t, err)
	hcl, err := os.ReadFile(job.File)
	must.NoError(s.t, err)
	var parsed map[string]any
	must.NoError(s.t, a.PutJSON("POST", "/v1/jobs/parse", map[string]any{"JobHCL": string(hcl), "Canonicalize": true}, &parsed))
	return parsed
}

// run registers a copy of a parsed job under id and waits until its n
// allocations are all in status want; a failed one is an error that
// describes it.
func (s *soakRun) run(parsed map[string]any, id string, n int, want string) ([]AllocStub, error) {
	a := s.a
	job := maps.Clone(parsed)
	job["ID"], job["Name"] = id, id
	a.mu.Lock()
	a.jobs = append(a.jobs, id)
	a.mu.Unlock()
	if err := a.PutJSON("POST", "/v1/jobs", map[string]any{"Job": job}, nil); err != nil {
		return nil, fmt.Errorf("failed to register job %s: %w", id, err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		allocs, err := a.JobAllocations(id)
		if err == nil {
			done := 0
			for _, al := range allocs {
				s.allocIDs[al.ID] = true
				switch {
				case al.ClientStatus == want:
					done++
				case IsTerminal(al.ClientStatus):
					desc := al.ClientStatus
					if full, err := a.allocation(al.ID); err == nil {
						desc = full.Describe()
					}
					return allocs, fmt.Errorf("allocation %s of job %s is %s, wanted %s:\n%s", al.ID, id, al.ClientStatus, want, desc)
				}
			}
			if done == n && len(allocs) == n {
				return allocs, nil
			}
		}
		if time.Now().After(deadline) {
			return allocs, fmt.Errorf("job %s: %d allocations, not all %s after 2m (%v)", id, len(allocs), want, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// purge stops (when running) and purges a job and forgets it.
func (s *soakRun) purge(id string) error {
	a := s.a
	err := a.StopWaitPurge(id, true, 2*time.Minute)
	a.mu.Lock()
	a.jobs = slices.DeleteFunc(a.jobs, func(j string) bool { return j == id })
	a.mu.Unlock()
	return err
}

// cycle runs one batch job to completion and purges it.
func (s *soakRun) cycle(i int) error {
	id := fmt.Sprintf("soak-%05d", i)
	if _, err := s.run(s.batch, id, soakManagedCount+soakNativeCount, StatusComplete); err != nil {
		return err
	}
	return s.purge(id)
}

// restart runs volume tasks across a restart of the client agent: they
// must keep running with their volumes (the new driver process recovers
// them), and stop cleanly afterwards.
func (s *soakRun) restart(i int) {
	t, a := s.t, s.a
	id := fmt.Sprintf("soak-hold-%05d", i)
	allocs, err := s.run(s.hold, id, 3, StatusRunning)
	if err != nil {
		t.Fatalf("before the restart after cycle %d: %v", i, err)
	}
	before := a.DriverPluginPID()
	must.NoError(t, a.Restart())
	after := a.DriverPluginPID()
	must.NotEq(t, before, after, must.Sprint("the restart did not start a new driver process"))
	for _, al := range allocs {
		out, err := a.AllocExec(al.ID, "t", "/bin/sh", "-c", "ls "+s.dest+"/shared >/dev/null && echo volume-ok")
		if err != nil || !strings.Contains(out, "volume-ok") {
			t.Fatalf("allocation %s after the restart after cycle %d: %v: %s\n%s", al.ID, i, err, out, a.Allocation(t, al.ID).Describe())
		}
	}
	if err := s.purge(id); err != nil {
		t.Fatalf("after the restart after cycle %d: %v", i, err)
	}
	s.restarts = append(s.restarts, i)
}

// settle waits until every workload is torn down: no journal record, no
// claim on the native volume, and mounts, cgroups and task processes back
// at the baseline (zero when final), collecting the client's terminal
// allocations now and then. It returns what is still left at the
// deadline.
func (s *soakRun) settle(timeout time.Duration, final bool) []string {
	a := s.a
	deadline := time.Now().Add(timeout)
	var nextGC time.Time
	for {
		if time.Now().After(nextGC) {
			_ = a.PutJSON("PUT", "/v1/client/gc?node_id="+url.QueryEscape(a.NodeID), nil, nil)
			_ = a.PutJSON("PUT", "/v1/system/gc", nil, nil)
			nextGC = time.Now().Add(5 * time.Second)
		}
		base := s.baseline
		if final {
			base = SoakSample{}
		}
		var left []string
		if j := a.VolJournalLeft(); len(j) > 0 {
			left = append(left, fmt.Sprintf("journal: %v", j))
		}
		if s.volume != "" {
			if v, err := a.NativeVolume(s.volume); err != nil {
				left = append(left, err.Error())
			} else if v.Claims() > 0 || len(v.Allocations) > 0 {
				left = append(left, fmt.Sprintf("native volume %s: %d claims, %d allocations", s.volume, v.Claims(), len(v.Allocations)))
			}
		}
		if m, _ := MountsUnder(a.DriverRoot); len(m) > base.MountsRoot {
			left = append(left, fmt.Sprintf("mounts under root_dir: %v", m))
		}
		if m, _ := MountsUnder(a.Dir); len(m) > base.MountsAgent {
			left = append(left, fmt.Sprintf("mounts under the agent's directory: %v", m))
		}
		if c := soakCgroups(s.allocIDs); len(c) > base.Cgroups {
			left = append(left, fmt.Sprintf("cgroups: %v", c))
		}
		if p, _ := a.soakProcs(s.allocIDs); len(p) > base.Procs {
			left = append(left, fmt.Sprintf("task processes: %v", p))
		}
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// sample settles and takes one sample.
func (s *soakRun) sample(cycle int, label string) {
	t := s.t
	// The baseline is what the plugins alone hold.
	if cycle > 0 || label != "" {
		if left := s.settle(time.Minute, false); len(left) > 0 {
			t.Logf("cycle %d: still busy after a minute, sampling anyway: %v", cycle, left)
		}
	}
	smp, err := s.a.takeSoakSample(s.statsPath, s.allocIDs)
	if err != nil {
		t.Fatalf("cycle %d: %v", cycle, err)
	}
	smp.Cycle, smp.Label = cycle, label
	if !s.start.IsZero() {
		smp.Elapsed = time.Since(s.start)
	}
	s.samples = append(s.samples, smp)
	t.Logf("sample: cycle=%d%s pid=%d fds=%d goroutines=%d threads=%d rss=%dKiB heap=%dKiB mounts=%d/%d cgroups=%d procs=%d journal=%dB/%d elapsed=%v",
		cycle, map[bool]string{true: " (" + label + ")", false: ""}[label != ""], smp.DriverPID, smp.FDs, smp.Goroutines, smp.Threads,
		smp.RSSKiB, smp.HeapKiB, smp.MountsRoot, smp.MountsAgent, smp.Cgroups, smp.Procs, smp.JournalBytes, smp.JournalRecords,
		smp.Elapsed.Round(time.Second))
}

// report writes the table to SOAK_REPORT, when set.
func (s *soakRun) report(cycles int) {
	path := os.Getenv("SOAK_REPORT")
	if path == "" {
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Soak: %d cycles\n\n", cycles)
	fmt.Fprintf(&b, "Run on %s, %s; wall time %v; agent restarts after cycles %v.\n", time.Now().UTC().Format(time.RFC3339),
		os.Getenv("SOAK_COMMAND"), time.Since(s.start).Round(time.Second), s.restarts)
	fmt.Fprintf(&b, "Each cycle: %d tasks with driver-managed volumes (one shared, one each), %d with a shared native volume; bind-mode volumes.\n\n",
		soakManagedCount, soakNativeCount)
	b.WriteString(SoakTable(s.samples))
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		s.t.Errorf("failed to write the soak report %s: %v", path, err)
	}
}

// teardown deletes the native volume while its plugin runs, then stops
// the plugins. Safe to call twice.
func (s *soakRun) teardown() {
	a := s.a
	if s.volume != "" {
		if _, err := a.WaitNativeVolumeReleased(s.volume, time.Minute); err != nil {
			s.t.Errorf("%v", err)
		}
		if err := a.DeleteNativeVolume(s.volume, time.Minute); err != nil {
			s.t.Errorf("%v", err)
		}
		s.volume = ""
	}
	for _, id := range s.plugins {
		if err := s.purge(id); err != nil {
			s.t.Errorf("%v", err)
		}
	}
	s.plugins = nil
}

func TestSoakSlope(t *testing.T) {
	cases := []struct {
		name string
		xs   []int
		ys   []float64
		want float64
	}{
		{"flat", []int{0, 100, 200}, []float64{5, 5, 5}, 0},
		{"one per cycle", []int{0, 100, 200, 300}, []float64{0, 100, 200, 300}, 100},
		{"noisy falling", []int{0, 100, 200}, []float64{10, 4, 4}, -3},
		{"one sample", []int{100}, []float64{7}, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := soakSlope(tc.xs, tc.ys)
			must.True(t, math.Abs(got-tc.want) < 1e-9, must.Sprintf("slope %v, want %v", got, tc.want))
		})
	}
}
