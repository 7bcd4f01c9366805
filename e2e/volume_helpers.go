//go:build e2e

package e2e

// Helpers for the CSI volume cases (volume_test.go) and the volume
// benchmarks (e2e/bench): a csi-fixture plugin run as a task of the driver
// (jobs/volume_plugin.hcl), workload jobs with volume blocks
// (jobs/volume_task.hcl), the fixture's call log, the driver's journal and
// the mounts under the driver's root.

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// VolCSIBinDir is where e2e/tools/build.sh puts the CSI test binaries.
func VolCSIBinDir(root string) string { return filepath.Join(root, "build", "csi") }

// VolBuildCSIBinaries runs e2e/tools/build.sh, which rebuilds only what is
// out of date.
func VolBuildCSIBinaries(root string) error {
	cmd := exec.Command(filepath.Join(root, "e2e", "tools", "build.sh"))
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("e2e/tools/build.sh failed: %w\n%s", err, out)
	}
	return nil
}

// VolFixtureOptions shape one csi-fixture plugin task.
type VolFixtureOptions struct {
	// Type is the csi_plugin type: monolith (default) or node.
	Type string
	// Args are extra fixture flags (--controller-publish, --hang METHOD...).
	Args []string
	// RestartDelay is the restart delay of the plugin task (default 1s).
	RestartDelay time.Duration
	// MemoryMB is the plugin task's memory (default 128).
	MemoryMB int
	// CPU is the plugin task's cpu in MHz (default 100), which is also
	// its CPU weight against the other tasks.
	CPU int
}

// VolFixture is a csi-fixture running as a plugin task of the agent.
type VolFixture struct {
	ID       string
	JobID    string
	AllocID  string
	StateDir string // --state-dir: the fixture's volumes and records
	CallLog  string // --log-calls: one line "Method volume_id" per RPC
	agent    *Agent
	t        testing.TB // fails when the call log cannot be read
}

// StartVolFixture runs build/csi/csi-fixture as a plugin task with id
// and waits until the node reports the plugin healthy. Its state lives in
// the agent's directory, so Close removes it.
func (a *Agent) StartVolFixture(t testing.TB, id string, opts VolFixtureOptions) *VolFixture {
	t.Helper()
	dir := filepath.Join(a.Dir, "fx-"+id)
	p := &VolFixture{
		ID:       id,
		StateDir: filepath.Join(dir, "state"),
		CallLog:  filepath.Join(dir, "calls.log"),
		agent:    a,
		t:        t,
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("%v", err)
	}
	args := append([]string{"--state-dir", p.StateDir, "--node-id", "e2e-node", "--log-calls", p.CallLog}, opts.Args...)
	p.JobID, p.AllocID = a.startVolPlugin(t, id, opts, filepath.Join(VolCSIBinDir(a.Root), "csi-fixture"), args)
	return p
}

// StartVolMock runs csi-test's mock driver (build/csi/csi-mock-driver)
// behind csi-targetshim (e2e/targetshim), which makes the target paths
// the mock does not, as a plugin task with id, and waits until the node
// reports it healthy: a plugin that stages and publishes by recording
// the call and making a directory, mounts nothing, and whose calls cost
// about a socket round trip. It runs without ControllerPublishVolume
// (--disable-attach: stage and publish only, as the fixture) and with no
// limit of volumes per node (--attach-limit=0). Only the ID, JobID and
// AllocID of what it returns are set: the mock keeps no call log or
// state directory.
func (a *Agent) StartVolMock(t testing.TB, id string, opts VolFixtureOptions) *VolFixture {
	t.Helper()
	bin := VolCSIBinDir(a.Root)
	args := append([]string{filepath.Join(bin, "csi-mock-driver"), "--disable-attach", "--attach-limit=0"}, opts.Args...)
	p := &VolFixture{ID: id, agent: a, t: t}
	p.JobID, p.AllocID = a.startVolPlugin(t, id, opts, filepath.Join(bin, "csi-targetshim"), args)
	return p
}

// startVolPlugin runs command as a plugin task with id (job volume_plugin)
// and waits until the node reports the plugin healthy.
func (a *Agent) startVolPlugin(t testing.TB, id string, opts VolFixtureOptions, command string, args []string) (jobID, allocID string) {
	t.Helper()
	if opts.Type == "" {
		opts.Type = "monolith"
	}
	if opts.RestartDelay == 0 {
		opts.RestartDelay = time.Second
	}
	if opts.MemoryMB == 0 {
		opts.MemoryMB = 128
	}
	if opts.CPU == 0 {
		opts.CPU = 100
	}
	job := a.RunJob(t, "volume_plugin", map[string]string{
		"CPU":          strconv.Itoa(opts.CPU),
		"PluginID":     id,
		"PluginType":   opts.Type,
		"Command":      command,
		"Args":         volHCLList(args),
		"RestartDelay": opts.RestartDelay.String(),
		"Memory":       strconv.Itoa(opts.MemoryMB),
	})
	al := a.WaitAlloc(t, job.ID, time.Minute, StatusRunning)
	a.WaitVolPluginHealthy(t, id, time.Minute)
	return job.ID, al.ID
}

// WaitVolPluginHealthy waits until the node says driver.csi.plugin.<id>.healthy
// is true.
func (a *Agent) WaitVolPluginHealthy(t testing.TB, id string, timeout time.Duration) {
	t.Helper()
	key := "driver.csi.plugin." + id + ".healthy"
	deadline := time.Now().Add(Scaled(timeout))
	var last string
	for time.Now().Before(deadline) {
		if n, err := a.node(); err == nil {
			last = n.Attributes[key]
			if d := n.Drivers[DriverName]; d != nil && d.Attributes[key] != "" {
				last = d.Attributes[key]
			}
			if last == "true" {
				return
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("CSI plugin %s not healthy within %v (%s=%q); driver log:\n%s", id, timeout, key, last, a.driverLogLines(20))
}

// PID is the host PID of the fixture process (0 when it is not running).
func (p *VolFixture) PID() int {
	for _, pid := range TaskPIDs(p.AllocID, "plugin") {
		if pr, err := ReadProc(pid); err == nil && pr.Comm == "csi-fixture" {
			return pid
		}
	}
	return 0
}

// Calls returns the fixture's call log, one "Method volume_id" per RPC. The
// fixture makes the file when it starts: a log that cannot be read fails
// the test that started the fixture, so that no count reads as zero for
// want of a file.
func (p *VolFixture) Calls() []string {
	b, err := os.ReadFile(p.CallLog)
	if err != nil {
		p.t.Errorf("failed to read the call log of CSI plugin %s: %v", p.ID, err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if line != "" {
			out = append(out, line)
		}
	}
	return out
}

// Count counts the calls of method for volume id volID ("" for any).
func (p *VolFixture) Count(method, volID string) int {
	n := 0
	for _, c := range p.Calls() {
		m, v, _ := strings.Cut(c, " ")
		if m == method && (volID == "" || v == volID) {
			n++
		}
	}
	return n
}

// VolumeCalls lists the methods called for one volume id, in order.
func (p *VolFixture) VolumeCalls(volID string) []string {
	var out []string
	for _, c := range p.Calls() {
		if m, v, _ := strings.Cut(c, " "); v == volID {
			out = append(out, m)
		}
	}
	return out
}

// VolumeID is the id the fixture gave the volume it created under name
// ("" when there is none), from its records in the state dir.
func (p *VolFixture) VolumeID(name string) string {
	files, _ := filepath.Glob(filepath.Join(p.StateDir, "meta", "*.json"))
	for _, f := range files {
		var v struct {
			ID   string `json:"id"`
			Name string `json:"name"`
		}
		b, err := os.ReadFile(f)
		if err == nil && json.Unmarshal(b, &v) == nil && v.Name == name {
			return v.ID
		}
	}
	return ""
}

// VolSpec is one `volume "<name>"` block of a workload task.
type VolSpec struct {
	Name, Plugin, ID, Dest string
	Access, Attach         string // default single-node-writer, file-system
	ReadOnly               bool
	FSType                 string
	MountFlags             []string
	Context, Secrets       map[string]string
	// Create adds a create block; CreateType is its "type" parameter
	// (dir or ext4) and CapacityMin its size (default 64MiB for ext4).
	Create      bool
	CreateType  string
	CapacityMin string
	// MountGroup sets mount_group = true.
	MountGroup bool
	// SecretsFile sets secrets_file.
	SecretsFile string
	// Interpolate leaves "${...}" in values for Nomad to interpolate
	// (volume_id = "v-${NOMAD_ALLOC_INDEX}"); otherwise it is escaped.
	Interpolate bool
}

// HCL renders the block.
func (v VolSpec) HCL() string {
	var b strings.Builder
	fmt.Fprintf(&b, "        volume %s {\n", strconv.Quote(v.Name))
	attr := func(k, val string) {
		if val == "" {
			return
		}
		q := volHCLString(val)
		if v.Interpolate {
			q = strings.ReplaceAll(q, "$${", "${")
		}
		fmt.Fprintf(&b, "          %s = %s\n", k, q)
	}
	attr("plugin_id", v.Plugin)
	attr("volume_id", v.ID)
	attr("destination", v.Dest)
	attr("access_mode", v.Access)
	attr("attachment_mode", v.Attach)
	if v.ReadOnly {
		b.WriteString("          read_only = true\n")
	}
	if v.FSType != "" || len(v.MountFlags) > 0 {
		b.WriteString("          mount_options {\n")
		if v.FSType != "" {
			fmt.Fprintf(&b, "            fs_type = %s\n", volHCLString(v.FSType))
		}
		if len(v.MountFlags) > 0 {
			fmt.Fprintf(&b, "            mount_flags = %s\n", volHCLList(v.MountFlags))
		}
		b.WriteString("          }\n")
	}
	attr("secrets_file", v.SecretsFile)
	if v.MountGroup {
		b.WriteString("          mount_group = true\n")
	}
	volHCLMap(&b, "context", v.Context)
	volHCLMap(&b, "secrets", v.Secrets)
	if v.Create {
		b.WriteString("          create {\n")
		size := v.CapacityMin
		if size == "" && v.CreateType == "ext4" {
			size = "64MiB"
		}
		if size != "" {
			fmt.Fprintf(&b, "            capacity_min = %s\n", volHCLString(size))
		}
		if v.CreateType != "" {
			fmt.Fprintf(&b, "            parameters {\n              type = %s\n            }\n", volHCLString(v.CreateType))
		}
		b.WriteString("          }\n")
	}
	b.WriteString("        }\n")
	return b.String()
}

func volHCLMap(b *strings.Builder, name string, m map[string]string) {
	if len(m) == 0 {
		return
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	fmt.Fprintf(b, "          %s {\n", name)
	for _, k := range keys {
		fmt.Fprintf(b, "            %s = %s\n", k, volHCLString(m[k]))
	}
	b.WriteString("          }\n")
}

// volHCLString quotes s for HCL: JSON escapes, and "${" / "%{" written so
// that HCL does not interpolate them.
func volHCLString(s string) string {
	q, _ := json.Marshal(s)
	out := strings.ReplaceAll(string(q), "${", "$${")
	return strings.ReplaceAll(out, "%{", "%%{")
}

func volHCLList(items []string) string {
	parts := make([]string, len(items))
	for i, s := range items {
		parts[i] = volHCLString(s)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

// VolJob is a workload job rendered from jobs/volume_task.hcl: Count
// allocations of one task "t" running Script with /bin/sh -c.
type VolJob struct {
	Type    string // batch (default) or service
	Count   int    // default 1
	Script  string
	Volumes []VolSpec
	// Node places the job on the client node of this name (a constraint
	// on ${node.unique.name}); empty places it anywhere.
	Node string
	// User is the task's user; default root (the fixture's volumes
	// belong to root).
	User string
	// Template is HCL put in the task beside its config (template
	// blocks).
	Template string
}

func (j VolJob) vars() map[string]string {
	if j.Type == "" {
		j.Type = "batch"
	}
	if j.Count == 0 {
		j.Count = 1
	}
	var vols strings.Builder
	for _, v := range j.Volumes {
		vols.WriteString(v.HCL())
	}
	constraint := ""
	if j.Node != "" {
		constraint = fmt.Sprintf("    constraint {\n      attribute = \"${node.unique.name}\"\n      value     = %s\n    }\n", volHCLString(j.Node))
	}
	if j.User == "" {
		j.User = "root"
	}
	return map[string]string{
		"User":       j.User,
		"Template":   j.Template,
		"Type":       j.Type,
		"Count":      strconv.Itoa(j.Count),
		"Script":     volHCLString(j.Script),
		"Volumes":    vols.String(),
		"Constraint": constraint,
	}
}

// SubmitVolJob submits a workload job with "nomad job run -detach" and
// returns the CLI's answer without failing the test.
func (a *Agent) SubmitVolJob(t testing.TB, j VolJob) (Job, string, error) {
	t.Helper()
	return a.SubmitJob(t, "volume_task", j.vars())
}

// RunVolJob is SubmitVolJob that fails the test when the submission
// fails.
func (a *Agent) RunVolJob(t testing.TB, j VolJob) Job {
	t.Helper()
	return a.RunJob(t, "volume_task", j.vars())
}

// RenderVolJob renders a workload job without submitting it.
func (a *Agent) RenderVolJob(j VolJob) (Job, error) {
	return a.RenderJob("volume_task", j.vars())
}

// VolJournal reads the driver's journal (root_dir/journal) as it is now,
// while the driver runs: csihook.ReadJournal, read-only, without secrets.
func (a *Agent) VolJournal() (csihook.JournalState, error) {
	return csihook.ReadJournal(filepath.Join(a.DriverRoot, "journal"))
}

// VolJournalLeft lists, one line each, every volume and task record the
// driver's journal holds, any other file in the journal directory (such
// as a *.bad copy of a damaged log) and an error reading it: empty once
// every volume is torn down.
func (a *Agent) VolJournalLeft() []string {
	return a.volJournalLines(func(string) bool { return true })
}

// VolJournalMentions is VolJournalLeft for the records naming one of the
// volume ids; other files and errors are always listed.
func (a *Agent) VolJournalMentions(ids ...string) []string {
	return a.volJournalLines(func(id string) bool { return id != "" && slices.Contains(ids, id) })
}

func (a *Agent) volJournalLines(match func(volumeID string) bool) []string {
	var out []string
	st, err := a.VolJournal()
	if err != nil {
		out = append(out, err.Error())
	}
	for _, v := range st.Volumes {
		if match(v.VolumeID) {
			out = append(out, fmt.Sprintf("volume %s/%s stage=%q controller=%q", v.PluginID, v.VolumeID, v.Stage, v.Controller))
		}
	}
	for _, tk := range st.Tasks {
		if match(tk.VolumeID) {
			out = append(out, fmt.Sprintf("task %s volume %q (%s/%s) state=%q", tk.TaskID, tk.Name, tk.PluginID, tk.VolumeID, tk.State))
		}
	}
	for _, f := range st.Files {
		out = append(out, "file "+f)
	}
	return out
}

// WaitVolJournalClear waits until the journal has no record naming one of
// ids (no ids: no record at all) and returns what it still lists after
// timeout. A record is dropped just after the plugin's last call for it
// returned, so a check right after that call waits for it.
func (a *Agent) WaitVolJournalClear(timeout time.Duration, ids ...string) []string {
	deadline := time.Now().Add(Scaled(timeout))
	for {
		left := a.VolJournalLeft()
		if len(ids) > 0 {
			left = a.VolJournalMentions(ids...)
		}
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// VolMounts lists what is mounted under the driver's staging and
// publish roots (root_dir/mnt/staging, root_dir/mnt/publish). A mount table
// that cannot be read is listed as a line saying so, so that a check for
// "nothing mounted" fails.
func (a *Agent) VolMounts() []string {
	var out []string
	for _, d := range []string{"staging", "publish"} {
		m, err := MountsUnder(filepath.Join(a.DriverRoot, "mnt", d))
		if err != nil {
			out = append(out, volReadError(err))
		}
		out = append(out, m...)
	}
	return out
}

// volReadError is the line the mount listings give for a mount table
// they could not read.
func volReadError(err error) string { return "(failed to read the mount table: " + err.Error() + ")" }

// WaitVolMountsGone waits until nothing under the staging and publish
// roots whose path contains one of substrs (any when none) is mounted, and
// returns what is still mounted after timeout.
func (a *Agent) WaitVolMountsGone(timeout time.Duration, substrs ...string) []string {
	deadline := time.Now().Add(Scaled(timeout))
	for {
		var left []string
		for _, m := range a.VolMounts() {
			if len(substrs) == 0 || strings.HasPrefix(m, "(failed") {
				left = append(left, m)
				continue
			}
			for _, s := range substrs {
				if strings.Contains(m, s) {
					left = append(left, m)
					break
				}
			}
		}
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// VolLoopsUnder lists the loop devices whose backing file is under dir.
// The kernel names the file as seen from its mount, which after a lazy
// unmount no longer starts with dir: a path naming dir's base directory
// counts too (the /tmp/ncsi-* names are unique).
func VolLoopsUnder(dir string) []string {
	var devs []string
	backing, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, b := range backing {
		f, err := os.ReadFile(b)
		p := strings.TrimSpace(string(f))
		if err == nil && (strings.HasPrefix(p, dir+"/") || strings.Contains(p, "/"+filepath.Base(dir)+"/")) {
			devs = append(devs, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(b))))
		}
	}
	sort.Strings(devs)
	return devs
}

// VolDetachLoops detaches the loop devices backed by files under dir.
func VolDetachLoops(dir string) error {
	var errs []string
	for _, dev := range VolLoopsUnder(dir) {
		if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v: %s", dev, err, strings.TrimSpace(string(out))))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("failed to detach loop devices: %s", strings.Join(errs, "; "))
	}
	return nil
}

// VolStopAndWait stops a job (without purging it) and waits until all its
// allocations are terminal.
func (a *Agent) VolStopAndWait(t testing.TB, jobID string, timeout time.Duration) {
	t.Helper()
	a.StopJob(t, jobID)
	deadline := time.Now().Add(Scaled(timeout))
	for time.Now().Before(deadline) {
		allocs, err := a.JobAllocations(jobID)
		if err == nil && allTerminal(allocs) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("job %s still has allocations running %v after it was stopped", jobID, timeout)
}

// VolWaitAllocs waits until n allocations of a job are in one of the wanted
// statuses and returns them, failing at once on an unwanted terminal one.
func (a *Agent) VolWaitAllocs(t testing.TB, jobID string, n int, timeout time.Duration, want ...string) []AllocStub {
	t.Helper()
	var last, ok []AllocStub
	var lastErr error
	done, st := a.watchAllocs(jobID, timeout, func(streamStats) bool {
		allocs, err := a.JobAllocations(jobID)
		if err != nil {
			lastErr = err
			return false
		}
		last, ok = allocs, nil
		for _, al := range allocs {
			if slices.Contains(want, al.ClientStatus) {
				ok = append(ok, al)
			} else if IsTerminal(al.ClientStatus) {
				full, _ := a.allocation(al.ID)
				desc := al.ClientStatus
				if full != nil {
					desc = full.Describe()
				}
				t.Fatalf("allocation %s of job %s is %s, wanted %v:\n%s", al.ID, jobID, al.ClientStatus, want, desc)
			}
		}
		return len(ok) >= n
	})
	if done {
		return ok
	}
	statuses := make([]string, 0, len(last))
	for _, al := range last {
		statuses = append(statuses, al.ID[:8]+"="+al.ClientStatus)
	}
	t.Fatalf("fewer than %d allocations of job %s became %v within %v (%s); last seen: %v (last error: %v)", n, jobID, want, timeout, st, statuses, lastErr)
	return nil
}

// VolJournalPaths lists the staging paths (volume records) and publish
// targets (task records) the journal holds for a volume id; tests read
// them while a volume is in use and check later that none is still
// mounted. A journal that cannot be read gives none: callers check how
// many they got.
func (a *Agent) VolJournalPaths(volID string) []string {
	var out []string
	st, _ := a.VolJournal()
	for _, v := range st.Volumes {
		if v.VolumeID == volID && v.StagingPath != "" {
			out = append(out, v.StagingPath)
		}
	}
	for _, tk := range st.Tasks {
		if tk.VolumeID == volID {
			out = append(out, tk.Target)
		}
	}
	sort.Strings(out)
	return out
}

// VolMountedAmong returns the paths that are mount points (or have mounts
// below them); a mount table that cannot be read is a line saying so.
func VolMountedAmong(paths []string) []string {
	var out []string
	for _, p := range paths {
		m, err := MountsUnder(p)
		if err != nil {
			return append(out, volReadError(err))
		}
		out = append(out, m...)
	}
	return out
}

// TaskMounts lists the mount points of a running task's mount namespace as
// the task sees them: /proc/<pid>/mountinfo of one of its processes
// (whose mount points are relative to that process's root).
func TaskMounts(allocID, task string) ([]string, error) {
	pids := TaskPIDs(allocID, task)
	if len(pids) == 0 {
		return nil, fmt.Errorf("task %s of allocation %s has no process", task, allocID)
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pids[0]))
	if err != nil {
		return nil, fmt.Errorf("failed to read the mount table of task %s of allocation %s: %w", task, allocID, err)
	}
	defer f.Close()
	table, err := mounter.ParseMountInfo(f)
	if err != nil {
		return nil, fmt.Errorf("failed to read the mount table of task %s of allocation %s: %w", task, allocID, err)
	}
	out := make([]string, 0, len(table))
	for _, mp := range table {
		out = append(out, mp.Path)
	}
	return out, nil
}

// volMountsNaming lists, sorted, the host's mount points whose mount point
// or root (the directory of the source file system a bind mount shows)
// has one of the volume ids as a path element: the staging paths and
// targets of the fixture's dir volumes. Empty ids are skipped.
func volMountsNaming(t testing.TB, ids ...string) []string {
	t.Helper()
	table, err := mounter.New().List()
	if err != nil {
		t.Fatalf("failed to read the mount table: %v", err)
	}
	var out []string
	for _, mp := range table {
		for _, id := range ids {
			if id == "" {
				continue
			}
			if slices.Contains(strings.Split(mp.Root, "/"), id) || slices.Contains(strings.Split(mp.Path, "/"), id) {
				out = append(out, mp.Path)
				break
			}
		}
	}
	sort.Strings(out)
	return out
}
