package cgroups

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// hostGroup creates a group on the real machine under a parent unique to
// the test, or skips the test when that is not possible here. Cleanup kills
// and destroys the group and removes the parent.
func hostGroup(t *testing.T, l Limits) *Group {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create cgroups")
	}
	if err := Available(); err != nil {
		t.Skipf("cgroups are not available here: %v", err)
	}
	parent := fmt.Sprintf("nomad-driver-csi-test-%d-%d", os.Getpid(), time.Now().UnixNano())
	g, err := Create(parent, "task", l)
	must.NoError(t, err)
	t.Cleanup(func() {
		_ = g.Kill()
		must.NoError(t, g.Destroy())
		h, err := hostHierarchy()
		must.NoError(t, err)
		removeParent(t, h, parent)
	})
	return g
}

// removeParent removes the parent directory a test made in every hierarchy.
func removeParent(t *testing.T, h *hierarchy, parent string) {
	t.Helper()
	if h.version == 2 {
		must.NoError(t, os.Remove(filepath.Join(h.root, parent)))
		return
	}
	for _, c := range append(v1Controllers, "cpuset") {
		err := os.Remove(filepath.Join(h.root, c, parent))
		if err != nil && !os.IsNotExist(err) {
			t.Errorf("failed to remove test parent: %v", err)
		}
	}
}

// startIn starts a command and moves it into g; the command waits for a
// line on stdin before it runs script, so that all it does happens inside
// the group. Cleanup kills it.
func startIn(t *testing.T, g *Group, script string) (*exec.Cmd, func()) {
	t.Helper()
	cmd := exec.Command("sh", "-c", "read x; "+script)
	w, err := cmd.StdinPipe()
	must.NoError(t, err)
	must.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	must.NoError(t, g.Join(cmd.Process.Pid))
	return cmd, func() {
		_, err := w.Write([]byte("go\n"))
		must.NoError(t, err)
	}
}

func TestHost_Lifecycle(t *testing.T) {
	g := hostGroup(t, Limits{MemoryBytes: 256 << 20, CPUShares: 512, CPUQuota: 50000, CPUPeriod: 100000})

	for k, dir := range g.State().Paths {
		_, err := os.Stat(filepath.Join(dir, "cgroup.procs"))
		must.NoError(t, err, must.Sprintf("path of %s", k))
	}

	cmd := exec.Command("sleep", "60")
	must.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	must.NoError(t, g.Join(cmd.Process.Pid))

	pids, err := g.Pids()
	must.NoError(t, err)
	must.Eq(t, []int{cmd.Process.Pid}, pids)

	st, err := g.Stats()
	must.NoError(t, err)
	must.SliceContains(t, st.MemoryMeasured, "Usage")
	must.SliceContains(t, st.CPUMeasured, "User Mode")
	// v1 does not move a process's memory charge with it, so usage may
	// still be zero here.

	// The limits are what the kernel enforces.
	if g.version == 1 {
		for file, want := range map[string]string{
			"memory/memory.limit_in_bytes": "268435456",
			"cpu/cpu.shares":               "512",
			"cpu/cpu.cfs_quota_us":         "50000",
			"cpu/cpu.cfs_period_us":        "100000",
		} {
			ctrl, name := filepath.Split(file)
			got, err := readString(filepath.Join(g.paths[filepath.Clean(ctrl)], name))
			must.NoError(t, err)
			must.Eq(t, want, got, must.Sprintf("%s", file))
		}
	} else {
		got, err := readString(filepath.Join(g.paths[unifiedKey], "memory.max"))
		must.NoError(t, err)
		must.Eq(t, "268435456", got)
		got, err = readString(filepath.Join(g.paths[unifiedKey], "cpu.max"))
		must.NoError(t, err)
		must.Eq(t, "50000 100000", got)
	}

	oom, err := g.OOMKilled()
	must.NoError(t, err)
	must.False(t, oom)

	// Load finds the same group again.
	g2, err := Load(g.State())
	must.NoError(t, err)
	must.Eq(t, g.State(), g2.State())

	must.NoError(t, g2.Kill())
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("sleep did not exit after Kill")
	}
	pids, err = g.Pids()
	must.NoError(t, err)
	must.SliceEmpty(t, pids)

	must.NoError(t, g.Destroy())
	for _, dir := range g.State().Paths {
		_, err := os.Stat(dir)
		must.True(t, os.IsNotExist(err), must.Sprintf("%s still exists", dir))
	}
	_, err = Load(g.State())
	must.Error(t, err)
	// Destroying again is fine.
	must.NoError(t, g.Destroy())
}

func TestHost_OOM(t *testing.T) {
	g := hostGroup(t, Limits{MemoryBytes: 32 << 20})
	// tail keeps its whole input in memory when it has no newline.
	cmd, run := startIn(t, g, "head -c 200M /dev/zero | tail")
	run()
	err := cmd.Wait()
	must.Error(t, err)
	oom, err := g.OOMKilled()
	must.NoError(t, err)
	must.True(t, oom)
	st, err := g.Stats()
	must.NoError(t, err)
	if slices.Contains(st.MemoryMeasured, "Max Usage") {
		must.LessEq(t, uint64(32<<20), st.MemoryMaxUsage)
	}
}

func TestHost_KillForkBomb(t *testing.T) {
	g := hostGroup(t, Limits{MemoryBytes: 256 << 20})
	// Each process forks two that sleep and fork again, a bounded bomb.
	_, run := startIn(t, g, `f() { sleep 0.01; f & f & wait; }; f`)
	run()
	time.Sleep(300 * time.Millisecond)
	pids, err := g.Pids()
	must.NoError(t, err)
	must.Greater(t, 1, len(pids))
	must.NoError(t, g.Kill())
	pids, err = g.Pids()
	must.NoError(t, err)
	must.SliceEmpty(t, pids)
}
