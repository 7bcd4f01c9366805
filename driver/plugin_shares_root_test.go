package driver

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
)

// TestDriver_grantedPluginCPUShares_Root reads the CPU weight in each
// task's cgroup: a CSI plugin task the operator granted (privileged under
// a grant, or serving an id a grant reserves) weighs plugin_cpu_shares
// when its own cpu is less; a plugin task no grant names, a granted task
// that serves no plugin, and a granted plugin that asks for more keep
// their cpu, as does every task with plugin_cpu_shares = 0.
func TestDriver_grantedPluginCPUShares_Root(t *testing.T) {
	requireRoot(t)
	grants := []PrivilegedGrant{{Namespace: "*", Job: "*"}, {Namespace: "*", Job: "*", PluginID: "reserved"}}
	// A node plugin must be privileged; a controller need not be.
	plugin := func(id string) *PluginTaskConfig {
		return &PluginTaskConfig{ID: id, Type: "node", MountDir: "/csi"}
	}
	controller := func(id string) *PluginTaskConfig {
		return &PluginTaskConfig{ID: id, Type: "controller", MountDir: "/csi"}
	}
	cases := []struct {
		name       string
		shares     int
		tc         TaskConfig
		cpu        int64
		wantShares int64
	}{
		{"privileged plugin", 1024, TaskConfig{Privileged: true, CSIPlugin: plugin("priv")}, 100, 1024},
		{"plugin id reserved by a grant", 1024, TaskConfig{CSIPlugin: controller("reserved")}, 100, 1024},
		{"plugin no grant names", 1024, TaskConfig{CSIPlugin: controller("free")}, 100, 100},
		{"privileged task serving no plugin", 1024, TaskConfig{Privileged: true}, 100, 100},
		{"privileged plugin asking for more", 1024, TaskConfig{Privileged: true, CSIPlugin: plugin("big")}, 2000, 2000},
		{"plugin_cpu_shares = 0", 0, TaskConfig{Privileged: true, CSIPlugin: plugin("off")}, 100, 100},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h, _ := harnessDriver(t, Config{AllowPrivileged: true, PrivilegedGrants: grants, PluginCPUShares: c.shares})
			c.tc.Command, c.tc.Args = "/bin/sleep", []string{"60"}
			cfg := realTask(t, "t", c.tc)
			cfg.Resources.LinuxResources.CPUShares = c.cpu
			cfg.Resources.NomadResources.Cpu.CpuShares = c.cpu
			cleanup := mkAllocDir(t, h, cfg, true)
			defer cleanup()
			handle := startTask(t, h, cfg)
			must.Eq(t, c.wantShares, taskCPUWeight(t, handle))
			must.NoError(t, h.DestroyTask(cfg.ID, true))
		})
	}
}

// taskCPUWeight reads the task's CPU weight from its cgroup, as shares:
// cpu.shares on cgroup v1; on v2 cpu.weight, which must be the conversion
// of the shares Nomad's executors use (only the values the test uses).
func taskCPUWeight(t *testing.T, handle *drivers.TaskHandle) int64 {
	t.Helper()
	var st TaskState
	must.NoError(t, handle.GetDriverState(&st))
	paths := st.Process.Cgroup.Paths
	if dir := paths["cpu"]; dir != "" {
		return readCgroupInt(t, filepath.Join(dir, "cpu.shares"))
	}
	w := readCgroupInt(t, filepath.Join(paths["unified"], "cpu.weight"))
	shares := map[int64]int64{100: 1024, 17: 100, 170: 2000}[w]
	must.Positive(t, shares, must.Sprintf("cpu.weight %d is none of the test's", w))
	return shares
}

func readCgroupInt(t *testing.T, path string) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	must.NoError(t, err)
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	must.NoError(t, err)
	return v
}
