//go:build e2e

// Command benchtable runs every benchmark of e2e/bench, one process each,
// and prints one table of ratios, each measured side by side within one
// benchmark (one agent, runs interleaved), with the absolute medians beside
// them. The table goes to stdout and to build/bench.md; each benchmark's
// full output goes to build/bench-logs/<name>.log.
//
//	go run -tags e2e ./e2e/bench/cmd/benchtable            # what make bench runs
//	go run -tags e2e ./e2e/bench/cmd/benchtable -runs 3 -bench 'Volume'
//
// It builds the driver once (the benchmarks then run with
// E2E_SKIP_BUILD=1) and the benchmarks into one test binary, lists the
// Benchmark functions in it, and runs each with -test.benchtime 1x. The
// numbers come from the metrics each benchmark reports with
// b.ReportMetric (the "Benchmark..." result line); rows whose benchmark or
// metric is missing say so, and metrics no row uses are listed below the
// table. Like the e2e tests it needs root, build/nomad and build/csi.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

// row is one line of the table: a ratio of two values of one benchmark
// (num/den), or one absolute value when den is empty. A value is the first
// of the metric names the benchmark reported with b.ReportMetric or, failing
// that, what the text pattern captures in the benchmark's printed table (a
// Go duration or "N MiB").
type row struct {
	label   string
	bench   string
	num     []string
	numText string
	numAs   string // what the numerator is, beside its median
	den     []string
	denText string
	denAs   string
	unit    string // "ms" or "MiB"
}

// rows is the table, in the order it prints.
var rows = []row{
	{label: "volume task start (Staging event → Started): driver vs direct-CSI floor", bench: "Volumes",
		num: []string{"window-ms"}, numAs: "driver",
		den: []string{"floor-ms"}, denAs: "NodeStage+NodePublish+fork/exec direct", unit: "ms"},
	{label: "volume task start (Staging event → Started), p90: driver vs direct-CSI floor (median)", bench: "Volumes",
		num: []string{"window-p90-ms"}, numAs: "driver p90",
		den: []string{"floor-ms"}, denAs: "floor", unit: "ms"},
	{label: "volume task start (Staging event → Started): isolated vs privileged (both root)", bench: "Volumes",
		num: []string{"window-ms"}, numAs: "isolated",
		den: []string{"window-privileged-ms"}, denAs: "privileged", unit: "ms"},
	{label: "submit → running, volume task: isolated vs privileged (both root)", bench: "Volumes",
		num: []string{"one-ms"}, numAs: "isolated",
		den: []string{"one-privileged-ms"}, denAs: "privileged", unit: "ms"},
	{label: "plugin socket ready → healthy: native csi_plugin vs driver-managed", bench: "PluginHealth",
		num: []string{"native-socket-ms"}, numAs: "native",
		den: []string{"driver-socket-ms"}, denAs: "driver-managed", unit: "ms"},
	{label: "submit → running, volume task: native volume vs driver-managed (both driver=csi)", bench: "VolumeJobRun",
		num: []string{"native-csi-ms"}, numAs: "native",
		den: []string{"managed-csi-ms"}, denAs: "driver-managed", unit: "ms"},
	{label: "submit → running, native volume: driver=exec vs driver=csi", bench: "VolumeJobRun",
		num: []string{"native-exec-ms"}, numAs: "exec",
		den: []string{"native-csi-ms"}, denAs: "csi", unit: "ms"},
	{label: "50 volume tasks at once: submit → all running vs one volume task", bench: "Volumes",
		num: []string{"many-ms"}, numText: `^\d+ volume tasks at once: submit->all running\s+(\S+)`, numAs: "50 tasks",
		den: []string{"one-ms"}, denText: `^1 volume task: submit->running\s+(\S+)`, denAs: "1 task", unit: "ms"},
	{label: "49 volume tasks beside one hung NodeStage vs without (slowest)", bench: "Volumes",
		num: []string{"hung-slowest-ms"}, numText: `^\d+ beside 1 hung NodeStage: median / slowest\s+\S+ / (\S+)`, numAs: "beside hung",
		den: []string{"slowest-ms"}, denText: `^first \d+ of those: median / slowest\s+\S+ / (\S+)`, denAs: "without", unit: "ms"},
	{label: "driver RSS: 50 volume tasks vs idle", bench: "Volumes",
		num: []string{"rss-busy-MiB"}, numText: `^driver RSS, \d+ volume tasks running\s+([\d.]+ MiB)`, numAs: "50 tasks",
		den: []string{"rss-idle-MiB"}, denText: `^driver RSS, idle.*?\s+([\d.]+ MiB)`, denAs: "idle", unit: "MiB"},
	{label: "500 tasks at once on one node: submit → all running, csi volume tasks vs raw_exec", bench: "ManyTasks",
		num: []string{"many-csi-ms"}, numAs: "csi", den: []string{"many-raw-ms"}, denAs: "raw_exec", unit: "ms"},
	{label: "500 tasks at once: stop → all volumes torn down vs raw_exec's stop → all dead", bench: "ManyTasks",
		num: []string{"many-csi-stop-ms"}, numAs: "csi", den: []string{"many-raw-stop-ms"}, denAs: "raw_exec", unit: "ms"},
	{label: "500 tasks at once: csi stop vs raw_exec's stop + the plugin's own teardown of the 500 volumes at once", bench: "ManyTasks",
		num: []string{"many-csi-stop-ms"}, numAs: "csi", den: []string{"many-stop-floor-ms"}, denAs: "raw_exec + teardown floor", unit: "ms"},
	{label: "500 tasks at once: driver RSS with the 500 csi tasks vs idle", bench: "ManyTasks",
		num: []string{"many-driver-MiB"}, numAs: "500 tasks", den: []string{"idle-driver-MiB"}, denAs: "idle", unit: "MiB"},
	{label: "500 tasks at once: PSS per task, csi supervisor vs raw_exec executor", bench: "ManyTasks",
		num: []string{"supervisor-pss-MiB"}, numAs: "supervisor", den: []string{"executor-pss-MiB"}, denAs: "executor", unit: "MiB"},
	{label: "submit → running, sleep task: csi vs exec", bench: "DriverOverhead",
		num: []string{"csi-ms"}, numAs: "csi", den: []string{"exec-ms"}, denAs: "exec", unit: "ms"},
	{label: "submit → running, sleep task: csi vs raw_exec", bench: "DriverOverhead",
		num: []string{"csi-ms"}, numAs: "csi", den: []string{"raw_exec-ms"}, denAs: "raw_exec", unit: "ms"},
	{label: "submit → running, sleep task: isolated vs privileged (csi, both root)", bench: "DriverOverhead",
		num: []string{"csi-root-ms"}, numAs: "isolated", den: []string{"csi-privileged-ms"}, denAs: "privileged", unit: "ms"},
	{label: "volume task start (Staging event → Started): stats loop (1 s, 10 busy volumes) and metrics on vs both off", bench: "VolumeTelemetry",
		num: []string{"on-window-ms"}, numAs: "on", den: []string{"off-window-ms"}, denAs: "off", unit: "ms"},
	{label: "submit → running, volume task: stats loop and metrics on vs both off", bench: "VolumeTelemetry",
		num: []string{"on-one-ms"}, numAs: "on", den: []string{"off-one-ms"}, denAs: "off", unit: "ms"},
	{label: "FUSE plugin killed: plugin healthy again → dead mount repaired in the running task vs the volume's first setup", bench: "RepairStale",
		num: []string{"repair-ms"}, numAs: "repair", den: []string{"setup-ms"}, denAs: "Staging → Published", unit: "ms"},
	{label: "submit → plugin healthy on 3 clients: native csi_plugin vs driver-managed", bench: "ClusterPluginHealth",
		num: []string{"native-ms"}, numAs: "native", den: []string{"driver-ms"}, denAs: "driver-managed", unit: "ms"},
	{label: "drain of a client with 3 workloads: with a driver-managed volume each vs without", bench: "ClusterDrain",
		num: []string{"drain-volumes-ms"}, numAs: "with volumes", den: []string{"drain-plain-ms"}, denAs: "without", unit: "ms"},
	{label: "CSI plugin task from its image, warm: StartTask vs podman run --privileged -d (target ≤ 0.3)", bench: "ImageStart",
		num: []string{"warm-start-ms"}, numAs: "csi", den: []string{"podman-run-ms"}, denAs: "podman run", unit: "ms"},
	{label: "CSI plugin task from its image, cold: StartTask (pull + unpack + start) vs podman pull + run (target ≤ 0.8)", bench: "ImageStart",
		num: []string{"cold-start-ms"}, numAs: "csi", den: []string{"podman-pull-run-ms"}, denAs: "podman pull + run", unit: "ms"},
	{label: "CSI plugin task StartTask: warm image vs host binary (target ≤ 1.2)", bench: "ImageStart",
		num: []string{"warm-start-ms"}, numAs: "image", den: []string{"binary-start-ms"}, denAs: "binary", unit: "ms"},
	{label: "submit → running, CSI plugin task: warm image vs host binary", bench: "ImageStart",
		num: []string{"warm-run-ms"}, numAs: "image", den: []string{"binary-run-ms"}, denAs: "binary", unit: "ms"},
	{label: "image store, two images sharing their base layer: bytes stored vs the images' sizes summed", bench: "ImageStart",
		num: []string{"store-MiB"}, numAs: "stored", den: []string{"images-sum-MiB"}, denAs: "summed", unit: "MiB"},
}

// order is the order the benchmarks run in; others follow by name.
var order = []string{"DriverOverhead", "PluginHealth", "VolumeJobRun", "Volumes"}

// result is what one benchmark run gave.
type result struct {
	name     string
	metrics  map[string]float64
	units    []string // in the order reported
	elapsed  time.Duration
	err      error
	logPath  string
	textTail string
	lines    []string // everything it printed
}

func main() {
	runs := flag.Int("runs", 0, "measured runs per set-up, passed to benchmarks that take -runs or -*-runs (0: their default)")
	only := flag.String("bench", ".", "run only the benchmarks whose name matches this regexp")
	timeout := flag.Duration("timeout", 60*time.Minute, "give up on the whole run after this long")
	out := flag.String("out", "", "write the table here too (default build/bench.md)")
	flag.Parse()
	if err := run(*runs, *only, *timeout, *out); err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
}

func run(runs int, only string, timeout time.Duration, out string) error {
	started := time.Now()
	deadline := started.Add(timeout)
	match, err := regexp.Compile(only)
	if err != nil {
		return fmt.Errorf("-bench: %w", err)
	}
	root, err := e2e.RepoRoot()
	if err != nil {
		return err
	}
	if err := e2e.CheckPrerequisites(root); err != nil {
		return err
	}
	if out == "" {
		out = filepath.Join(root, "build", "bench.md")
	}
	logDir := filepath.Join(root, "build", "bench-logs")
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return err
	}

	progress("building the driver into %s", e2e.PluginDir(root))
	if err := e2e.BuildDriver(root); err != nil {
		return err
	}
	bin := filepath.Join(root, "build", "bench.test")
	progress("building the benchmarks into %s", bin)
	build := exec.Command("go", "test", "-tags", "e2e", "-c", "-o", bin, "./e2e/bench")
	build.Dir = root
	if b, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("failed to build the benchmarks: %w\n%s", err, b)
	}
	names, err := listBenchmarks(bin)
	if err != nil {
		return err
	}
	flags := benchFlags(bin, runs)

	var results []*result
	for _, name := range names {
		if !match.MatchString(name) {
			continue
		}
		left := time.Until(deadline)
		if left < 30*time.Second {
			results = append(results, &result{name: name, err: errors.New("skipped: out of time")})
			continue
		}
		progress("running Benchmark%s (%d s left of the %v budget)", name, int(left.Seconds()), timeout)
		r := runBenchmark(root, bin, name, flags, left, logDir)
		if r.err != nil {
			progress("Benchmark%s failed after %v: %v (log: %s)", name, r.elapsed.Round(time.Second), r.err, r.logPath)
		} else {
			progress("Benchmark%s done in %v", name, r.elapsed.Round(time.Second))
		}
		results = append(results, r)
	}

	table := render(root, names, results, time.Since(started))
	fmt.Print(table)
	if err := os.WriteFile(out, []byte(table), 0o644); err != nil {
		return err
	}
	progress("table written to %s", out)
	var failed []string
	for _, r := range results {
		if r.err != nil {
			failed = append(failed, r.name)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("benchmarks failed or skipped: %s", strings.Join(failed, ", "))
	}
	return nil
}

func progress(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "==> "+format+"\n", args...)
}

// listBenchmarks returns the benchmark names (without "Benchmark") in run
// order.
func listBenchmarks(bin string) ([]string, error) {
	b, err := exec.Command(bin, "-test.list", "^Benchmark").Output()
	if err != nil {
		return nil, fmt.Errorf("failed to list the benchmarks in %s: %w", bin, err)
	}
	var names []string
	for _, line := range strings.Split(string(b), "\n") {
		if n, ok := strings.CutPrefix(strings.TrimSpace(line), "Benchmark"); ok && n != "" {
			names = append(names, n)
		}
	}
	rank := func(n string) int {
		for i, o := range order {
			if o == n {
				return i
			}
		}
		return len(order)
	}
	sort.SliceStable(names, func(i, j int) bool {
		if ri, rj := rank(names[i]), rank(names[j]); ri != rj {
			return ri < rj
		}
		return names[i] < names[j]
	})
	if len(names) == 0 {
		return nil, fmt.Errorf("no benchmarks in %s", bin)
	}
	return names, nil
}

// benchFlags passes -runs on to every run-count flag the test binary has.
func benchFlags(bin string, runs int) []string {
	if runs <= 0 {
		return nil
	}
	b, _ := exec.Command(bin, "-h").CombinedOutput()
	var out []string
	for _, m := range regexp.MustCompile(`(?m)^\s+-([a-z0-9-]*runs)\b`).FindAllStringSubmatch(string(b), -1) {
		out = append(out, fmt.Sprintf("-%s=%d", m[1], runs))
	}
	return out
}

var resultLine = regexp.MustCompile(`^Benchmark(\S+?)(?:-\d+)?\s+\d+\s+(.*)$`)

// runBenchmark runs one benchmark in its own process, with its output
// streamed to a log file, and parses its result line.
func runBenchmark(root, bin, name string, flags []string, left time.Duration, logDir string) *result {
	r := &result{name: name, metrics: map[string]float64{}, logPath: filepath.Join(logDir, name+".log")}
	start := time.Now()
	defer func() { r.elapsed = time.Since(start) }()
	logFile, err := os.Create(r.logPath)
	if err != nil {
		r.err = err
		return r
	}
	defer logFile.Close()

	// The test binary's own timeout panics with every goroutine's stack,
	// and the harness's agents get SIGTERM when it dies; the context is a
	// backstop a little later.
	ctx, cancel := context.WithTimeout(context.Background(), left+30*time.Second)
	defer cancel()
	args := append([]string{"-test.run", "^$", "-test.bench", "^Benchmark" + name + "$", "-test.benchtime", "1x",
		"-test.timeout", left.Round(time.Second).String()}, flags...)
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = filepath.Join(root, "e2e", "bench")
	cmd.Env = append(os.Environ(), "E2E_SKIP_BUILD=1")
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	fmt.Fprintf(logFile, "$ %s %s\n", bin, strings.Join(args, " "))

	var wg sync.WaitGroup
	var tail []string
	wg.Add(1)
	go func() {
		defer wg.Done()
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(logFile, line)
			r.lines = append(r.lines, line)
			tail = append(tail, line)
			if len(tail) > 30 {
				tail = tail[1:]
			}
			if m := resultLine.FindStringSubmatch(line); m != nil && m[1] == name {
				parseMetrics(m[2], r)
			}
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	err = cmd.Run()
	pw.Close()
	wg.Wait()
	r.textTail = strings.Join(tail, "\n")
	switch {
	case err != nil:
		r.err = fmt.Errorf("%w; last lines:\n%s", err, r.textTail)
	case len(r.metrics) == 0:
		r.err = fmt.Errorf("no result line (skipped?); last lines:\n%s", r.textTail)
	}
	return r
}

// parseMetrics reads "123 ns/op  4.5 csi-ms ..." value/unit pairs.
func parseMetrics(s string, r *result) {
	f := strings.Fields(s)
	for i := 0; i+1 < len(f); i += 2 {
		v, err := strconv.ParseFloat(f[i], 64)
		if err != nil {
			continue
		}
		if _, seen := r.metrics[f[i+1]]; !seen {
			r.units = append(r.units, f[i+1])
		}
		r.metrics[f[i+1]] = v
	}
}

// render makes the markdown table and what is around it.
func render(root string, listed []string, results []*result, elapsed time.Duration) string {
	inBinary := map[string]bool{}
	for _, n := range listed {
		inBinary[n] = true
	}
	byName := map[string]*result{}
	for _, r := range results {
		byName[r.name] = r
	}
	used := map[string]map[string]bool{}
	lookup := func(bench string, names []string, text, unit string) (float64, bool) {
		r := byName[bench]
		if r == nil || r.err != nil {
			return 0, false
		}
		for _, n := range names {
			if v, ok := r.metrics[n]; ok {
				if used[bench] == nil {
					used[bench] = map[string]bool{}
				}
				used[bench][n] = true
				return v, true
			}
		}
		if text == "" {
			return 0, false
		}
		re := regexp.MustCompile(text)
		for _, line := range r.lines {
			if m := re.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
				return parseValue(m[1], unit)
			}
		}
		return 0, false
	}

	var b strings.Builder
	fmt.Fprintf(&b, "# nomad-driver-csi benchmarks\n\n")
	fmt.Fprintf(&b, "%s, commit %s, %d CPUs, %s. Each ratio is measured side by side in one benchmark (one agent, runs interleaved); medians beside it. Total %v.\n\n",
		time.Now().Format("2006-01-02 15:04 MST"), gitDescribe(root), runtime.NumCPU(), nomadVersion(root), elapsed.Round(time.Second))
	fmt.Fprintf(&b, "| measurement | ratio | medians | benchmark |\n")
	fmt.Fprintf(&b, "| --- | ---: | --- | --- |\n")
	for _, rw := range rows {
		r := byName[rw.bench]
		status := ""
		switch {
		case r == nil && inBinary[rw.bench]:
			status = "not selected (-bench)"
		case r == nil:
			status = "not run (no Benchmark" + rw.bench + ")"
		case r.err != nil:
			status = "failed: see build/bench-logs/" + rw.bench + ".log"
		}
		num, okN := lookup(rw.bench, rw.num, rw.numText, rw.unit)
		var den float64
		okD := len(rw.den) == 0
		if len(rw.den) > 0 {
			den, okD = lookup(rw.bench, rw.den, rw.denText, rw.unit)
		}
		ratio, medians := "—", ""
		switch {
		case status != "":
			medians = status
		case !okN || !okD:
			medians = "metric not reported (" + strings.Join(append(append([]string{}, rw.num...), rw.den...), ", ") + ")"
		case len(rw.den) == 0:
			medians = fmt.Sprintf("%s: %s", rw.numAs, human(num, rw.unit))
		default:
			if den != 0 {
				ratio = formatRatio(num / den)
			}
			medians = fmt.Sprintf("%s %s / %s %s", rw.numAs, human(num, rw.unit), rw.denAs, human(den, rw.unit))
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", rw.label, ratio, medians, rw.bench)
	}

	// Whatever else the benchmarks reported.
	var extra []string
	for _, r := range results {
		if r.err != nil {
			extra = append(extra, fmt.Sprintf("- Benchmark%s: **%s** (log: build/bench-logs/%s.log)", r.name, firstLine(r.err.Error()), r.name))
			continue
		}
		var parts []string
		for _, u := range r.units {
			if u == "ns/op" || used[r.name][u] {
				continue
			}
			parts = append(parts, fmt.Sprintf("%s %s", strconv.FormatFloat(r.metrics[u], 'f', -1, 64), u))
		}
		line := fmt.Sprintf("- Benchmark%s (%v)", r.name, r.elapsed.Round(time.Second))
		if len(parts) > 0 {
			line += ": " + strings.Join(parts, ", ")
		}
		extra = append(extra, line)
	}
	if len(extra) > 0 {
		fmt.Fprintf(&b, "\nBenchmarks run (and their other metrics):\n\n%s\n", strings.Join(extra, "\n"))
	}
	fmt.Fprintf(&b, "\nCommand: `make bench` (`go run -tags e2e ./e2e/bench/cmd/benchtable`); full outputs in build/bench-logs/.\n")
	return b.String()
}

// formatRatio keeps two significant digits for ratios far below 1.
func formatRatio(r float64) string {
	if r < 0.1 {
		return fmt.Sprintf("%.2g×", r)
	}
	return fmt.Sprintf("%.2f×", r)
}

// parseValue reads a value printed in a benchmark's table: a Go duration
// (as milliseconds) or "N MiB".
func parseValue(s, unit string) (float64, bool) {
	switch unit {
	case "ms":
		d, err := time.ParseDuration(s)
		if err != nil {
			return 0, false
		}
		return float64(d.Microseconds()) / 1000, true
	case "MiB":
		v, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(s, "MiB")), 64)
		return v, err == nil
	}
	return 0, false
}

func human(v float64, unit string) string {
	switch unit {
	case "ms":
		if v >= 1000 {
			return fmt.Sprintf("%.2f s", v/1000)
		}
		if v >= 10 {
			return fmt.Sprintf("%.0f ms", v)
		}
		return fmt.Sprintf("%.2f ms", v)
	case "MiB":
		return fmt.Sprintf("%.1f MiB", v)
	}
	return strconv.FormatFloat(v, 'g', 4, 64) + " " + unit
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return strings.TrimSuffix(line, "; last lines:")
}

func gitDescribe(root string) string {
	cmd := exec.Command("git", "describe", "--always", "--dirty")
	cmd.Dir = root
	b, err := cmd.Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}

func nomadVersion(root string) string {
	b, err := exec.Command(e2e.NomadBinary(root), "version").Output()
	if err != nil {
		return "Nomad (unknown version)"
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return line
}
