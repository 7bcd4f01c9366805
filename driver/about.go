package driver

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/hashicorp/nomad/plugins/drivers/fsisolation"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"
)

const (
	// PluginName is the name jobs use in `driver = "csi"`. (Operators
	// configure the plugin under the name of its file in plugin_dir.)
	PluginName = "csi"

	// DefaultRootDir is where the driver keeps its state when the operator
	// does not say otherwise.
	DefaultRootDir = "/var/lib/nomad-driver-csi"

	// DefaultCgroupParent is the control group every task goes under.
	DefaultCgroupParent = "nomad-csi"

	// taskHandleVersion is the version of TaskState below.
	taskHandleVersion = 1
)

// Version is the driver's version, set at build time with
// -ldflags "-X github.com/nomad-driver-csi/nomad-driver-csi/driver.Version=...".
var Version = "0.1.0-dev"

var pluginInfo = &base.PluginInfoResponse{
	Type:              base.PluginTypeDriver,
	PluginApiVersions: []string{drivers.ApiVersion010},
	PluginVersion:     Version,
	Name:              PluginName,
}

// configSpec is the agent-side configuration, the `config` block of
// `plugin "nomad-driver-csi"`.
var configSpec = hclspec.NewObject(map[string]*hclspec.Spec{
	"enabled": hclspec.NewDefault(
		hclspec.NewAttr("enabled", "bool", false),
		hclspec.NewLiteral("true"),
	),
	"allow_privileged": hclspec.NewDefault(
		hclspec.NewAttr("allow_privileged", "bool", false),
		hclspec.NewLiteral("false"),
	),
	"root_dir": hclspec.NewDefault(
		hclspec.NewAttr("root_dir", "string", false),
		hclspec.NewLiteral(fmt.Sprintf("%q", DefaultRootDir)),
	),
	"cgroup_parent": hclspec.NewDefault(
		hclspec.NewAttr("cgroup_parent", "string", false),
		hclspec.NewLiteral(fmt.Sprintf("%q", DefaultCgroupParent)),
	),
})

// taskConfigSpec is the `config` block of a task with `driver = "csi"`.
var taskConfigSpec = hclspec.NewObject(map[string]*hclspec.Spec{
	"command":    hclspec.NewAttr("command", "string", true),
	"args":       hclspec.NewAttr("args", "list(string)", false),
	"work_dir":   hclspec.NewAttr("work_dir", "string", false),
	"privileged": hclspec.NewAttr("privileged", "bool", false),
})

var capabilities = &drivers.Capabilities{
	SendSignals:       true,
	Exec:              true,
	FSIsolation:       fsisolation.None,
	NetIsolationModes: []drivers.NetIsolationMode{drivers.NetIsolationModeHost},
	MountConfigs:      drivers.MountConfigSupportAll,
}

// Config is the decoded agent-side configuration.
type Config struct {
	Enabled         bool   `codec:"enabled"`
	AllowPrivileged bool   `codec:"allow_privileged"`
	RootDir         string `codec:"root_dir"`
	CgroupParent    string `codec:"cgroup_parent"`
}

// validate checks the agent-side configuration; its errors name the key.
func (c *Config) validate() error {
	if c.RootDir == "" || !filepath.IsAbs(c.RootDir) {
		return fmt.Errorf("root_dir must be an absolute path, got %q", c.RootDir)
	}
	if filepath.Clean(c.RootDir) == "/" {
		return fmt.Errorf("root_dir must not be \"/\": choose a directory the driver owns, such as %q", DefaultRootDir)
	}
	if c.CgroupParent == "" || strings.Contains(c.CgroupParent, "..") || filepath.IsAbs(c.CgroupParent) {
		return fmt.Errorf("cgroup_parent must be a relative cgroup name such as %q, got %q", DefaultCgroupParent, c.CgroupParent)
	}
	return nil
}

// TaskConfig is the decoded `config` block of a task.
type TaskConfig struct {
	Command    string   `codec:"command"`
	Args       []string `codec:"args"`
	WorkDir    string   `codec:"work_dir"`
	Privileged bool     `codec:"privileged"`
}

// validate checks a task's configuration against the agent's; its errors
// name the field and say what would be right.
func (tc *TaskConfig) validate(cfg *Config) error {
	if strings.TrimSpace(tc.Command) == "" {
		return fmt.Errorf("command must not be empty: give the program to run, such as \"/bin/sh\"")
	}
	if tc.WorkDir != "" && !filepath.IsAbs(tc.WorkDir) {
		return fmt.Errorf("work_dir must be an absolute path, got %q", tc.WorkDir)
	}
	if tc.Privileged && !cfg.AllowPrivileged {
		return fmt.Errorf("privileged = true is not allowed on this node: the operator must set allow_privileged = true in the agent's config for this driver (plugin \"nomad-driver-csi\")")
	}
	return nil
}
