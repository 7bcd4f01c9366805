package driver

import (
	"testing"

	"github.com/hashicorp/nomad/helper/pluginutils/hclspecutils"
	"github.com/hashicorp/nomad/helper/pluginutils/hclutils"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/shoenig/test/must"
	"github.com/zclconf/go-cty/cty/msgpack"
)

// agentPluginConfig is what the Nomad agent hands SetConfig for the
// plugin's config block: the block (as the agent's HCL1 parser gives it)
// decoded with the driver's spec, its defaults filled in, and encoded as
// cty msgpack.
func agentPluginConfig(t *testing.T, block map[string]any) *base.Config {
	t.Helper()
	spec, diags := hclspecutils.Convert(configSpec)
	must.False(t, diags.HasErrors(), must.Sprint(diags))
	val, diags, _ := hclutils.ParseHclInterface(block, spec, nil)
	must.False(t, diags.HasErrors(), must.Sprintf("the spec refuses %v: %v", block, diags))
	b, err := msgpack.Marshal(val, val.Type())
	must.NoError(t, err)
	return &base.Config{PluginConfig: b}
}

// A value the spec takes but the driver cannot use is refused when the
// config is loaded, with an error that names the key and what would be
// right, not at every task's start.
func TestDecodeConfig_badValuesNameTheKey(t *testing.T) {
	cases := []struct {
		name  string
		block map[string]any
		want  string
	}{
		// "number" keys take any number; the driver's are whole.
		{"pids_limit fraction", map[string]any{"pids_limit": 1.5}, `pids_limit must be a whole number, got 1.5`},
		{"pids_limit past int64", map[string]any{"pids_limit": 1e30}, `pids_limit must be a whole number`},
		{"plugin_cpu_shares fraction", map[string]any{"plugin_cpu_shares": 512.5}, `plugin_cpu_shares must be a whole number, got 512.5`},
		{"tmp_inodes fraction", map[string]any{"tmp_size": "64MiB", "tmp_inodes": 0.5}, `tmp_inodes must be a whole number, got 0.5`},
		{"cpu_total_compute fraction", map[string]any{"cpu_total_compute": 2400.5}, `cpu_total_compute must be a whole number, got 2400.5`},
		{"image_max_layers fraction", map[string]any{"image_max_layers": 1.25}, `image_max_layers must be a whole number, got 1.25`},
		// pids.max takes at most PID_MAX_LIMIT: above it, every task
		// that is not privileged would fail to start.
		{"pids_limit above the kernel's", map[string]any{"pids_limit": 4194305}, `pids_limit must be 0 (no limit) or a number of processes from 1 to 4194304`},
		// What the cgroups package refuses at every task's start.
		{"cgroup_parent dot", map[string]any{"cgroup_parent": "."}, `cgroup_parent must be a relative cgroup name such as "nomad-csi", got "."`},
		{"cgroup_parent double slash", map[string]any{"cgroup_parent": "nomad//csi"}, `cgroup_parent must be a relative cgroup name such as "nomad-csi", got "nomad//csi"`},
		{"cgroup_parent trailing slash", map[string]any{"cgroup_parent": "nomad-csi/"}, `got "nomad-csi/"`},
		{"cgroup_parent dot element", map[string]any{"cgroup_parent": "nomad/./csi"}, `got "nomad/./csi"`},
		// The kernel refuses a cgroup name with a newline (EINVAL).
		{"cgroup_parent newline", map[string]any{"cgroup_parent": "nomad\ncsi"}, `got "nomad\ncsi"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := decodeConfig(agentPluginConfig(t, c.block))
			must.ErrorContains(t, err, c.want)
			must.ErrorContains(t, err, "invalid csi plugin config: ")
		})
	}

	for _, ok := range []map[string]any{
		{},
		{"pids_limit": 4194304, "plugin_cpu_shares": 2, "cpu_total_compute": 9600, "image_max_layers": 500},
		{"pids_limit": 0, "plugin_cpu_shares": 0},
		{"tmp_size": "64MiB", "tmp_inodes": 100000},
		{"cgroup_parent": "system.slice/nomad-csi"},
	} {
		_, err := decodeConfig(agentPluginConfig(t, ok))
		must.NoError(t, err, must.Sprintf("%v", ok))
	}
}
