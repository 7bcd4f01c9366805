package driver

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

func TestPluginTaskConfig_validate(t *testing.T) {
	cfg := &Config{RootDir: "/var/lib/nomad-driver-csi", AllowPrivileged: true}
	cases := []struct {
		name       string
		pc         PluginTaskConfig
		privileged bool
		want       string
	}{
		{"monolith", PluginTaskConfig{ID: "hostpath", Type: "monolith", MountDir: "/csi"}, true, ""},
		{"node", PluginTaskConfig{ID: "a.b_c-1", Type: "node", MountDir: "/csi"}, true, ""},
		{"controller unprivileged", PluginTaskConfig{ID: "ctl", Type: "controller", MountDir: "/csi"}, false, ""},
		{"node unprivileged", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi"}, false, `type "node" needs privileged = true`},
		{"monolith unprivileged", PluginTaskConfig{ID: "n", Type: "monolith", MountDir: "/csi"}, false, `type "monolith" needs privileged = true`},
		{"bad type", PluginTaskConfig{ID: "n", Type: "storage", MountDir: "/csi"}, true, `csi_plugin type "storage" must be one of`},
		{"empty id", PluginTaskConfig{ID: "", Type: "node", MountDir: "/csi"}, true, "csi_plugin id"},
		{"slash id", PluginTaskConfig{ID: "a/b", Type: "node", MountDir: "/csi"}, true, "csi_plugin id \"a/b\""},
		{"dot-dot id", PluginTaskConfig{ID: "..", Type: "node", MountDir: "/csi"}, true, "csi_plugin id \"..\""},
		{"relative mount_dir", PluginTaskConfig{ID: "n", Type: "node", MountDir: "csi"}, true, "mount_dir must be an absolute path"},
		{"root mount_dir", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/"}, true, "mount_dir must be an absolute path other than"},
		{"long id", PluginTaskConfig{ID: strings.Repeat("x", 80), Type: "node", MountDir: "/csi"}, true, "too long for this node"},
		{"health_timeout", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", HealthTimeout: "2m"}, true, ""},
		{"health_timeout zero", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", HealthTimeout: "0s"}, true, ""},
		{"health_timeout no unit", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", HealthTimeout: "30"}, true, `csi_plugin health_timeout "30" must be a duration from "0s" to "1h0m0s", such as "30s"`},
		{"health_timeout negative", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", HealthTimeout: "-1s"}, true, `health_timeout "-1s" must be a duration`},
		{"health_timeout too long", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", HealthTimeout: "2h"}, true, `health_timeout "2h" must be a duration`},
		{"stop_wait", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", StopWait: "5m"}, true, ""},
		{"stop_wait zero", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", StopWait: "0s"}, true, ""},
		{"stop_wait no unit", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", StopWait: "60"}, true, `csi_plugin stop_wait "60" must be a duration from "0s" to "10m0s", such as "1m"`},
		{"stop_wait negative", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", StopWait: "-1s"}, true, `stop_wait "-1s" must be a duration`},
		{"stop_wait too long", PluginTaskConfig{ID: "n", Type: "node", MountDir: "/csi", StopWait: "11m"}, true, `stop_wait "11m" must be a duration`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.pc.validate(cfg, c.privileged)
			if c.want == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, c.want)
		})
	}
}

func TestConfig_rootDirTooLongForSockets(t *testing.T) {
	c := Config{RootDir: "/" + strings.Repeat("r", 90), CgroupParent: "x"}
	err := c.validate()
	must.ErrorContains(t, err, "root_dir")
	must.ErrorContains(t, err, "is too long")
	c.PluginSocketDirs = []string{"relative"}
	c.RootDir = "/short"
	must.ErrorContains(t, c.validate(), "plugin_socket_dirs[0] must be an absolute path")
}

func TestStartTask_pluginTaskGetsSocketAndStageRoot(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	conf := d.currentConfig()
	cfg := taskConfig(t, TaskConfig{
		Command:    "/usr/bin/plugin",
		Privileged: true,
		CSIPlugin:  &PluginTaskConfig{ID: "fixture", Type: "monolith", MountDir: "/csi"},
	})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)

	spec := d.started[0]
	must.SliceContains(t, spec.Env, "CSI_ENDPOINT=unix:///csi/csi.sock")
	must.SliceContains(t, spec.Mounts, executor.Mount{
		Source: filepath.Join(conf.RootDir, "plugins", "fixture"), Target: "/csi", Propagation: "private",
	})
	must.SliceContains(t, spec.Mounts, executor.Mount{
		Source: filepath.Join(conf.RootDir, "mnt"), Target: filepath.Join(conf.RootDir, "mnt"), Propagation: "bidirectional",
	})
	must.DirExists(t, filepath.Join(conf.RootDir, "plugins", "fixture"))
	st, ok := d.prober.Get("fixture")
	must.True(t, ok)
	must.Eq(t, cfg.ID, st.TaskID)
	must.Eq(t, filepath.Join(conf.RootDir, "plugins", "fixture", "csi.sock"), st.Socket)

	// The plugin shows in the fingerprint, unhealthy until its socket answers.
	fp := d.buildFingerprint()
	healthy, ok := fp.Attributes["driver.csi.plugin.fixture.healthy"].GetBool()
	must.True(t, ok)
	must.False(t, healthy)
	plugins, _ := fp.Attributes["driver.csi.plugins"].GetString()
	must.Eq(t, "fixture", plugins)

	// A second task cannot serve the same id while the first runs.
	other := taskConfig(t, TaskConfig{
		Command:    "/usr/bin/plugin",
		Privileged: true,
		CSIPlugin:  &PluginTaskConfig{ID: "fixture", Type: "node", MountDir: "/csi"},
	})
	other.ID, other.Name, other.AllocID = "alloc-2/web/def", "other", "alloc-2"
	_, _, err = d.StartTask(other)
	must.ErrorContains(t, err, `csi_plugin id "fixture" is already served on this node by task "web"`)
	must.Len(t, 1, d.started)

	// Once the first task is gone, a new one (Nomad's restart) takes the id.
	must.NoError(t, d.DestroyTask(cfg.ID, true))
	_, ok = d.prober.Get("fixture")
	must.True(t, ok)
	_, _, err = d.StartTask(other)
	must.NoError(t, err)
	st, _ = d.prober.Get("fixture")
	must.Eq(t, other.ID, st.TaskID)
}

func TestStartTask_controllerPluginUnprivileged(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{
		Command:   "/usr/bin/plugin",
		CSIPlugin: &PluginTaskConfig{ID: "ctl", Type: "controller", MountDir: "/plugin"},
	})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	spec := d.started[0]
	must.False(t, spec.Privileged)
	must.Len(t, 1, spec.Mounts)
	must.Eq(t, "/plugin", spec.Mounts[0].Target)
}

func TestStartTask_pluginMountDirClash(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	cfg := taskConfig(t, TaskConfig{
		Command:    "/usr/bin/plugin",
		Privileged: true,
		CSIPlugin:  &PluginTaskConfig{ID: "p", Type: "node", MountDir: "/csi"},
	})
	cfg.Mounts = []*drivers.MountConfig{{TaskPath: "/csi", HostPath: "/srv/x"}}
	_, _, err := d.StartTask(cfg)
	must.ErrorContains(t, err, `csi_plugin mount_dir "/csi" is also the path of another mount`)
	must.SliceEmpty(t, d.started)
	// The refused task did not keep the id.
	cfg.Mounts = nil
	_, _, err = d.StartTask(cfg)
	must.NoError(t, err)
}

// A mount_dir spelled with a trailing slash or a dot named the same
// directory as another mount of the task but passed the clash check,
// which compared it as written: the task got two mounts at its /secrets,
// the socket directory over its own secrets or under them.
func TestStartTask_pluginMountDirClashSpelling(t *testing.T) {
	for _, dir := range []string{"/secrets/", "/secrets/.", "/local/../secrets"} {
		t.Run(dir, func(t *testing.T) {
			d := newTestDriver(t, Config{Enabled: true})
			cfg := taskConfig(t, TaskConfig{
				Command:   "/usr/bin/plugin",
				CSIPlugin: &PluginTaskConfig{ID: "ctl", Type: "controller", MountDir: dir},
			})
			cfg.AllocDir = t.TempDir()
			must.NoError(t, os.MkdirAll(cfg.TaskDir().SecretsDir, 0o755))
			_, _, err := d.StartTask(cfg)
			must.ErrorContains(t, err, `csi_plugin mount_dir "/secrets" is also the path of another mount`)
			must.SliceEmpty(t, d.started)
		})
	}
	// Written so, it is the directory it names.
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{
		Command:   "/usr/bin/plugin",
		CSIPlugin: &PluginTaskConfig{ID: "ctl", Type: "controller", MountDir: "/plugin/"},
	})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	must.Eq(t, "/plugin", d.started[0].Mounts[0].Target)
	must.SliceContains(t, d.started[0].Env, "CSI_ENDPOINT=unix:///plugin/csi.sock")
}
