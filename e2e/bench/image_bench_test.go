//go:build e2e

package bench

// BenchmarkImageStart measures a CSI plugin task that runs from its image,
// side by side in one run, against the same local registry (Debian's
// docker-registry with TLS and basic auth, e2e.StartRegistry) and the same
// image (the e2e fixture plugin with its tools, imagebuild.FixturePlugin):
//
//   - cold: the image is not in the driver's store (removed with the CLI's
//     "images rm" before each run), so the start pulls, unpacks and starts;
//   - warm: the image is in the store;
//   - binary: the same plugin from the host's build/csi/csi-fixture;
//   - podman cold: "podman pull" + "podman run --privileged --detach" of
//     the image, removed from Podman's store before each run (Debian's
//     Podman 4.3, as root, runc, cgroupfs, rlimits this host allows);
//   - podman warm: "podman run --privileged --detach" alone.
//
// Each driver start is timed twice: submit → running (the task's StartedAt;
// it includes Nomad's scheduling and the task's hooks, which Podman has no
// counterpart of), and StartTask alone (the driver's "task started" log
// line says how long it took: the pull, the root, the process), which is
// what compares with Podman's commands. Medians of -runs runs, interleaved
// (the warm starts in turn order), after one unmeasured warm-up of each.
//
// Then the store's size with two images that share their base layer (the
// fixture's tools): the bytes under the store's layers/ against the sum of
// the two images' sizes, and the number of layer directories.
//
//	go test -tags e2e -run '^$' -bench ImageStart -benchtime 1x ./e2e/bench/ -args -runs 5

import (
	"encoding/json"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

func BenchmarkImageStart(b *testing.B) {
	root := setup(b, e2e.VolBuildCSIBinaries)
	fixture, err := e2e.CSIToolPath(root, "csi-fixture")
	if err != nil {
		b.Fatal(err)
	}
	reg := e2e.StartRegistry(b)
	plugin, err := imagebuild.FixturePlugin(fixture)
	if err != nil {
		b.Fatal(err)
	}
	ref, err := reg.Push("csi/fixture:bench", plugin)
	if err != nil {
		b.Fatal(err)
	}
	digest, err := plugin.Digest()
	if err != nil {
		b.Fatal(err)
	}
	// The plugin jobs from the image are granted privilege for its digest.
	grant := fmt.Sprintf("    privileged_grant {\n      namespace = \"*\"\n      job       = \"plugin_task-*\"\n      image     = %q\n    }\n",
		"fixture@"+digest.String())
	a := startIsolationAgent(b, e2e.AgentOptions{Grants: grant, DriverConfig: fmt.Sprintf(
		"    registry_ca_file = %q\n    auth {\n      config = %q\n    }\n    image_gc = \"0\"", reg.CAFile, reg.DockerConfig(b, reg.Password))})
	pm := newPodman(b, reg.CAFile)
	creds := reg.Username + ":" + reg.Password
	podmanArgs := []string{"--endpoint", "unix:///tmp/csi.sock", "--state-dir", "/tmp/state", "--node-id", "bench"}

	n := 0
	start := func(img, command string) (submitToRunning, startTask time.Duration) {
		n++
		id := fmt.Sprintf("img-bench-%d", n)
		return imStartPlugin(b, a, id, img, command)
	}
	cold := func() (time.Duration, time.Duration) {
		imRemoveImage(b, a, ref)
		return start(ref, "")
	}
	warm := func() (time.Duration, time.Duration) { return start(ref, "") }
	pinned := strings.TrimSuffix(ref, ":bench") + "@" + digest.String()
	warmPinned := func() (time.Duration, time.Duration) { return start(pinned, "") }
	binary := func() (time.Duration, time.Duration) { return start("", fixture) }
	podmanCold := func() time.Duration {
		pm.removeImage(b, ref)
		return pm.pull(b, ref, creds) + pm.runPrivileged(b, ref, podmanArgs...)
	}
	podmanWarm := func() time.Duration { return pm.runPrivileged(b, ref, podmanArgs...) }

	// Warm-up: each once, unmeasured (the page cache, the first exec).
	pm.pull(b, ref, creds)
	podmanWarm()
	cold()
	warm()
	warmPinned()
	binary()

	var coldRun, coldStart, warmRun, warmStart, pinRun, pinStart, binRun, binStart, pmCold, pmWarm []time.Duration
	// The three warm starts take turns at going first after the cold one,
	// whose unpacking leaves the disk busy writing back: always first,
	// the warm image start paid for it and the binary's never did.
	type variant struct {
		start    func() (time.Duration, time.Duration)
		run, tsk *[]time.Duration
	}
	variants := []variant{{warm, &warmRun, &warmStart}, {warmPinned, &pinRun, &pinStart}, {binary, &binRun, &binStart}}
	for i := 0; i < *runs; i++ {
		r, s := cold()
		coldRun, coldStart = append(coldRun, r), append(coldStart, s)
		for j := range variants {
			v := variants[(i+j)%len(variants)]
			r, s := v.start()
			*v.run, *v.tsk = append(*v.run, r), append(*v.tsk, s)
		}
		pmCold = append(pmCold, podmanCold())
		pmWarm = append(pmWarm, podmanWarm())
	}

	// Two images on one base layer: the store keeps it once.
	other, err := imOtherImage(plugin)
	if err != nil {
		b.Fatal(err)
	}
	otherRef, err := reg.Push("csi/other:bench", other)
	if err != nil {
		b.Fatal(err)
	}
	imPull(b, a, reg, otherRef)
	infos := imList(b, a)
	var sum int64
	for _, in := range infos {
		sum += in.Size
	}
	stored, layerDirs := imStoreLayers(b, a)

	med := func(ds []time.Duration) float64 { return float64(median(ds).Microseconds()) / 1000 }
	report := map[string]float64{
		"cold-run-ms": med(coldRun), "cold-start-ms": med(coldStart),
		"warm-run-ms": med(warmRun), "warm-start-ms": med(warmStart),
		"pinned-run-ms": med(pinRun), "pinned-start-ms": med(pinStart),
		"binary-run-ms": med(binRun), "binary-start-ms": med(binStart),
		"podman-pull-run-ms": med(pmCold), "podman-run-ms": med(pmWarm),
		"store-MiB": float64(stored) / (1 << 20), "images-sum-MiB": float64(sum) / (1 << 20),
		"layer-dirs": float64(layerDirs), "images": float64(len(infos)),
	}
	for k, v := range report {
		b.ReportMetric(v, k)
	}
	ratio := func(x, y float64) string {
		if y == 0 {
			return "n/a"
		}
		return fmt.Sprintf("%.2f", x/y)
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%-58s %s\n", "metric (medians of "+fmt.Sprint(*runs)+" runs)", "value")
	fmt.Fprintf(&sb, "%-58s %s\n", strings.Repeat("-", 58), strings.Repeat("-", 24))
	row := func(name string, ds []time.Duration) {
		fmt.Fprintf(&sb, "%-58s %v  (runs: %s)\n", name, median(ds).Round(time.Millisecond), list(ds))
	}
	row("image plugin, cold: StartTask (pull+unpack+start)", coldStart)
	row("image plugin, warm: StartTask", warmStart)
	row("image plugin by digest, warm: StartTask", pinStart)
	row("host binary plugin: StartTask", binStart)
	row("image plugin, cold: submit->running", coldRun)
	row("image plugin, warm: submit->running", warmRun)
	row("image plugin by digest, warm: submit->running", pinRun)
	row("host binary plugin: submit->running", binRun)
	row("podman pull + run --privileged -d", pmCold)
	row("podman run --privileged -d", pmWarm)
	fmt.Fprintf(&sb, "%-58s %s (target <= 0.3)\n", "ratio warm StartTask / podman run", ratio(med(warmStart), med(pmWarm)))
	fmt.Fprintf(&sb, "%-58s %s (target <= 0.8)\n", "ratio cold StartTask / podman pull+run", ratio(med(coldStart), med(pmCold)))
	fmt.Fprintf(&sb, "%-58s %s (target <= 1.2)\n", "ratio warm image / host binary, StartTask", ratio(med(warmStart), med(binStart)))
	fmt.Fprintf(&sb, "%-58s %s\n", "ratio warm image by digest / host binary, StartTask", ratio(med(pinStart), med(binStart)))
	fmt.Fprintf(&sb, "%-58s %s\n", "ratio warm image / host binary, submit->running", ratio(med(warmRun), med(binRun)))
	fmt.Fprintf(&sb, "%-58s %.1f MiB in %d layer dirs vs %.1f MiB summed over %d images (%s)\n", "store, two images sharing a base layer",
		report["store-MiB"], layerDirs, report["images-sum-MiB"], len(infos), ratio(report["store-MiB"], report["images-sum-MiB"]))
	fmt.Print(sb.String())
}

// imStartPlugin runs the fixture as a privileged plugin task of its own
// plugin id, from img (a reference) or, when img is empty, from command on
// the host, and returns submit → running and how long StartTask took (the
// driver's log); the job is stopped and purged before it returns.
func imStartPlugin(b *testing.B, a *e2e.Agent, id, img, command string) (time.Duration, time.Duration) {
	b.Helper()
	cmd := command
	if cmd == "" {
		cmd = "/unused" // replaced by the image below
	}
	job, err := a.RenderJob("plugin_task", map[string]string{
		"Command": cmd, "Args": e2e.HCLList("--state-dir", filepath.Join(a.Dir, "state-"+id), "--node-id", "bench"),
		"Privileged": "true", "PluginID": id, "Type": "monolith",
	})
	if err != nil {
		b.Fatal(err)
	}
	var tweak func(map[string]any)
	if img != "" {
		tweak = func(task map[string]any) {
			config, _ := task["Config"].(map[string]any)
			delete(config, "command")
			config["image"] = img
		}
	}
	t0 := time.Now()
	register(b, a, job, tweak)
	started, allocID := waitTaskRunning(b, a, job.ID, "plugin", 3*time.Minute)
	stop(b, a, job.ID)
	return started.Sub(t0), imStartTaskDuration(b, a, allocID)
}

// waitTaskRunning waits until an allocation of the job has task running
// and returns its StartedAt and the allocation's ID; an allocation that
// ends first fails the benchmark, and so does the timeout, describing the
// allocation.
func waitTaskRunning(b *testing.B, a *e2e.Agent, jobID, task string, timeout time.Duration) (time.Time, string) {
	b.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		allocs, err := a.JobAllocations(jobID)
		if err == nil {
			for _, al := range allocs {
				if e2e.IsTerminal(al.ClientStatus) {
					b.Fatalf("allocation of %s ended while starting:\n%s", jobID, a.Allocation(b, al.ID).Describe())
				}
				if ts := al.TaskStates[task]; ts != nil && ts.State == "running" && !ts.StartedAt.IsZero() {
					return ts.StartedAt, al.ID
				}
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	allocs, _ := a.JobAllocations(jobID)
	desc := "no allocation"
	if len(allocs) > 0 {
		desc = a.Allocation(b, allocs[0].ID).Describe()
	}
	b.Fatalf("job %s: task %s not running after %v:\n%s", jobID, task, timeout, desc)
	return time.Time{}, ""
}

var imVerbose = flag.Bool("image-steps", false, "log, for each image task, the time from the image's pull to the task's start")

// imTimestamp is the driver's own timestamp of a log line (its JSON
// "timestamp", which the agent prints as timestamp=...).
func imTimestamp(line string) time.Time {
	i := strings.LastIndex(line, " timestamp=")
	if i < 0 {
		return time.Time{}
	}
	t, _ := time.Parse(time.RFC3339Nano, strings.Fields(line[i+len(" timestamp="):])[0])
	return t
}

// imDuration is the duration in the driver's "task started" log line.
var imDuration = regexp.MustCompile(` duration=(\S+)`)

// imStartTaskDuration reads how long StartTask took for the allocation's
// task from the agent's log (the driver's "task started" line).
func imStartTaskDuration(b *testing.B, a *e2e.Agent, allocID string) time.Duration {
	b.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		log, err := a.ReadLog()
		if err != nil {
			b.Fatal(err)
		}
		var ready time.Time
		for _, line := range strings.Split(log, "\n") {
			if strings.Contains(line, "image ready:") && strings.Contains(line, " alloc_id="+allocID) {
				ready = imTimestamp(line)
			}
			if !strings.Contains(line, "task started:") || !strings.Contains(line, " alloc_id="+allocID) {
				continue
			}
			if !ready.IsZero() && *imVerbose {
				b.Logf("allocation %s: image ready -> task started %v", allocID, imTimestamp(line).Sub(ready))
			}
			m := imDuration.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			d, err := time.ParseDuration(strings.Trim(m[1], `"`))
			if err != nil {
				b.Fatalf("bad duration in %q: %v", line, err)
			}
			return d
		}
		if time.Now().After(deadline) {
			b.Fatalf("no \"task started\" line for allocation %s in the agent's log", allocID)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// imCLI runs the driver's binary as the operator's CLI on the agent's
// root_dir.
func imCLI(b *testing.B, a *e2e.Agent, args ...string) string {
	b.Helper()
	cmd := exec.Command(filepath.Join(e2e.PluginDir(a.Root), "nomad-driver-csi"), append(args, "-root-dir", a.DriverRoot)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "NOMAD_PLUGIN_MAGIC_COOKIE=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		b.Fatalf("nomad-driver-csi %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// imRemoveImage removes ref from the driver's store (no task uses it: the
// last job was purged); a store that lacks it is fine.
func imRemoveImage(b *testing.B, a *e2e.Agent, ref string) {
	b.Helper()
	for _, in := range imList(b, a) {
		for _, r := range in.Refs {
			if r == ref {
				imCLI(b, a, "images", "rm", in.Digest)
				return
			}
		}
	}
}

// imPull pulls ref into the driver's store with the CLI, as the driver
// would (the registry's CA and credentials).
func imPull(b *testing.B, a *e2e.Agent, reg *e2e.TestRegistry, ref string) {
	b.Helper()
	imCLI(b, a, "images", "pull", "-registry-ca-file", reg.CAFile, "-auth-config", reg.DockerConfig(b, reg.Password), ref)
}

// imList lists the driver's store.
func imList(b *testing.B, a *e2e.Agent) []image.Info {
	b.Helper()
	out := imCLI(b, a, "images", "-json")
	var v struct{ Images []image.Info }
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		b.Fatalf("images -json: %v: %s", err, out)
	}
	return v.Images
}

// imStoreLayers is the bytes the store's layers take on disk (each inode
// once, in blocks as du counts them) and the number of layer directories.
func imStoreLayers(b *testing.B, a *e2e.Agent) (int64, int) {
	b.Helper()
	dir := filepath.Join(image.Dir(a.DriverRoot), "layers")
	entries, err := os.ReadDir(dir)
	if err != nil {
		b.Fatal(err)
	}
	seen := map[uint64]bool{}
	var total int64
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok || seen[st.Ino] {
			return nil
		}
		seen[st.Ino] = true
		total += st.Blocks * 512
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	return total, len(entries)
}

// imOtherImage is a second image on the fixture's base layer (its tools)
// with another top layer.
func imOtherImage(plugin v1.Image) (v1.Image, error) {
	layers, err := plugin.Layers()
	if err != nil {
		return nil, err
	}
	top, err := imagebuild.Layer(imagebuild.File("usr/local/share/other", []byte(strings.Repeat("other image\n", 4096)), 0o644))
	if err != nil {
		return nil, err
	}
	return imagebuild.Build(imagebuild.Spec{Entrypoint: []string{"/bin/true"}}, layers[0], top)
}
