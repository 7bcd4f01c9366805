package driver

import (
	"fmt"
	"math"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// decodeConfig decodes the agent's `config` block for the plugin (what
// configSpec's defaults make when there is none) and validates it.
func decodeConfig(c *base.Config) (Config, error) {
	var cfg Config
	if c != nil && len(c.PluginConfig) != 0 {
		if err := base.MsgPackDecode(c.PluginConfig, &cfg); err != nil {
			if bad := wholeNumberKeys(c.PluginConfig); bad != nil {
				return Config{}, fmt.Errorf("invalid csi plugin config: %w", bad)
			}
			return Config{}, fmt.Errorf("failed to decode the csi plugin config: %w", err)
		}
	} else {
		cfg = defaultConfig()
	}
	cfg.RootDir = filepath.Clean(cfg.RootDir)
	if err := cfg.validate(); err != nil {
		return Config{}, fmt.Errorf("invalid csi plugin config: %w", err)
	}
	return cfg, nil
}

// wholeNumberKeys says which "number" key of the plugin's config holds
// what its int field cannot: the spec takes any number (1.5, 1e30), the
// decoder then fails naming only a byte position. nil when none does.
func wholeNumberKeys(raw []byte) error {
	var m map[string]any
	if base.MsgPackDecode(raw, &m) != nil {
		return nil
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if a := configSpec.GetObject().GetAttributes()[k]; a == nil || attrType(a) != "number" {
			continue
		}
		switch v := m[k].(type) {
		case nil, int64, uint64:
			if u, ok := v.(uint64); ok && u > math.MaxInt64 {
				return fmt.Errorf("%s must be a whole number, got %d", k, u)
			}
		default:
			return fmt.Errorf("%s must be a whole number, got %v", k, v)
		}
	}
	return nil
}

// attrType is the HCL type of an attribute spec, with or without a
// default.
func attrType(s *hclspec.Spec) string {
	if d := s.GetDefault(); d != nil {
		s = d.GetPrimary()
	}
	return s.GetAttr().GetType()
}

// decodeTaskConfig decodes a task's `config` block and validates it against
// the agent's configuration.
func decodeTaskConfig(cfg *drivers.TaskConfig, conf *Config) (*TaskConfig, error) {
	var tc TaskConfig
	if err := cfg.DecodeDriverConfig(&tc); err != nil {
		return nil, fmt.Errorf("failed to decode task config: %w", err)
	}
	if err := tc.validate(conf); err != nil {
		return nil, fmt.Errorf("invalid task config: %w", err)
	}
	return &tc, nil
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
	"privileged_plugins_only": hclspec.NewDefault(
		hclspec.NewAttr("privileged_plugins_only", "bool", false),
		hclspec.NewLiteral("true"),
	),
	"allow_cross_namespace_volumes": hclspec.NewDefault(
		hclspec.NewAttr("allow_cross_namespace_volumes", "bool", false),
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
	"plugin_socket_dirs": hclspec.NewAttr("plugin_socket_dirs", "list(string)", false),
	// The least CPU weight of a CSI plugin task the operator granted
	// (grantedPluginShares).
	"plugin_cpu_shares": hclspec.NewDefault(
		hclspec.NewAttr("plugin_cpu_shares", "number", false),
		hclspec.NewLiteral(strconv.Itoa(DefaultPluginCPUShares)),
	),
	// Isolation of tasks that are not privileged, with the names and
	// defaults of Nomad's exec driver.
	// A block of quoted keys, as exec's client chroot_env: the agent's
	// configuration is HCL1, which hands a map attribute over as a list.
	"chroot_env": hclspec.NewBlockAttrs("chroot_env", "string", false),
	"default_pid_mode": hclspec.NewDefault(
		hclspec.NewAttr("default_pid_mode", "string", false),
		hclspec.NewLiteral(`"private"`),
	),
	"default_ipc_mode": hclspec.NewDefault(
		hclspec.NewAttr("default_ipc_mode", "string", false),
		hclspec.NewLiteral(`"private"`),
	),
	"allow_caps": hclspec.NewDefault(
		hclspec.NewAttr("allow_caps", "list(string)", false),
		hclspec.NewLiteral(defaultAllowCapsHCL),
	),
	"allow_host_namespaces": hclspec.NewDefault(
		hclspec.NewAttr("allow_host_namespaces", "bool", false),
		hclspec.NewLiteral("false"),
	),
	"pids_limit": hclspec.NewDefault(
		hclspec.NewAttr("pids_limit", "number", false),
		hclspec.NewLiteral(strconv.Itoa(DefaultPidsLimit)),
	),
	"denied_host_uids": hclspec.NewAttr("denied_host_uids", "string", false),
	"denied_host_gids": hclspec.NewAttr("denied_host_gids", "string", false),
	// A bounded tmpfs /tmp (tmp.go).
	"tmp_size":   hclspec.NewAttr("tmp_size", "string", false),
	"tmp_inodes": hclspec.NewAttr("tmp_inodes", "number", false),
	// Groups a task's user = "name:group" may name although the user is
	// not a member (see checkUserGroup).
	"allow_user_groups": hclspec.NewAttr("allow_user_groups", "list(string)", false),
	// The operator's grants of privilege (grant.go).
	"privileged_grant": privilegedGrantSpec,
	// The operator's grants of volumes to namespaces (volumegrant.go).
	"volume_grant": volumeGrantSpec,
	// Stats and metrics (telemetry.go).
	"volume_stats_interval": hclspec.NewDefault(
		hclspec.NewAttr("volume_stats_interval", "string", false),
		hclspec.NewLiteral(fmt.Sprintf("%q", DefaultVolumeStatsInterval)),
	),
	"metrics_address":    hclspec.NewAttr("metrics_address", "string", false),
	"metrics_token_file": hclspec.NewAttr("metrics_token_file", "string", false),
	// Refused, with why (telemetry.go): the agent's config is no place
	// for a secret.
	"metrics_token": hclspec.NewAttr("metrics_token", "string", false),
	// The node's total CPU compute in MHz for task CPU stats, as the
	// agent's cpu_total_compute; 0 measures it (cpuspeed.go).
	"cpu_total_compute": hclspec.NewDefault(
		hclspec.NewAttr("cpu_total_compute", "number", false),
		hclspec.NewLiteral("0"),
	),
	// Images (images.go).
	"auth": hclspec.NewBlock("auth", false, hclspec.NewObject(map[string]*hclspec.Spec{
		"config": hclspec.NewAttr("config", "string", false),
		"helper": hclspec.NewAttr("helper", "string", false),
	})),
	"registry_ca_file":    hclspec.NewAttr("registry_ca_file", "string", false),
	"insecure_registries": hclspec.NewAttr("insecure_registries", "list(string)", false),
	"local_image_dirs":    hclspec.NewAttr("local_image_dirs", "list(string)", false),
	"image_gc": hclspec.NewDefault(
		hclspec.NewAttr("image_gc", "string", false),
		hclspec.NewLiteral(fmt.Sprintf("%q", DefaultImageGC)),
	),
	"image_max_layers": hclspec.NewDefault(
		hclspec.NewAttr("image_max_layers", "number", false),
		hclspec.NewLiteral(strconv.Itoa(image.DefaultMaxLayers)),
	),
	"image_max_size": hclspec.NewDefault(
		hclspec.NewAttr("image_max_size", "string", false),
		hclspec.NewLiteral(fmt.Sprintf("%q", DefaultImageMaxSize)),
	),
	"dangling_tasks": hclspec.NewBlock("dangling_tasks", false, hclspec.NewObject(map[string]*hclspec.Spec{
		"enabled": hclspec.NewDefault(
			hclspec.NewAttr("enabled", "bool", false),
			hclspec.NewLiteral("true"),
		),
		"dry_run": hclspec.NewDefault(
			hclspec.NewAttr("dry_run", "bool", false),
			hclspec.NewLiteral("false"),
		),
		"grace": hclspec.NewDefault(
			hclspec.NewAttr("grace", "string", false),
			hclspec.NewLiteral(fmt.Sprintf("%q", DefaultDanglingGrace)),
		),
		"period": hclspec.NewDefault(
			hclspec.NewAttr("period", "string", false),
			hclspec.NewLiteral(fmt.Sprintf("%q", DefaultDanglingPeriod)),
		),
	})),
})

// defaultAllowCapsHCL is allow_caps when the operator does not set it: the
// capabilities a task has by default (Nomad exec's list), so cap_add can
// add nothing beyond them unless the operator says so.
const defaultAllowCapsHCL = `["AUDIT_WRITE","CHOWN","DAC_OVERRIDE","FOWNER","FSETID","KILL","MKNOD","NET_BIND_SERVICE","SETFCAP","SETGID","SETPCAP","SETUID","SYS_CHROOT"]`

// taskConfigSpec is the `config` block of a task with `driver = "csi"`.
var taskConfigSpec = hclspec.NewObject(map[string]*hclspec.Spec{
	"command": hclspec.NewAttr("command", "string", false),
	"image":   hclspec.NewAttr("image", "string", false),
	"auth": hclspec.NewBlock("auth", false, hclspec.NewObject(map[string]*hclspec.Spec{
		"username": hclspec.NewAttr("username", "string", false),
		"password": hclspec.NewAttr("password", "string", false),
	})),
	"image_pull_timeout": hclspec.NewDefault(
		hclspec.NewAttr("image_pull_timeout", "string", false),
		hclspec.NewLiteral(fmt.Sprintf("%q", DefaultImagePullTimeout)),
	),
	"force_pull": hclspec.NewAttr("force_pull", "bool", false),
	"args":       hclspec.NewAttr("args", "list(string)", false),
	"work_dir":   hclspec.NewAttr("work_dir", "string", false),
	"privileged": hclspec.NewAttr("privileged", "bool", false),
	"pid_mode":   hclspec.NewAttr("pid_mode", "string", false),
	"ipc_mode":   hclspec.NewAttr("ipc_mode", "string", false),
	"cap_add":    hclspec.NewAttr("cap_add", "list(string)", false),
	"cap_drop":   hclspec.NewAttr("cap_drop", "list(string)", false),
	// An image task's root and command (image_root.go).
	"entrypoint":      hclspec.NewAttr("entrypoint", "list(string)", false),
	"readonly_rootfs": hclspec.NewAttr("readonly_rootfs", "bool", false),
	"volume":          volumeSpec,
	"csi_plugin": hclspec.NewBlock("csi_plugin", false, hclspec.NewObject(map[string]*hclspec.Spec{
		"id":   hclspec.NewAttr("id", "string", true),
		"type": hclspec.NewAttr("type", "string", true),
		"mount_dir": hclspec.NewDefault(
			hclspec.NewAttr("mount_dir", "string", false),
			hclspec.NewLiteral(fmt.Sprintf("%q", DefaultPluginMountDir)),
		),
		"health_timeout": hclspec.NewDefault(
			hclspec.NewAttr("health_timeout", "string", false),
			hclspec.NewLiteral(fmt.Sprintf("%q", DefaultPluginHealthTimeout)),
		),
		"stop_wait": hclspec.NewDefault(
			hclspec.NewAttr("stop_wait", "string", false),
			hclspec.NewLiteral(fmt.Sprintf("%q", DefaultPluginStopWait)),
		),
	})),
})

// volumeSpec is a task's `volume "<name>" { ... }` block.
var volumeSpec = hclspec.NewBlockMap("volume", []string{"name"}, hclspec.NewObject(map[string]*hclspec.Spec{
	"plugin_id":   hclspec.NewAttr("plugin_id", "string", true),
	"volume_id":   hclspec.NewAttr("volume_id", "string", true),
	"destination": hclspec.NewAttr("destination", "string", true),
	"read_only":   hclspec.NewAttr("read_only", "bool", false),
	"access_mode": hclspec.NewDefault(
		hclspec.NewAttr("access_mode", "string", false),
		hclspec.NewLiteral(`"single-node-writer"`),
	),
	"attachment_mode": hclspec.NewDefault(
		hclspec.NewAttr("attachment_mode", "string", false),
		hclspec.NewLiteral(`"file-system"`),
	),
	"mount_options": hclspec.NewBlock("mount_options", false, hclspec.NewObject(map[string]*hclspec.Spec{
		"fs_type":     hclspec.NewAttr("fs_type", "string", false),
		"mount_flags": hclspec.NewAttr("mount_flags", "list(string)", false),
	})),
	"context": hclspec.NewBlockAttrs("context", "string", false),
	"secrets": hclspec.NewBlockAttrs("secrets", "string", false),
	// mount_group = true: when the plugin lacks VOLUME_MOUNT_GROUP, the
	// driver gives the volume's root directory the task's group (setgid,
	// g+rwx) after publishing, so a task that does not run as root can
	// write it. Only the task's own group, only the root directory.
	"mount_group": hclspec.NewAttr("mount_group", "bool", false),
	// secrets_file = "secrets/vol.env": the secrets from a KEY=VALUE file
	// a template renders in the task directory (see secretsfile.go).
	"secrets_file": hclspec.NewAttr("secrets_file", "string", false),
	"create": hclspec.NewBlock("create", false, hclspec.NewObject(map[string]*hclspec.Spec{
		"capacity_min": hclspec.NewAttr("capacity_min", "string", false),
		"capacity_max": hclspec.NewAttr("capacity_max", "string", false),
		"parameters":   hclspec.NewBlockAttrs("parameters", "string", false),
	})),
}))

// Config is the decoded agent-side configuration.
type Config struct {
	Enabled         bool `codec:"enabled"`
	AllowPrivileged bool `codec:"allow_privileged"`
	// PrivilegedPluginsOnly limits privileged = true to CSI plugin tasks:
	// tasks with this driver's csi_plugin block, and plugin tasks of
	// Nomad's own task-level csi_plugin block (see nomadPluginTask).
	PrivilegedPluginsOnly bool `codec:"privileged_plugins_only"`
	// AllowCrossNamespaceVolumes lets a task use a volume that belongs to
	// another Nomad namespace on this node (the namespace of the job that
	// created or first had it published).
	AllowCrossNamespaceVolumes bool     `codec:"allow_cross_namespace_volumes"`
	RootDir                    string   `codec:"root_dir"`
	CgroupParent               string   `codec:"cgroup_parent"`
	PluginSocketDirs           []string `codec:"plugin_socket_dirs"`
	// PluginCPUShares is the least CPU weight (cpu.shares, the unit of a
	// task's cpu) of a CSI plugin task the operator granted; 0 gives
	// plugin tasks the weight of their cpu, as any task. See
	// grantedPluginShares.
	PluginCPUShares int `codec:"plugin_cpu_shares"`

	ChrootEnv      map[string]string `codec:"chroot_env"`
	DefaultPIDMode string            `codec:"default_pid_mode"`
	DefaultIPCMode string            `codec:"default_ipc_mode"`
	AllowCaps      []string          `codec:"allow_caps"`
	// AllowHostNamespaces lets a task that is not privileged ask for
	// pid_mode or ipc_mode "host" itself (see checkHostModes).
	AllowHostNamespaces bool `codec:"allow_host_namespaces"`
	// PidsLimit caps the processes and threads of a task that is not
	// privileged (its cgroup's pids.max); 0 leaves them unlimited. A
	// task's fork bomb, as nobody too, otherwise takes every PID of the
	// host (pid_max is 32768 on many): the driver, Nomad and every other
	// allocation then cannot start a process or thread, and so cannot
	// tear a volume down. Privileged tasks are not limited.
	PidsLimit      int    `codec:"pids_limit"`
	DeniedHostUIDs string `codec:"denied_host_uids"`
	DeniedHostGIDs string `codec:"denied_host_gids"`
	// AllowUserGroups are groups (names or gids) that a task's user =
	// "name:group" may name although the user is not a member of them in
	// the host's group database.
	AllowUserGroups []string `codec:"allow_user_groups"`
	// PrivilegedGrants say which tasks may run privileged, and reserve
	// plugin ids for them (see authorize).
	PrivilegedGrants []PrivilegedGrant `codec:"privileged_grant"`
	// VolumeGrants, when there are any, say which namespaces and jobs
	// may use which plugins' volumes (see checkVolumeGrants).
	VolumeGrants []VolumeGrant `codec:"volume_grant"`
	// TmpSize ("64MiB"), when set, makes the /tmp of a task that is not
	// privileged a tmpfs of that size with TmpInodes inodes (default: one
	// per 4 KiB, at least 1024) instead of Nomad's task tmp/ directory on
	// the allocation's disk. See tmp.go.
	TmpSize   string `codec:"tmp_size"`
	TmpInodes int    `codec:"tmp_inodes"`

	// VolumeStatsInterval is how often each published volume is sampled
	// with NodeGetVolumeStats ("0" or "0s": never); MetricsAddress is the
	// host:port or unix:///path of the Prometheus endpoint ("": none),
	// MetricsTokenFile the root-only file holding the bearer token it
	// asks for (required on TCP). MetricsToken is refused. See
	// telemetry.go.
	VolumeStatsInterval string `codec:"volume_stats_interval"`
	MetricsAddress      string `codec:"metrics_address"`
	MetricsTokenFile    string `codec:"metrics_token_file"`
	MetricsToken        string `codec:"metrics_token"`

	// CPUTotalCompute is the node's total CPU compute in MHz, the agent's
	// cpu_total_compute repeated where the driver's own measurement of
	// the CPU speed is wrong (see cpuspeed.go); 0 measures it. It only
	// turns task CPU usage into the MHz ("ticks") Nomad shows.
	CPUTotalCompute int `codec:"cpu_total_compute"`

	// Images: see images.go.
	Auth               *PluginAuth `codec:"auth"`
	RegistryCAFile     string      `codec:"registry_ca_file"`
	InsecureRegistries []string    `codec:"insecure_registries"`
	LocalImageDirs     []string    `codec:"local_image_dirs"`
	ImageGC            string      `codec:"image_gc"`
	ImageMaxLayers     int         `codec:"image_max_layers"`
	ImageMaxSize       string      `codec:"image_max_size"`

	// DanglingTasks is the reconciler of tasks an earlier driver process
	// handed to Nomad that Nomad never takes back (dangling.go); nil: its
	// defaults.
	DanglingTasks *DanglingTasks `codec:"dangling_tasks"`
}

// DefaultPluginCPUShares is plugin_cpu_shares' default: the kernel's
// default weight of a cgroup v1 group, which is also the weight of one
// process of the host's root group there (cpu.weight 100 on cgroup v2, the
// kernel's default weight of a group there too).
const DefaultPluginCPUShares = 1024

// maxPluginCPUShares is the kernel's largest cpu.shares.
const maxPluginCPUShares = 262144

// DefaultPidsLimit is pids_limit's default: systemd's default TasksMax
// for a 32768 pid_max, far above what a task runs, far below the host's.
const DefaultPidsLimit = 4096

// maxPidsLimit is the largest pids.max the kernel takes (PID_MAX_LIMIT on
// 64-bit): a larger pids_limit would fail every task that is not
// privileged at its start.
const maxPidsLimit = 4 << 20

// validCgroupParent reports whether cgroup_parent is a group path the
// cgroups package and the kernel take: relative, clean, no "." or ".."
// element, no control character (the kernel refuses a newline).
func validCgroupParent(p string) bool {
	if p == "" || filepath.IsAbs(p) || filepath.Clean(p) != p || strings.Contains(p, "..") || strings.ContainsFunc(p, unicode.IsControl) {
		return false
	}
	return !slices.Contains(strings.Split(p, "/"), ".")
}

// defaultConfig is the configuration of an agent that gives the plugin no
// config block: what configSpec's defaults make.
func defaultConfig() Config {
	return Config{Enabled: true, PrivilegedPluginsOnly: true, RootDir: DefaultRootDir, CgroupParent: DefaultCgroupParent,
		DefaultPIDMode: IsolationModePrivate, DefaultIPCMode: IsolationModePrivate, AllowCaps: executor.DefaultCapabilities,
		VolumeStatsInterval: DefaultVolumeStatsInterval, PidsLimit: DefaultPidsLimit, PluginCPUShares: DefaultPluginCPUShares,
		ImageGC: DefaultImageGC, ImageMaxLayers: image.DefaultMaxLayers, ImageMaxSize: DefaultImageMaxSize}
}

func validIsolationMode(key, mode string, allowEmpty bool) error {
	switch {
	case mode == IsolationModePrivate, mode == IsolationModeHost, mode == "" && allowEmpty:
		return nil
	}
	return fmt.Errorf("%s must be %q or %q, got %q", key, IsolationModePrivate, IsolationModeHost, mode)
}

// validate checks the agent-side configuration; its errors name the key.
func (c *Config) validate() error {
	if c.RootDir == "" || !filepath.IsAbs(c.RootDir) {
		return fmt.Errorf("root_dir must be an absolute path, got %q", c.RootDir)
	}
	if filepath.Clean(c.RootDir) == "/" {
		return fmt.Errorf("root_dir must not be \"/\": choose a directory the driver owns, such as %q", DefaultRootDir)
	}
	if !validCgroupParent(c.CgroupParent) {
		return fmt.Errorf("cgroup_parent must be a relative cgroup name such as %q, got %q", DefaultCgroupParent, c.CgroupParent)
	}
	if room := maxSocketPath - len(c.RootDir) - len("/plugins//"+pluginSocketName); room < minPluginIDRoom {
		return fmt.Errorf("root_dir %q is too long: CSI socket paths under it must fit in %d bytes, which leaves plugin ids only %d bytes; use a root_dir of at most %d bytes",
			c.RootDir, maxSocketPath, max(room, 0), len(c.RootDir)-(minPluginIDRoom-room))
	}
	for i, dir := range c.PluginSocketDirs {
		if !filepath.IsAbs(dir) {
			return fmt.Errorf("plugin_socket_dirs[%d] must be an absolute path, got %q", i, dir)
		}
		// A task plugin's socket directory under root_dir would be found
		// again as an operator's socket, by the id its plugin names
		// itself, which the job chooses.
		if clean := filepath.Clean(dir); clean == c.RootDir || strings.HasPrefix(clean, c.RootDir+"/") {
			return fmt.Errorf("plugin_socket_dirs[%d] %q must not be root_dir %q or inside it: the sockets of plugin tasks live there, and a socket found in plugin_socket_dirs is trusted as the operator's", i, dir, c.RootDir)
		}
	}
	for src, dst := range c.ChrootEnv {
		if !filepath.IsAbs(src) || !filepath.IsAbs(dst) || filepath.Clean(dst) == "/" {
			return fmt.Errorf("chroot_env entry %q = %q must map an absolute host path to an absolute path other than \"/\" in the task", src, dst)
		}
		if reason := isolatedTargetReason(dst); reason != "" {
			return fmt.Errorf("chroot_env entry %q = %q: %s", src, dst, reason)
		}
		for _, nomadDir := range []string{"/tmp", "/alloc", "/local", "/secrets"} {
			if mounter.PathWithin(filepath.Clean(dst), nomadDir) || mounter.PathWithin(nomadDir, filepath.Clean(dst)) {
				return fmt.Errorf("chroot_env entry %q = %q: %s in the task is Nomad's directory for the task and would hide or be hidden by it; bind %q elsewhere, such as \"/opt%s\"",
					src, dst, nomadDir, src, filepath.Clean(dst))
			}
		}
	}
	if err := validIsolationMode("default_pid_mode", c.DefaultPIDMode, true); err != nil {
		return err
	}
	if err := validIsolationMode("default_ipc_mode", c.DefaultIPCMode, true); err != nil {
		return err
	}
	if _, err := parseCapSet("allow_caps", c.AllowCaps); err != nil {
		return err
	}
	if c.PidsLimit < 0 || c.PidsLimit > maxPidsLimit {
		return fmt.Errorf("pids_limit must be 0 (no limit) or a number of processes from 1 to %d (the most the kernel's pids.max takes), got %d", maxPidsLimit, c.PidsLimit)
	}
	if c.PluginCPUShares != 0 && (c.PluginCPUShares < 2 || c.PluginCPUShares > maxPluginCPUShares) {
		return fmt.Errorf("plugin_cpu_shares must be 0 (plugin tasks weigh as their cpu) or a CPU weight from 2 to %d in the unit of a task's cpu (MHz, cgroup v1 cpu.shares), got %d", maxPluginCPUShares, c.PluginCPUShares)
	}
	if c.CPUTotalCompute < 0 {
		return fmt.Errorf("cpu_total_compute must be 0 (measure the CPU speed) or the node's total CPU compute in MHz, as the agent's cpu_total_compute, got %d", c.CPUTotalCompute)
	}
	if _, _, err := c.tmpLimits(); err != nil {
		return err
	}
	if _, err := parseIDRanges("denied_host_uids", c.DeniedHostUIDs); err != nil {
		return err
	}
	if _, err := parseIDRanges("denied_host_gids", c.DeniedHostGIDs); err != nil {
		return err
	}
	for i, g := range c.AllowUserGroups {
		if strings.TrimSpace(g) == "" || strings.ContainsAny(g, ": \t") {
			return fmt.Errorf("allow_user_groups[%d] must be a group name or gid, such as \"www-data\" or \"33\", got %q", i, g)
		}
	}
	for i, g := range c.PrivilegedGrants {
		if err := g.validate(fmt.Sprintf("privileged_grant[%d]", i)); err != nil {
			return err
		}
	}
	for i, g := range c.VolumeGrants {
		if err := g.validate(fmt.Sprintf("volume_grant[%d]", i)); err != nil {
			return err
		}
	}
	if err := c.validateImages(); err != nil {
		return err
	}
	if err := c.DanglingTasks.validate(); err != nil {
		return err
	}
	return c.validateTelemetry()
}

// TaskConfig is the decoded `config` block of a task.
type TaskConfig struct {
	Command string `codec:"command"`
	// Image, Auth and ImagePullTimeout: see images.go.
	Image            string                  `codec:"image"`
	Auth             *TaskAuth               `codec:"auth"`
	ImagePullTimeout string                  `codec:"image_pull_timeout"`
	ForcePull        bool                    `codec:"force_pull"`
	Args             []string                `codec:"args"`
	WorkDir          string                  `codec:"work_dir"`
	Privileged       bool                    `codec:"privileged"`
	CSIPlugin        *PluginTaskConfig       `codec:"csi_plugin"`
	Volumes          map[string]VolumeConfig `codec:"volume"`
	PIDMode          string                  `codec:"pid_mode"`
	IPCMode          string                  `codec:"ipc_mode"`
	CapAdd           []string                `codec:"cap_add"`
	CapDrop          []string                `codec:"cap_drop"`
	// Entrypoint replaces the image's entrypoint; ReadonlyRootfs keeps
	// the image root read-only (see imageCommand, executor.ImageRoot).
	Entrypoint     []string `codec:"entrypoint"`
	ReadonlyRootfs bool     `codec:"readonly_rootfs"`
}

// PluginTaskConfig is a task's csi_plugin block: the task is a CSI plugin.
type PluginTaskConfig struct {
	// ID names the plugin on this node; volumes refer to it.
	ID string `codec:"id"`
	// Type is node, controller or monolith.
	Type string `codec:"type"`
	// MountDir is where the task finds its socket directory; the driver
	// sets CSI_ENDPOINT to the socket in it.
	MountDir string `codec:"mount_dir"`
	// HealthTimeout is how long a starting plugin may take to become
	// healthy before it is reported unhealthy (a duration; Nomad's
	// csi_plugin health_timeout). Empty in states written before it was
	// kept: DefaultPluginHealthTimeout.
	HealthTimeout string `codec:"health_timeout"`
	// StopWait bounds how long the plugin task's stop waits for the
	// teardowns of its volumes on this node that are queued or running
	// (tasks that stopped or are stopping), so that the plugin does not
	// go before their last unpublish or unstage (a duration; "0s" waits
	// for nothing). Empty in states written before it was kept:
	// DefaultPluginStopWait.
	StopWait string `codec:"stop_wait"`
}

// DefaultPluginStopWait is csi_plugin's stop_wait when unset.
const DefaultPluginStopWait = "1m"

// maxPluginStopWait bounds stop_wait: a plugin job can hold its own stop,
// and with it a node's drain, no longer than this.
const maxPluginStopWait = 10 * time.Minute

// parseStopWait reads StopWait (DefaultPluginStopWait when empty); the
// error says what would be right.
func (p *PluginTaskConfig) parseStopWait() (time.Duration, error) {
	s := p.StopWait
	if s == "" {
		s = DefaultPluginStopWait
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 || d > maxPluginStopWait {
		return 0, fmt.Errorf("csi_plugin stop_wait %q must be a duration from \"0s\" to \"%s\", such as \"1m\"", p.StopWait, maxPluginStopWait)
	}
	return d, nil
}

// stopWait is StopWait parsed; validate has checked it, so an error here
// (a state written by a driver that did not check) means the default.
func (p *PluginTaskConfig) stopWait() time.Duration {
	d, err := p.parseStopWait()
	if err != nil {
		d, _ = time.ParseDuration(DefaultPluginStopWait)
	}
	return d
}

// DefaultPluginHealthTimeout is csi_plugin's health_timeout when unset, as
// Nomad's.
const DefaultPluginHealthTimeout = "30s"

// maxPluginHealthTimeout bounds health_timeout: a plugin that takes longer
// to start is better reported unhealthy.
const maxPluginHealthTimeout = time.Hour

// parseHealthTimeout reads HealthTimeout (DefaultPluginHealthTimeout when
// empty); the error says what would be right.
func (p *PluginTaskConfig) parseHealthTimeout() (time.Duration, error) {
	s := p.HealthTimeout
	if s == "" {
		s = DefaultPluginHealthTimeout
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 || d > maxPluginHealthTimeout {
		return 0, fmt.Errorf("csi_plugin health_timeout %q must be a duration from \"0s\" to \"%s\", such as \"30s\"", p.HealthTimeout, maxPluginHealthTimeout)
	}
	return d, nil
}

// healthTimeout is HealthTimeout parsed; validate has checked it, so an
// error here (a state written by a driver that did not check) means none.
func (p *PluginTaskConfig) healthTimeout() time.Duration {
	d, _ := p.parseHealthTimeout()
	return d
}

// validate checks a task's configuration against the agent's; its errors
// name the field and say what would be right.
func (tc *TaskConfig) validate(cfg *Config) error {
	if err := tc.validateCommand(); err != nil {
		return err
	}
	if tc.WorkDir != "" && !filepath.IsAbs(tc.WorkDir) {
		return fmt.Errorf("work_dir must be an absolute path, got %q", tc.WorkDir)
	}
	if err := tc.validateImage(cfg); err != nil {
		return err
	}
	if p := tc.CSIPlugin; p != nil {
		if err := p.validate(cfg, tc.Privileged); err != nil {
			return err
		}
	}
	for name, v := range tc.Volumes {
		if err := checkSecretsFile(name, v); err != nil {
			return err
		}
	}
	// A volume block wrong in itself is refused here, before an image is
	// pulled for the task; checkVolumes checks the blocks again, with the
	// secrets a secrets_file gives.
	if len(tc.Volumes) > 0 {
		reqs, err := volumeRequests(tc.Volumes)
		if err != nil {
			return err
		}
		if err := csihook.ValidateRequests(reqs); err != nil {
			return err
		}
	}
	if err := validIsolationMode("pid_mode", tc.PIDMode, true); err != nil {
		return err
	}
	if err := validIsolationMode("ipc_mode", tc.IPCMode, true); err != nil {
		return err
	}
	if _, err := parseCapSet("cap_add", tc.CapAdd); err != nil {
		return err
	}
	if _, err := parseCapSet("cap_drop", tc.CapDrop); err != nil {
		return err
	}
	// What the node allows a task that is not privileged, before an image
	// is pulled for it; buildSpec applies the same.
	if !tc.Privileged {
		if _, _, err := taskCapabilities(cfg.allowCaps(), tc.CapAdd, tc.CapDrop); err != nil {
			return err
		}
		if err := cfg.checkHostModes(tc); err != nil {
			return err
		}
	}
	if tc.Privileged && !cfg.AllowPrivileged {
		return fmt.Errorf("privileged = true is not allowed on this node: the operator must set allow_privileged = true, and grant the job with a privileged_grant block, in the agent's config for this driver (plugin \"nomad-driver-csi\")")
	}
	return nil
}

// validateCommand checks command, entrypoint and readonly_rootfs: a task
// without an image names its program; one with an image may leave it to
// the image (see imageCommand).
func (tc *TaskConfig) validateCommand() error {
	if tc.Image == "" {
		switch {
		case strings.TrimSpace(tc.Command) == "":
			return fmt.Errorf("command must not be empty: give the program to run, such as \"/bin/sh\", or an image to run")
		case len(tc.Entrypoint) > 0:
			return fmt.Errorf("entrypoint needs an image: without one, give the program as command and its arguments as args")
		case tc.ReadonlyRootfs:
			return fmt.Errorf("readonly_rootfs needs an image: a task without one has a read-only root already")
		}
		return nil
	}
	if tc.Command != "" && strings.TrimSpace(tc.Command) != tc.Command {
		return fmt.Errorf("command %q has white space around it: give the program alone, and its arguments as args", tc.Command)
	}
	if len(tc.Entrypoint) > 0 && strings.TrimSpace(tc.Entrypoint[0]) == "" {
		return fmt.Errorf("entrypoint's first element must be the program to run, got %q", tc.Entrypoint[0])
	}
	return nil
}

// maxSocketPath is the longest unix socket path the kernel accepts
// (sun_path is 108 bytes with the terminating NUL).
const maxSocketPath = 107

// minPluginIDRoom is the shortest plugin id root_dir must leave room for.
const minPluginIDRoom = 16

// validPluginID matches the plugin ids the driver accepts: they name a
// directory and appear in attribute keys.
var validPluginID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

func (p *PluginTaskConfig) validate(cfg *Config, privileged bool) error {
	if !validPluginID.MatchString(p.ID) {
		return fmt.Errorf("csi_plugin id %q must start with a letter or digit and hold only letters, digits, '.', '_' and '-'", p.ID)
	}
	switch p.Type {
	case PluginTypeNode, PluginTypeMonolith:
		if !privileged {
			return fmt.Errorf("csi_plugin type %q needs privileged = true: node plugins mount volumes for the host", p.Type)
		}
	case PluginTypeController:
	default:
		return fmt.Errorf("csi_plugin type %q must be one of \"node\", \"controller\" or \"monolith\"", p.Type)
	}
	if !filepath.IsAbs(p.MountDir) || filepath.Clean(p.MountDir) == "/" {
		return fmt.Errorf("csi_plugin mount_dir must be an absolute path other than \"/\", got %q", p.MountDir)
	}
	if _, err := p.parseHealthTimeout(); err != nil {
		return err
	}
	if _, err := p.parseStopWait(); err != nil {
		return err
	}
	if sock := cfg.pluginSocket(p.ID); len(sock) > maxSocketPath {
		return fmt.Errorf("csi_plugin id %q is too long for this node: its socket %q would pass the %d-byte limit of unix socket paths; use an id of at most %d bytes or a shorter root_dir",
			p.ID, sock, maxSocketPath, len(p.ID)-(len(sock)-maxSocketPath))
	}
	return nil
}

// VolumeConfig is one decoded volume block.
type VolumeConfig struct {
	PluginID       string             `codec:"plugin_id"`
	VolumeID       string             `codec:"volume_id"`
	Destination    string             `codec:"destination"`
	ReadOnly       bool               `codec:"read_only"`
	AccessMode     string             `codec:"access_mode"`
	AttachmentMode string             `codec:"attachment_mode"`
	MountOptions   *MountOptions      `codec:"mount_options"`
	Context        map[string]string  `codec:"context"`
	Secrets        map[string]string  `codec:"secrets"`
	MountGroup     bool               `codec:"mount_group"`
	SecretsFile    string             `codec:"secrets_file"`
	Create         *VolumeCreateBlock `codec:"create"`
}

// MountOptions is a volume's mount_options block.
type MountOptions struct {
	FSType     string   `codec:"fs_type"`
	MountFlags []string `codec:"mount_flags"`
}

// VolumeCreateBlock is a volume's create block. Sizes are written as Nomad
// writes them: "10GiB", "512MiB".
type VolumeCreateBlock struct {
	CapacityMin string            `codec:"capacity_min"`
	CapacityMax string            `codec:"capacity_max"`
	Parameters  map[string]string `codec:"parameters"`
}

// Isolation modes of pid_mode and ipc_mode, as Nomad's exec driver spells
// them.
const (
	IsolationModePrivate = "private"
	IsolationModeHost    = "host"
)

// Plugin types, as in Nomad's csi_plugin block: the fingerprint's words.
const (
	PluginTypeNode       = string(fingerprint.TypeNode)
	PluginTypeController = string(fingerprint.TypeController)
	PluginTypeMonolith   = string(fingerprint.TypeMonolith)
)

// pluginSocketDir is the host directory holding a launched plugin's socket.
func (c *Config) pluginSocketDir(id string) string { return filepath.Join(c.RootDir, "plugins", id) }

// pluginSocket is the host path of a launched plugin's socket.
func (c *Config) pluginSocket(id string) string {
	return filepath.Join(c.RootDir, "plugins", id, pluginSocketName)
}

// pluginSocketName is the socket's name in its directory, as Nomad's.
const pluginSocketName = "csi.sock"

// stageRoot is where volumes are staged and published. Node and monolith
// plugin tasks see it at the same path with bidirectional propagation, so
// a path the driver hands to a plugin means the same on both sides.
func (c *Config) stageRoot() string { return filepath.Join(c.RootDir, "mnt") }
