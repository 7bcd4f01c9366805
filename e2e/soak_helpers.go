//go:build e2e

package e2e

// Helpers of the soak (soak_test.go): what one sample of the driver and
// the host holds, how it is taken, the least-squares slopes and the table
// that reports them.

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/debugstats"
)

// SoakSample is what the soak measures at one point, with every workload
// stopped and torn down.
type SoakSample struct {
	Cycle int
	// Label says why the sample was taken out of turn ("restart": just
	// after the agent restarted, "end": after the plugins stopped).
	Label string
	// The driver plugin process: a restart of the agent starts a new one.
	DriverPID  int
	FDs        int
	Goroutines int // from the driver's debug stats file
	Threads    int
	RSSKiB     int
	HeapKiB    int
	// Mounts under the driver's root_dir and under the agent's directory
	// (data dir with Nomad's CSI staging and alloc dirs, root_dir).
	MountsRoot, MountsAgent int
	// Cgroups of this soak's tasks under the driver's cgroup parent, and
	// the processes of its tasks (plugin tasks included; not the agents,
	// the driver or Nomad's log monitors).
	Cgroups, Procs int
	Spares         int
	// What the counts of mounts, cgroups and processes counted, for
	// failure messages.
	Left []string
	// The driver's journal: bytes on disk and volume/task records.
	JournalBytes, JournalRecords int
	Elapsed                      time.Duration
}

// soakDriverCgroupParent is the driver's cgroup_parent: the harness leaves
// the plugin's default.
const soakDriverCgroupParent = "nomad-csi"

// soakCgroups lists the cgroup directories (every hierarchy) under the
// driver's cgroup parent whose name holds one of the allocation ids.
func soakCgroups(allocIDs map[string]bool) []string {
	var out []string
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/" + soakDriverCgroupParent)
	if d := "/sys/fs/cgroup/" + soakDriverCgroupParent; soakIsDir(d) {
		roots = append(roots, d) // a cgroup2-only host
	}
	for _, root := range roots {
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() || p == root {
				return nil
			}
			base := filepath.Base(p)
			for id := range allocIDs {
				if strings.Contains(base, id) {
					out = append(out, p)
					break
				}
			}
			return nil
		})
	}
	return out
}

func soakIsDir(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.IsDir()
}

// soakProcs lists the processes of the soak's tasks and their supervisors:
// those whose command line, working directory, environment or cgroup
// names the agent's directory or one of the allocations, except the
// agents, the driver plugin and Nomad's own helpers: those named "nomad"
// (logmon, executors) and the agents' direct children (fingerprinters such
// as the java driver's periodic "java -version", which a task never is:
// tasks are forked by their supervisors). The
// driver's spare supervisor (started ahead of the next task, gone with
// the driver) is listed apart.
func (a *Agent) soakProcs(allocIDs map[string]bool) (tasks, spares []string) {
	ids := make([]string, 0, len(allocIDs))
	for id := range allocIDs {
		ids = append(ids, id)
	}
	agents := map[int]bool{a.PID(): true, a.server.pid(): true}
	delete(agents, 0)
	skip := map[int]bool{os.Getpid(): true, a.PID(): true, a.server.pid(): true, a.DriverPluginPID(): true}
	for _, p := range listProcs() {
		if skip[p.PID] || agents[p.PPID] || p.Comm == "nomad" || procState(p.PID) == "Z" {
			continue
		}
		if !a.belongs(p.PID, ids) {
			continue
		}
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p.PID))
		cmdline := strings.ReplaceAll(string(b), "\x00", " ")
		desc := fmt.Sprintf("%d %s ppid=%d %q", p.PID, p.Comm, p.PPID, cmdline)
		if strings.Contains(cmdline, " --spare-root ") {
			spares = append(spares, desc)
		} else {
			tasks = append(tasks, desc)
		}
	}
	return tasks, spares
}

// soakJournalBytes sums the sizes of the files in the driver's journal
// directory.
func (a *Agent) soakJournalBytes() int {
	var n int64
	_ = filepath.WalkDir(filepath.Join(a.DriverRoot, "journal"), func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return int(n)
}

// soakKiB parses "1234 kB" from /proc/PID/status.
func soakKiB(s string) int {
	n, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(s), " kB"))
	return n
}

// takeSoakSample samples the driver process (fds, threads and RSS from
// /proc; goroutines and heap from its debug stats file, waiting for one
// written after the sample began) and the host.
func (a *Agent) takeSoakSample(statsPath string, allocIDs map[string]bool) (SoakSample, error) {
	var s SoakSample
	began := time.Now()
	pid := a.DriverPluginPID()
	if pid == 0 {
		return s, fmt.Errorf("no driver plugin process under the agent (pid %d)", a.PID())
	}
	s.DriverPID = pid
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return s, fmt.Errorf("failed to list the driver's fds: %w", err)
	}
	s.FDs = len(fds)
	th, err := StatusField(pid, "Threads")
	if err != nil {
		return s, err
	}
	s.Threads, _ = strconv.Atoi(th)
	rss, err := StatusField(pid, "VmRSS")
	if err != nil {
		return s, err
	}
	s.RSSKiB = soakKiB(rss)
	deadline := time.Now().Add(15 * time.Second)
	for {
		st, err := debugstats.Read(statsPath)
		if err == nil && st.PID == pid && st.Time.After(began) {
			s.Goroutines, s.HeapKiB = st.Goroutines, int(st.HeapAlloc/1024)
			break
		}
		if time.Now().After(deadline) {
			return s, fmt.Errorf("the driver (pid %d) wrote no debug stats to %s since %s (last: %+v, %v)",
				pid, statsPath, began.Format(time.RFC3339), st, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	root, err := MountsUnder(a.DriverRoot)
	if err != nil {
		return s, err
	}
	all, err := MountsUnder(a.Dir)
	if err != nil {
		return s, err
	}
	s.MountsRoot, s.MountsAgent = len(root), len(all)
	cgroups := soakCgroups(allocIDs)
	procs, spares := a.soakProcs(allocIDs)
	s.Cgroups, s.Procs, s.Spares = len(cgroups), len(procs), len(spares)
	s.Left = append(append(append(s.Left, all...), cgroups...), procs...)
	s.Left = append(s.Left, spares...)
	s.JournalBytes = a.soakJournalBytes()
	s.JournalRecords = len(a.VolJournalLeft())
	return s, nil
}

// soakSlope is the least-squares slope of y over x, scaled to "per 100
// cycles" (0 with fewer than two distinct x).
func soakSlope(xs []int, ys []float64) float64 {
	n := float64(len(xs))
	if len(xs) < 2 {
		return 0
	}
	var sx, sy, sxx, sxy float64
	for i := range xs {
		x := float64(xs[i])
		sx += x
		sy += ys[i]
		sxx += x * x
		sxy += x * ys[i]
	}
	den := n*sxx - sx*sx
	if den == 0 {
		return 0
	}
	return (n*sxy - sx*sy) / den * 100
}

// soakMetric names one column of a sample.
type soakMetric struct {
	Name string
	Get  func(SoakSample) int
	// PerProcess metrics restart with the driver: their slope is fitted
	// per driver process (between agent restarts), the others over the
	// whole run.
	PerProcess bool
}

var soakMetrics = []soakMetric{
	{"fds", func(s SoakSample) int { return s.FDs }, true},
	{"goroutines", func(s SoakSample) int { return s.Goroutines }, true},
	{"threads", func(s SoakSample) int { return s.Threads }, true},
	{"RSS KiB", func(s SoakSample) int { return s.RSSKiB }, true},
	{"heap KiB", func(s SoakSample) int { return s.HeapKiB }, true},
	{"mounts root_dir", func(s SoakSample) int { return s.MountsRoot }, false},
	{"mounts agent dir", func(s SoakSample) int { return s.MountsAgent }, false},
	{"cgroups", func(s SoakSample) int { return s.Cgroups }, false},
	{"task procs", func(s SoakSample) int { return s.Procs }, false},
	{"spares", func(s SoakSample) int { return s.Spares }, false},
	{"journal bytes", func(s SoakSample) int { return s.JournalBytes }, false},
	{"journal records", func(s SoakSample) int { return s.JournalRecords }, false},
}

// soakSegments splits the periodic samples (not "end") into runs of one
// driver process.
func soakSegments(samples []SoakSample) [][]SoakSample {
	var segs [][]SoakSample
	for _, s := range samples {
		if s.Label == "end" {
			continue
		}
		if n := len(segs); n == 0 || segs[n-1][0].DriverPID != s.DriverPID {
			segs = append(segs, nil)
		}
		segs[len(segs)-1] = append(segs[len(segs)-1], s)
	}
	return segs
}

// SoakSlopes fits each metric: over the whole run, or for per-process
// metrics in each driver process's segment of at least two samples, the
// segment's slope with the largest magnitude.
func SoakSlopes(samples []SoakSample) map[string]float64 {
	out := map[string]float64{}
	for _, m := range soakMetrics {
		var groups [][]SoakSample
		if m.PerProcess {
			groups = soakSegments(samples)
		} else {
			var all []SoakSample
			for _, s := range samples {
				if s.Label != "end" {
					all = append(all, s)
				}
			}
			groups = [][]SoakSample{all}
		}
		best := 0.0
		for _, g := range groups {
			if len(g) < 2 {
				continue
			}
			var xs []int
			var ys []float64
			for _, s := range g {
				xs = append(xs, s.Cycle)
				ys = append(ys, float64(m.Get(s)))
			}
			if sl := soakSlope(xs, ys); soakAbs(sl) > soakAbs(best) {
				best = sl
			}
		}
		out[m.Name] = best
	}
	return out
}

func soakAbs(f float64) float64 {
	if f < 0 {
		return -f
	}
	return f
}

// SoakTable renders the samples and slopes as a Markdown table.
func SoakTable(samples []SoakSample) string {
	var b strings.Builder
	b.WriteString("| cycle | driver pid |")
	for _, m := range soakMetrics {
		fmt.Fprintf(&b, " %s |", m.Name)
	}
	b.WriteString(" elapsed |\n|---|---|")
	for range soakMetrics {
		b.WriteString("---|")
	}
	b.WriteString("---|\n")
	for _, s := range samples {
		c := strconv.Itoa(s.Cycle)
		if s.Label != "" {
			c += " (" + s.Label + ")"
		}
		fmt.Fprintf(&b, "| %s | %d |", c, s.DriverPID)
		for _, m := range soakMetrics {
			fmt.Fprintf(&b, " %d |", m.Get(s))
		}
		fmt.Fprintf(&b, " %s |\n", s.Elapsed.Round(time.Second))
	}
	slopes := SoakSlopes(samples)
	b.WriteString("| slope / 100 cycles | |")
	for _, m := range soakMetrics {
		fmt.Fprintf(&b, " %+.2f |", slopes[m.Name])
	}
	b.WriteString(" |\n")
	return b.String()
}
