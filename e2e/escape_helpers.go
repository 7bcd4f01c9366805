//go:build e2e

package e2e

// Helpers for the escape suite (escape_test.go): running one attack job
// (e2e/jobs/escape-task.hcl with the attack's script), the shell pieces the
// attack scripts share, reading the "RESULT <name> OK|FAILED <why>" lines
// they print, host sleepers, and the host facts the attacks are aimed at.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// escTimeout bounds each wait of the suite: an attack job to finish, a
// service job to say it is ready.
const escTimeout = 90 * time.Second

var escCounter atomic.Int64

// escUniq is a name part unique to this run and call: digits only, so that
// it can follow "sleep 300." in a sleeper's argv.
func escUniq() string {
	return fmt.Sprintf("%d%d%d", os.Getpid(), time.Now().UnixNano()%1e6, escCounter.Add(1))
}

// escJob is an attack (or victim) job rendered from
// e2e/jobs/escape-task.hcl: one task "t" running Script with /bin/sh -c,
// $0 "escape" and Args as $1....
type escJob struct {
	Type     string // batch (default) or service
	Driver   string // escRun's default: the driver under test (E2E_DRIVER)
	User     string // "" leaves user unset
	Script   string
	Args     []string
	Volumes  []VolSpec
	Prestart string // when set, a prestart task "prestart" runs this script first, as User on Driver
	PidMode  string // the task's pid_mode ("" leaves it unset: private)
	Image    string // the task's image ("": none, the chroot_env root)
}

// escImages maps an agent to the image its attackers run from (see
// TestEscapeImage): escRun gives it to every job on the driver under test.
var escImages sync.Map

func (j escJob) vars() map[string]string {
	v := map[string]string{
		"Type":     j.Type,
		"Driver":   j.Driver,
		"User":     j.User,
		"Script":   volHCLString(j.Script),
		"Args":     volHCLList(j.Args),
		"Prestart": "",
		"PidMode":  j.PidMode,
		"Image":    j.Image,
	}
	if v["Type"] == "" {
		v["Type"] = "batch"
	}
	if j.Prestart != "" {
		v["Prestart"] = volHCLString(j.Prestart)
	}
	var vols strings.Builder
	for _, vol := range j.Volumes {
		vols.WriteString(vol.HCL())
	}
	v["Volumes"] = vols.String()
	return v
}

// The shell pieces the attack scripts share. escTry runs a step of an
// attack and prints its "RESULT <name> OK|FAILED <why>" line, returning
// the step's status; escWho prints who the task runs as; escSeen <pid>
// <pattern> succeeds when /proc/<pid> is visible and its command line holds
// the pattern.
const (
	escTry = `try() {
  n=$1; shift
  if out=$("$@" 2>&1); then echo "RESULT $n OK $(printf '%s' "$out" | tr '\n' ' ')"
  else echo "RESULT $n FAILED rc=$? $(printf '%s' "$out" | tr '\n' ' ')"; return 1; fi
}
`
	escWho = `echo "uid=$(id -u) $(grep CapEff /proc/self/status)"
`
	escSeen = `seen() {
  c=$(tr '\0' ' ' < "/proc/$1/cmdline") || return 1
  case "$c" in *"$2"*) echo "/proc/$1: $c" ;; *) echo "/proc/$1 is another process: $c"; return 1 ;; esac
}
`
)

// escFinished waits until an attack job's allocation is complete or failed,
// logs what the task printed, and fails the test when the task never got
// to the end of its script (an attack that did not run proves nothing).
func escFinished(t *testing.T, a *Agent, job Job, task string) (*Allocation, escResults) {
	t.Helper()
	al := a.WaitAlloc(t, job.ID, escTimeout, StatusComplete, StatusFailed)
	out := escLogs(t, a, al.ID, task)
	if !strings.Contains(out, "DONE") {
		t.Fatalf("the attack did not run to its end (no DONE in its output):\n%s", al.Describe())
	}
	return al, escParse(out)
}

// escLogs reads and logs a task's stdout and stderr, and returns stdout.
func escLogs(t *testing.T, a *Agent, allocID, task string) string {
	t.Helper()
	stdout, stderr := escRead(t, a, allocID, task, false), escRead(t, a, allocID, task, true)
	t.Logf("task %s of allocation %s said:\n%s", task, allocID, strings.TrimRight(stdout, "\n"))
	if strings.TrimSpace(stderr) != "" {
		t.Logf("and on stderr:\n%s", strings.TrimRight(stderr, "\n"))
	}
	return stdout
}

// escRead reads a task's stdout or stderr: "" for a task that never
// started (Nomad says "not started yet"); any other failure to read fails
// the test, so that an empty read never passes for an empty output.
func escRead(t *testing.T, a *Agent, allocID, task string, stderr bool) string {
	t.Helper()
	args := []string{"alloc", "logs"}
	if stderr {
		args = append(args, "-stderr")
	}
	out, err := a.Nomad(append(args, allocID, task)...)
	if err != nil {
		if strings.Contains(out, "not started yet") {
			return ""
		}
		t.Fatalf("nomad %s %s %s failed: %v\n%s", strings.Join(args, " "), allocID, task, err, out)
	}
	return out
}

// escResult is one "RESULT <name> OK|FAILED <why>" line.
type escResult struct {
	OK  bool
	Why string
}

type escResults map[string]escResult

func escParse(out string) escResults {
	res := escResults{}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || f[0] != "RESULT" {
			continue
		}
		res[f[1]] = escResult{OK: f[2] == "OK", Why: strings.Join(f[3:], " ")}
	}
	return res
}

// mustFail checks that the attack tried each named step and that the step
// failed.
func (r escResults) mustFail(t *testing.T, names ...string) {
	t.Helper()
	for _, n := range names {
		res, ok := r[n]
		switch {
		case !ok:
			t.Errorf("%s: the attack did not report this step", n)
		case res.OK:
			t.Errorf("%s: ESCAPED: the step succeeded: %s", n, res.Why)
		default:
			t.Logf("%s: contained: %s", n, res.Why)
		}
	}
}

// escSleeper is a host process outside every task, for the tasks to look
// for and signal.
type escSleeper struct {
	PID    int
	Arg    string // its argument, "300.<unique>"
	exited chan struct{}
	err    error
}

// escStartSleeper starts "sleep 300.<nonce>" on the host and kills it when
// the test ends.
func escStartSleeper(t *testing.T, nonce string) *escSleeper {
	t.Helper()
	s := &escSleeper{Arg: "300." + nonce, exited: make(chan struct{})}
	cmd := exec.Command("sleep", s.Arg)
	if err := cmd.Start(); err != nil {
		t.Fatalf("failed to start the host sleeper: %v", err)
	}
	s.PID = cmd.Process.Pid
	go func() {
		s.err = cmd.Wait()
		close(s.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-s.exited
	})
	return s
}

// Alive tells whether the sleeper is still running, and if not, how it
// ended.
func (s *escSleeper) Alive() (bool, string) {
	select {
	case <-s.exited:
		return false, fmt.Sprint(s.err)
	default:
		return true, ""
	}
}

// escLoopDevice attaches a loop device to a 1 MiB file that starts with
// marker, and detaches it when the test ends.
func escLoopDevice(t *testing.T, marker string) string {
	t.Helper()
	img := filepath.Join(t.TempDir(), "escape.img")
	if err := os.WriteFile(img, []byte(marker), 0o600); err != nil {
		t.Fatalf("%v", err)
	}
	if err := os.Truncate(img, 1<<20); err != nil {
		t.Fatalf("%v", err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup --find --show %s: %v: %s", img, err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
			t.Errorf("losetup --detach %s: %v: %s", dev, err, out)
		}
	})
	return dev
}

// escFullCaps is every capability this kernel knows (kernel), and every
// capability the host's root has here (host: the test's own bounding set,
// which on these machines lacks CAP_SYS_RESOURCE).
func escFullCaps(t *testing.T) (kernel, host uint64) {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		t.Fatalf("failed to read the last capability: %v", err)
	}
	last, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("failed to read the last capability: %v", err)
	}
	bnd, err := StatusField(os.Getpid(), "CapBnd")
	if err != nil {
		t.Fatalf("%v", err)
	}
	host, err = strconv.ParseUint(bnd, 16, 64)
	if err != nil {
		t.Fatalf("failed to parse CapBnd %q: %v", bnd, err)
	}
	return 1<<(last+1) - 1, host
}

// escProcsRunning lists the host PIDs whose argv is exactly argv.
func escProcsRunning(argv ...string) []int {
	want := strings.Join(argv, "\x00") + "\x00"
	var pids []int
	for _, p := range listProcs() {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p.PID))
		if err == nil && string(b) == want && procState(p.PID) != "Z" {
			pids = append(pids, p.PID)
		}
	}
	return pids
}

// escCgroupOf is a process's /proc/PID/cgroup on one line.
func escCgroupOf(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return err.Error()
	}
	return strings.ReplaceAll(strings.TrimSpace(string(b)), "\n", " ")
}

// escRemove removes a file or empty directory the attack may have left on
// the host, and says so.
func escRemove(t *testing.T, path string) {
	if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
		return
	}
	if err := os.Remove(path); err != nil {
		t.Errorf("failed to remove %s left by the attack: %v", path, err)
		return
	}
	t.Logf("removed %s left by the attack", path)
}

// escMustNotExist checks the host for a path an attack tried to make.
func escMustNotExist(t *testing.T, path, what string) {
	t.Helper()
	fi, err := os.Lstat(path)
	switch {
	case err == nil:
		t.Errorf("ESCAPED: %s: %s exists on the host (%s, mode %v)", what, path, fi.Name(), fi.Mode())
	case errors.Is(err, os.ErrNotExist):
		t.Logf("contained: %s: no %s on the host", what, path)
	default:
		t.Errorf("failed to check the host for %s: %v", path, err)
	}
}

// escCgroupDirs lists /sys/fs/cgroup/*/<name> directories that exist, and
// /sys/fs/cgroup/<name> when /sys/fs/cgroup is the cgroup v2 hierarchy
// (make e2e-cgroup2).
func escCgroupDirs(name string) []string {
	dirs, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", name))
	var st unix.Statfs_t
	if unix.Statfs("/sys/fs/cgroup", &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		top, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", name))
		dirs = append(top, dirs...)
	}
	var out []string
	for _, d := range dirs {
		if fi, err := os.Lstat(filepath.Dir(d)); err == nil && fi.Mode()&os.ModeSymlink != 0 {
			continue // cpu -> cpu,cpuacct: the same hierarchy
		}
		out = append(out, d)
	}
	return out
}

// escCgroupPIDs lists the processes in a cgroup directory.
func escCgroupPIDs(dir string) []int {
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// escCmdline is a process's argv on one line.
func escCmdline(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return err.Error()
	}
	return strings.TrimSpace(strings.ReplaceAll(string(b), "\x00", " "))
}

// escTaskMountAt says whether path is a mount point in the mount namespace
// of a task's processes, from their /proc/PID/mountinfo.
func escTaskMountAt(allocID, task, path string) string {
	pids := TaskPIDs(allocID, task)
	if len(pids) == 0 {
		return "no process"
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pids[0]))
	if err != nil {
		return err.Error()
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == path {
			return "mounted: " + line
		}
	}
	return "not a mount point"
}
