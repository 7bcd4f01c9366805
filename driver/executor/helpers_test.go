package executor

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/shimtest"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// envStartHelper makes the test binary act as a throw-away driver: it
// starts the spec in the named file, prints the State as one JSON line and
// sleeps until it is killed.
const envStartHelper = "EXECUTOR_TEST_START_SPEC"

func TestMain(m *testing.M) {
	supervisor.RunReexec()
	if os.Getenv(envSelfExeProbe) != "" {
		os.Exit(runSelfExeProbe())
	}
	if path := os.Getenv(envStartHelper); path != "" {
		os.Exit(runStartHelper(path))
	}
	code := m.Run()
	removeStaticShim()
	os.Exit(code)
}

func runStartHelper(path string) int {
	var spec Spec
	if err := wire.ReadJSON(path, &spec); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	p, err := Start(hclog.NewNullLogger(), &spec, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	b, _ := json.Marshal(p.State())
	fmt.Println(string(b))
	select {}
}

var testSeq atomic.Int64

// withEachStage runs f with each seccomp stage a task that is not
// privileged can start from: the Go stage (the test binary as the
// supervisor, supervisor "") and the shim's entry point, which runs before
// the Go runtime (the shim as make dev builds it).
func withEachStage(t *testing.T, f func(t *testing.T, supervisor string)) {
	t.Helper()
	t.Run("go stage", func(t *testing.T) { f(t, "") })
	t.Run("shim entry", func(t *testing.T) { f(t, shimtest.Build(t, "")) })
}

// requireTaskRoot skips tests that start real tasks unless they can: they
// need root (mount namespaces, cgroups, setuid) and usable cgroups.
func requireTaskRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("test needs root: it starts tasks in mount namespaces and cgroups")
	}
	if err := cgroups.Available(); err != nil {
		t.Skipf("test needs cgroups: %v", err)
	}
}

type testTask struct {
	spec   *Spec
	stdout string
	stderr string
}

// newTestSpec returns a spec for command under unique cgroup and state
// names, with stdout and stderr in files. Cleanup kills and removes
// whatever the task left, whether the test passed or not.
func newTestSpec(t *testing.T, command string, args ...string) *testTask {
	t.Helper()
	n := testSeq.Add(1)
	dir := t.TempDir()
	stateDir := filepath.Join(dir, "state")
	must.NoError(t, os.Mkdir(stateDir, 0o700))
	tt := &testTask{
		stdout: filepath.Join(dir, "stdout"),
		stderr: filepath.Join(dir, "stderr"),
	}
	must.NoError(t, os.WriteFile(tt.stdout, nil, 0o600))
	must.NoError(t, os.WriteFile(tt.stderr, nil, 0o600))
	parent := fmt.Sprintf("nomad-driver-csi-executor-test-%d", os.Getpid())
	tt.spec = &Spec{
		TaskID:       fmt.Sprintf("task-%d", n),
		StateDir:     stateDir,
		Command:      command,
		Args:         args,
		Env:          []string{"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "SECRET_TOKEN=hunter2"},
		Dir:          dir,
		StdoutPath:   tt.stdout,
		StderrPath:   tt.stderr,
		CgroupParent: parent,
	}
	t.Cleanup(func() { cleanupCgroup(t, parent, tt.spec.TaskID) })
	return tt
}

// cleanupCgroup kills and removes the task's group and the test parent, in
// every hierarchy where they exist.
func cleanupCgroup(t *testing.T, parent, name string) {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	roots = append(roots, "/sys/fs/cgroup")
	for _, root := range roots {
		dir := filepath.Join(root, parent, name)
		if _, err := os.Stat(filepath.Join(dir, "cgroup.procs")); err != nil {
			continue
		}
		b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		for _, f := range strings.Fields(string(b)) {
			var pid int
			fmt.Sscan(f, &pid)
			_ = unix.Kill(pid, unix.SIGKILL)
		}
		for i := 0; i < 100; i++ {
			if err := unix.Rmdir(dir); err == nil || err == unix.ENOENT {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	for _, root := range roots {
		_ = unix.Rmdir(filepath.Join(root, parent))
	}
}

// cgroupExists reports whether the task's group is in any hierarchy.
func cgroupExists(parent, name string) bool {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, root := range append(roots, "/sys/fs/cgroup") {
		if _, err := os.Stat(filepath.Join(root, parent, name)); err == nil {
			return true
		}
	}
	return false
}

// processesMentioning lists PIDs whose command line holds s.
func processesMentioning(t *testing.T, s string) []string {
	t.Helper()
	var out []string
	entries, err := os.ReadDir("/proc")
	must.NoError(t, err)
	must.SliceNotEmpty(t, entries)
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(b), s) {
			out = append(out, e.Name())
		}
	}
	return out
}

func startTest(t *testing.T, tt *testTask) *Process {
	t.Helper()
	p, err := Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	t.Cleanup(func() {
		_ = p.Kill()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = p.Wait(ctx)
		_ = p.Destroy()
	})
	return p
}

func waitExit(t *testing.T, p *Process) *ExitStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := p.Wait(ctx)
	must.NoError(t, err)
	return st
}

// waitFor polls cond for up to 10 seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	must.NoError(t, err)
	return string(b)
}

// capEff parses the CapEff line of a /proc/PID/status dump.
func capEff(t *testing.T, status string) uint64 {
	t.Helper()
	for _, line := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			var n uint64
			_, err := fmt.Sscanf(strings.TrimSpace(v), "%x", &n)
			must.NoError(t, err)
			return n
		}
	}
	t.Fatalf("no CapEff in %q", status)
	return 0
}
