//go:build e2e

package e2e

// Helpers of the fault suite (fault_test.go): the fixture's fault rules,
// killing the driver plugin or the client agent with SIGKILL and getting
// them back, counting what a fault left behind, editing the journal while
// the driver is stopped, and the table the suite writes to build/faults.md.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
)

// FaultsFile is the fixture's control file of fault rules (see
// e2e/csiplugin/faults.go): its default path, in the state dir.
func (p *VolFixture) FaultsFile() string { return filepath.Join(p.StateDir, "faults") }

// SetFaults replaces the fixture's fault rules ("METHOD VOLUME hang",
// "METHOD VOLUME fail CODE [N]"), atomically: the fixture reads the file
// on every call.
func (p *VolFixture) SetFaults(rules ...string) error {
	if err := os.MkdirAll(p.StateDir, 0o755); err != nil {
		return err
	}
	tmp := p.FaultsFile() + ".tmp"
	if err := os.WriteFile(tmp, []byte(strings.Join(rules, "\n")+"\n"), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, p.FaultsFile())
}

// ClearFaults removes every fault rule, releasing hung calls.
func (p *VolFixture) ClearFaults() error {
	if err := os.Remove(p.FaultsFile()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// CountFor counts the calls of method for the volume created under name:
// CreateVolume is logged by name, the others by the id the fixture gave.
func (p *VolFixture) CountFor(method, name string) int {
	if method == "CreateVolume" {
		return p.Count(method, "name="+name)
	}
	id := p.VolumeID(name)
	if id == "" {
		return 0
	}
	return p.Count(method, id)
}

// WaitCallFor waits until the fixture logged n calls of method for the
// volume created under name.
func (p *VolFixture) WaitCallFor(t testing.TB, method, name string, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(Scaled(timeout))
	for p.CountFor(method, name) < n {
		if time.Now().After(deadline) {
			t.Fatalf("want %d %s calls for volume %s within %v, got %d; calls: %v", n, method, name, timeout,
				p.CountFor(method, name), p.VolumeCalls(p.VolumeID(name)))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// KillDriver sends SIGKILL to the agent's nomad-driver-csi process and
// waits until it is gone; it returns its PID.
func (a *Agent) KillDriver(t testing.TB) int {
	t.Helper()
	pid := a.DriverPluginPID()
	if pid == 0 {
		t.Fatalf("no nomad-driver-csi process under agent pid %d", a.PID())
	}
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		t.Fatalf("failed to kill the driver plugin pid %d: %v", pid, err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if st := procState(pid); st == "?" || st == "Z" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("driver plugin pid %d still alive 10s after SIGKILL", pid)
		}
	}
	a.opts.Logf("killed the driver plugin pid=%d", pid)
	return pid
}

// WaitDriverBack waits until the agent runs a driver plugin process other
// than old and the node reports the csi driver healthy again.
func (a *Agent) WaitDriverBack(t testing.TB, old int, timeout time.Duration) int {
	t.Helper()
	deadline := time.Now().Add(Scaled(timeout))
	last := "no new driver process"
	for time.Now().Before(deadline) {
		pid := a.DriverPluginPID()
		if pid != 0 && pid != old {
			if n, err := a.node(); err != nil {
				last = err.Error()
			} else if d := n.Drivers[DriverName]; d == nil || !d.Healthy {
				last = fmt.Sprintf("driver pid %d runs but the node does not report it healthy", pid)
			} else {
				a.recordChildren()
				return pid
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("the driver plugin did not come back within %v after pid %d died: %s\n%s", timeout, old, last, a.driverLogLines(30))
	return 0
}

// KillClient sends SIGKILL to the agent that runs the tasks, as a crash
// would: its children (the driver plugin, supervisors) are left as they
// are. StartClient starts it again.
func (a *Agent) KillClient() error {
	a.recordChildren()
	a.mu.Lock()
	p := a.client
	if p.unit != "" {
		a.mu.Unlock()
		return errors.New("KillClient does not kill a systemd unit's agent (systemd would start it again): run the fault cases without the systemd mode")
	}
	cmd, exited, logFile := p.cmd, p.exited, p.logFile
	p.cmd, p.logFile = nil, nil
	a.mu.Unlock()
	if cmd == nil {
		return errors.New("the client agent is not running")
	}
	pid := cmd.Process.Pid
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		return fmt.Errorf("failed to kill the client agent pid %d: %w", pid, err)
	}
	<-exited
	if logFile != nil {
		fmt.Fprintf(logFile, "==== harness: %s pid=%d killed with SIGKILL at %s\n", p.name, pid, time.Now().Format(time.RFC3339Nano))
		logFile.Close()
	}
	a.opts.Logf("killed nomad %s pid=%d with SIGKILL", p.name, pid)
	return nil
}

// StartClient starts the client agent again (after Stop or KillClient)
// and waits until it has registered again with the wanted drivers.
func (a *Agent) StartClient() error {
	if a.PID() != 0 {
		return errors.New("the client agent is already running")
	}
	if err := a.startProc(a.client); err != nil {
		return err
	}
	return a.waitReady(90 * time.Second)
}

// faultCgroupParent is the driver's cgroup_parent in the agent's
// configuration, or the driver's default.
func (a *Agent) faultCgroupParent() string {
	b, _ := os.ReadFile(a.ConfigPath)
	s := string(b)
	if i := strings.Index(s, `plugin "nomad-driver-csi"`); i >= 0 {
		if m := regexp.MustCompile(`(?m)^\s*cgroup_parent\s*=\s*"([^"]+)"`).FindStringSubmatch(s[i:]); m != nil {
			return m[1]
		}
	}
	return driver.DefaultCgroupParent
}

// FaultLeft is what a fault left behind, one line per item.
type FaultLeft struct {
	Mounts, Cgroups, Procs, Journal []string
}

// faultLeftovers lists what is left of the allocations allocIDs and the
// volumes vols (names or ids): mounts under the driver's staging and
// publish roots, cgroups of those allocations under the driver's cgroup
// parent in every hierarchy, processes of those allocations (tasks,
// supervisors) and journal records naming the volumes. With all set, every
// mount under the driver's root and every journal record counts.
func (a *Agent) faultLeftovers(allocIDs, vols []string, all bool) FaultLeft {
	var l FaultLeft
	if all {
		l.Mounts, _ = MountsUnder(a.DriverRoot)
	} else {
		l.Mounts = a.VolMounts()
	}
	// The driver's parent, and on cgroup v2 Nomad's partitions, where the
	// driver puts a task in the group Nomad made for it.
	parents := []string{a.faultCgroupParent(), "nomad.slice/share.slice", "nomad.slice/reserve.slice"}
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, root := range append(roots, "/sys/fs/cgroup") {
		for _, parent := range parents {
			entries, _ := os.ReadDir(filepath.Join(root, parent))
			for _, e := range entries {
				if !e.IsDir() {
					continue
				}
				for _, id := range allocIDs {
					if strings.HasPrefix(e.Name(), id) {
						l.Cgroups = append(l.Cgroups, filepath.Join(root, parent, e.Name()))
						break
					}
				}
			}
		}
	}
	self := os.Getpid()
	if len(allocIDs) > 0 {
		for _, p := range listProcs() {
			if p.PID == self || procState(p.PID) == "Z" {
				continue
			}
			if a.belongsToAllocs(p.PID, allocIDs) {
				cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p.PID))
				l.Procs = append(l.Procs, fmt.Sprintf("pid %d %s: %s", p.PID, p.Comm, strings.TrimSpace(strings.ReplaceAll(string(cmd), "\x00", " "))))
			}
		}
	}
	if all {
		l.Journal = a.VolJournalLeft()
	} else {
		l.Journal = a.VolJournalMentions(vols...)
	}
	return l
}

// belongsToAllocs tells whether a process's environment or cgroup names
// one of the allocations (the task, its supervisor).
func (a *Agent) belongsToAllocs(pid int, allocIDs []string) bool {
	var texts []string
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid)); err == nil {
		texts = append(texts, string(b))
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err == nil {
		texts = append(texts, string(b))
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil {
		texts = append(texts, string(b))
	}
	for _, s := range texts {
		for _, id := range allocIDs {
			if strings.Contains(s, id) {
				return true
			}
		}
	}
	return false
}

// journalFrames returns the offsets of the frames of a journal log (see
// csihook/journal.go: magic, length, CRC, payload), up to the first byte
// that does not start a frame, and that offset.
func journalFrames(data []byte) (starts []int, end int) {
	const magic, header = "\xffCSJ", 12
	off := 0
	for off+header <= len(data) && string(data[off:off+4]) == magic {
		n := int(binary.LittleEndian.Uint32(data[off+4:]))
		if off+header+n > len(data) {
			break
		}
		starts = append(starts, off)
		off += header + n
	}
	return starts, off
}

// TearJournalTail writes, after the last frame of the driver's journal
// log, the first half of a copy of that frame: a batch cut short by a
// crash. The driver must not be running.
func (a *Agent) TearJournalTail() (string, error) {
	path := filepath.Join(a.DriverRoot, "journal", "journal.log")
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	starts, end := journalFrames(data)
	if len(starts) == 0 {
		return "", fmt.Errorf("journal %s has no frame", path)
	}
	last := data[starts[len(starts)-1]:end]
	torn := last[:len(last)/2]
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	if _, err := f.WriteAt(torn, int64(end)); err != nil {
		return "", err
	}
	return fmt.Sprintf("%d frames; %d bytes of a torn frame written at offset %d", len(starts), len(torn), end), f.Sync()
}

// CorruptJournalFrame flips a payload byte of frame i (negative: from the
// end) of the driver's journal log, so that its checksum fails. The
// driver must not be running.
func (a *Agent) CorruptJournalFrame(pick func(n int) int) (string, error) {
	path := filepath.Join(a.DriverRoot, "journal", "journal.log")
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	starts, end := journalFrames(data)
	i := pick(len(starts))
	if i < 0 || i >= len(starts) {
		return "", fmt.Errorf("journal %s has %d frames, no frame %d", path, len(starts), i)
	}
	next := end
	if i+1 < len(starts) {
		next = starts[i+1]
	}
	frame := data[starts[i]:next]
	// A byte of the JSON payload: a quote, so that the damage is in a
	// record and not only in the header.
	j := bytes.IndexByte(frame[12:], '"')
	if j < 0 {
		return "", fmt.Errorf("frame %d of %s has no JSON string", i, path)
	}
	at := int64(starts[i] + 12 + j)
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte{'\''}, at); err != nil {
		return "", err
	}
	return fmt.Sprintf("frame %d of %d (offset %d, %d bytes) corrupted at offset %d", i, len(starts), starts[i], len(frame), at), f.Sync()
}

// faultRow is one line of the fault table.
type faultRow struct {
	Group, Fault string
	Outcome      string // what the user sees, as the case found it
	Pass         bool
	Left         FaultLeft
	Note         string
}

// faultTable collects the rows of one run of the suite.
type faultTable struct {
	mu   sync.Mutex
	rows []*faultRow
}

func (ft *faultTable) add(r *faultRow) {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	ft.rows = append(ft.rows, r)
}

// Markdown renders the table.
func (ft *faultTable) Markdown(command string) string {
	ft.mu.Lock()
	rows := slices.Clone(ft.rows)
	ft.mu.Unlock()
	order := map[string]int{"driver": 0, "agent": 1, "plugin": 2, "disk": 3, "journal": 4, "codes": 5}
	sort.SliceStable(rows, func(i, j int) bool { return order[rows[i].Group] < order[rows[j].Group] })
	var b strings.Builder
	fmt.Fprintf(&b, "Fault suite: `%s`, %s.\n\n", command, time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	b.WriteString("| fault | result | outcome | mounts | cgroups | processes | journal records |\n")
	b.WriteString("|---|---|---|---|---|---|---|\n")
	failed := 0
	for _, r := range rows {
		res := "pass"
		if !r.Pass {
			res, failed = "FAIL", failed+1
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %d | %d | %d | %d |\n", r.Fault, res, mdCell(r.Outcome),
			len(r.Left.Mounts), len(r.Left.Cgroups), len(r.Left.Procs), len(r.Left.Journal))
	}
	fmt.Fprintf(&b, "\n%d faults, %d failed. Counts are what was left once the fault's tasks had stopped and a later task had used the same volume (target: 0).\n", len(rows), failed)
	var details []string
	for _, r := range rows {
		var items []string
		for _, kind := range []struct {
			name  string
			items []string
		}{{"mount", r.Left.Mounts}, {"cgroup", r.Left.Cgroups}, {"process", r.Left.Procs}, {"journal", r.Left.Journal}} {
			for _, it := range kind.items {
				items = append(items, kind.name+": "+it)
			}
		}
		if r.Note != "" {
			items = append(items, "note: "+r.Note)
		}
		if len(items) > 0 {
			details = append(details, fmt.Sprintf("- %s:\n  - %s", r.Fault, strings.Join(items, "\n  - ")))
		}
	}
	if len(details) > 0 {
		b.WriteString("\nDetails:\n\n" + strings.Join(details, "\n") + "\n")
	}
	return b.String()
}

func mdCell(s string) string {
	if r := []rune(s); len(r) > 240 {
		s = string(r[:240]) + "…"
	}
	s = strings.ReplaceAll(s, "|", "\\|")
	return strings.ReplaceAll(s, "\n", " ")
}
