package driver

import (
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/helper/pluginutils/hclutils"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// nomadPluginMounts are the mounts Nomad's csi_plugin_supervisor hook gives
// a plugin task of allocation allocID, with the client's state_dir state.
func nomadPluginMounts(state, allocID string) []*drivers.MountConfig {
	return []*drivers.MountConfig{
		{TaskPath: "/csi", HostPath: filepath.Join(state, "csi", "plugins", allocID), PropagationMode: "bidirectional"},
		{TaskPath: "/local/csi", HostPath: filepath.Join(state, "csi", "monolith", "hostpath"), PropagationMode: "bidirectional"},
		{TaskPath: "/dev", HostPath: "/dev"},
	}
}

// nomadControllerMounts are those mounts for a plugin of type controller:
// the same three, the staging directory under csi/controller.
func nomadControllerMounts(state, allocID string) []*drivers.MountConfig {
	ms := nomadPluginMounts(state, allocID)
	ms[1].HostPath = filepath.Join(state, "csi", "controller", "hostpath")
	return ms
}

func TestAuthorize_privilegedPluginsOnly(t *testing.T) {
	const alloc = "5b3c2f1e-0000-4000-8000-000000000001"
	state := "/var/lib/nomad/client"
	plugin := &PluginTaskConfig{ID: "p", Type: "node", MountDir: "/csi"}
	only := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, PrivilegedGrants: grantAll}
	cases := []struct {
		name   string
		conf   *Config
		tc     TaskConfig
		mounts []*drivers.MountConfig
		env    map[string]string
		ok     bool
	}{
		{"unprivileged", only, TaskConfig{}, nil, nil, true},
		{"privileged, not a plugin", only, TaskConfig{Privileged: true}, nil, nil, false},
		{"privileged, limit off", &Config{AllowPrivileged: true, PrivilegedGrants: grantAll}, TaskConfig{Privileged: true}, nil, nil, true},
		{"this driver's csi_plugin", only, TaskConfig{Privileged: true, CSIPlugin: plugin}, nil, nil, true},
		{"Nomad's csi_plugin", only, TaskConfig{Privileged: true}, nomadPluginMounts(state, alloc), nil, true},
		{"Nomad's csi_plugin, custom state_dir", only, TaskConfig{Privileged: true}, nomadPluginMounts("/srv/n/state", alloc), nil, true},
		{"CSI_ENDPOINT alone", only, TaskConfig{Privileged: true}, nil, map[string]string{"CSI_ENDPOINT": "unix:///csi/csi.sock"}, false},
		{"socket dir of another allocation", only, TaskConfig{Privileged: true}, nomadPluginMounts(state, "5b3c2f1e-0000-4000-8000-000000000002"), nil, false},
		{"socket dir without staging mount", only, TaskConfig{Privileged: true}, nomadPluginMounts(state, alloc)[:1], nil, false},
		{"staging mount of another state dir", only, TaskConfig{Privileged: true},
			[]*drivers.MountConfig{nomadPluginMounts(state, alloc)[0], nomadPluginMounts("/elsewhere", alloc)[1]}, nil, false},
		{"mounts not bidirectional", only, TaskConfig{Privileged: true}, func() []*drivers.MountConfig {
			ms := nomadPluginMounts(state, alloc)
			for _, m := range ms {
				m.PropagationMode = "host-to-task"
			}
			return ms
		}(), nil, false},
		{"host volumes that look alike", only, TaskConfig{Privileged: true}, []*drivers.MountConfig{
			{TaskPath: "/csi", HostPath: "/srv/vols/csi/plugins/other", PropagationMode: "bidirectional"},
			{TaskPath: "/x", HostPath: "/srv/vols/csi/node/p", PropagationMode: "bidirectional"},
		}, nil, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := &drivers.TaskConfig{ID: alloc + "/t/1", AllocID: alloc, Mounts: c.mounts, Env: c.env}
			c.tc.Command = "/bin/sh"
			_, err := authorize(c.conf, cfg, &c.tc, &executor.Spec{Command: "/bin/sh", Dir: "/"}, taskImage{})
			if c.ok {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, "privileged = true is only allowed for CSI plugin tasks on this node (privileged_plugins_only = true in the driver's plugin config)")
			must.ErrorContains(t, err, "csi_plugin")
		})
	}
}

func TestStartTask_privilegedOnlyForPluginTasks(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll, PrivilegedPluginsOnly: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sh", Privileged: true})
	_, _, err := d.StartTask(cfg)
	must.ErrorContains(t, err, "privileged_plugins_only = true")
	must.SliceEmpty(t, d.started)

	// A plugin task of Nomad's csi_plugin block keeps its privilege.
	cfg.Mounts = nomadPluginMounts(shortTempDir(t), cfg.AllocID)
	for _, m := range cfg.Mounts[:2] {
		must.NoError(t, os.MkdirAll(m.HostPath, 0o700))
	}
	_, _, err = d.StartTask(cfg)
	must.NoError(t, err)
	must.True(t, d.started[0].Privileged)

	// With no config block the limit is on; the node says so.
	must.True(t, defaultConfig().PrivilegedPluginsOnly)
	only, ok := d.buildFingerprint().Attributes["driver.csi.privileged_plugins_only"].GetBool()
	must.True(t, ok)
	must.True(t, only)
}

// fakePlugins makes every plugin socket of the driver answer from memory:
// fingerprint fakes for the prober (a healthy monolith plugin named after
// its socket's directory unless set), and one csihook fake for volume
// calls.
type fakePlugins struct {
	mu    sync.Mutex
	fakes map[string]*fingerprint.Fake
	vols  *csihook.FakeClient
}

// withFakePlugins gives d a prober that dials fakes; before runs ahead of
// the prober's first scan, so that sockets already in place are probed
// with the fakes it sets.
func withFakePlugins(t *testing.T, d *testDriver, before ...func(*fakePlugins)) *fakePlugins {
	t.Helper()
	fp := &fakePlugins{fakes: map[string]*fingerprint.Fake{}, vols: csihook.NewFakeClient(d.mounter.(*mounter.Fake))}
	for _, f := range before {
		f(fp)
	}
	d.Driver.mu.Lock()
	old := d.prober
	d.prober = fingerprint.NewProber(fingerprint.Config{
		Interval: time.Hour, ScanInterval: time.Hour, Dial: fp.dial,
		StatSocket: func(string) error { return nil }, OnHealthChange: d.onPluginHealth,
	})
	d.Driver.mu.Unlock()
	d.setVolumeDial(fp.vols.Dial)
	old.Close()
	must.NoError(t, setConfig(d.Driver, *d.currentConfig()))
	return fp
}

func (fp *fakePlugins) set(socket string, f *fingerprint.Fake) {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	fp.fakes[socket] = f
}

func (fp *fakePlugins) dial(socket string, _ time.Duration) (fingerprint.Client, error) {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	f, ok := fp.fakes[socket]
	if !ok {
		f = fingerprint.NewFake(fingerprint.PluginInfo{Name: filepath.Base(filepath.Dir(socket))}, fingerprint.NodeInfo{NodeID: "n1"})
		f.PluginCaps.ControllerService = true
		fp.fakes[socket] = f
	}
	return f, nil
}

// listenUnix makes a socket file at path, as a plugin run by the operator
// would.
func listenUnix(t *testing.T, path string) {
	t.Helper()
	must.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	l, err := net.Listen("unix", path)
	must.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
}

// jobTask is a task of a job in a namespace, in its own allocation.
func jobTask(t *testing.T, tc TaskConfig, alloc, namespace, job string) *drivers.TaskConfig {
	t.Helper()
	cfg := taskConfig(t, tc)
	cfg.AllocID, cfg.ID, cfg.Name = alloc, alloc+"/t/1", "t"
	cfg.Namespace, cfg.JobID, cfg.JobName = namespace, job, job
	return cfg
}

func waitHealthy(t *testing.T, d *testDriver, id string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if st, ok := d.currentProber().Get(id); ok && st.Healthy {
			return
		}
	}
	t.Fatalf("plugin %q not healthy within 5s", id)
}

// A task cannot claim the id a socket in plugin_socket_dirs serves; a
// task that served an id before the socket came keeps it across a driver
// restart.
func TestStartTask_pluginIDOfSocketDirRefused(t *testing.T) {
	sockets := shortTempDir(t)
	d := newTestDriver(t, Config{Enabled: true, PluginSocketDirs: []string{sockets}})
	fp := withFakePlugins(t, d)
	ext := filepath.Join(sockets, "ext", "csi.sock")
	listenUnix(t, ext)
	fp.set(ext, fingerprint.NewFake(fingerprint.PluginInfo{Name: "operators"}, fingerprint.NodeInfo{NodeID: "n1"}))

	ctl := TaskConfig{Command: "/bin/plugin", CSIPlugin: &PluginTaskConfig{ID: "operators", Type: "controller", MountDir: "/csi"}}
	cfg := jobTask(t, ctl, "alloc-ctl", "default", "squatter")
	_, _, err := d.StartTask(cfg)
	must.ErrorContains(t, err, `csi_plugin id "operators" is already served on this node by the socket "`+ext+`" in plugin_socket_dirs`)
	must.SliceEmpty(t, d.started)
	_, held := d.plugins.task("operators")
	must.False(t, held, must.Sprint("the refused task kept the id"))
	st, _ := d.prober.Get("operators")
	must.Eq(t, fingerprint.SourceSocketDir, st.Source)

	// The id a task served before a socket named itself so.
	own := TaskConfig{Command: "/bin/plugin", CSIPlugin: &PluginTaskConfig{ID: "mine", Type: "controller", MountDir: "/csi"}}
	mine := jobTask(t, own, "alloc-mine", "default", "plugins")
	handle, _, err := d.StartTask(mine)
	must.NoError(t, err)
	late := filepath.Join(sockets, "late", "csi.sock")
	listenUnix(t, late)
	fp.set(late, fingerprint.NewFake(fingerprint.PluginInfo{Name: "mine"}, fingerprint.NodeInfo{NodeID: "n1"}))
	d.prober.Rescan()
	st, _ = d.prober.Get("mine")
	must.Eq(t, mine.ID, st.TaskID)

	// A new driver process finds the socket first, and the task takes its
	// id back.
	d2 := newTestDriver(t, Config{Enabled: true, PluginSocketDirs: []string{sockets}})
	// Its prober scans the sockets as it starts: their fakes must be there
	// first, or a socket is probed as the default fake named after its
	// directory.
	withFakePlugins(t, d2, func(fp2 *fakePlugins) {
		fp2.set(ext, fingerprint.NewFake(fingerprint.PluginInfo{Name: "operators"}, fingerprint.NodeInfo{NodeID: "n1"}))
		fp2.set(late, fingerprint.NewFake(fingerprint.PluginInfo{Name: "mine"}, fingerprint.NodeInfo{NodeID: "n1"}))
	})
	_, found := d2.currentProber().SocketServing(t.Context(), "mine")
	must.True(t, found)
	must.NoError(t, d2.RecoverTask(persisted(t, handle)))
	st, _ = d2.prober.Get("mine")
	must.Eq(t, fingerprint.SourceTask, st.Source)
	must.Eq(t, mine.ID, st.TaskID)
}

// Volumes set up through a plugin task's job keep the plugin id for that
// job until they are released; workload volumes belong to their
// namespace; a controller plugin never stages or publishes.
func TestVolumes_pluginOwnerNamespaceAndControllerOnly(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	fp := withFakePlugins(t, d)

	plugin := TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}
	a1 := jobTask(t, plugin, "alloc-a1", "default", "plugin-a")
	_, _, err := d.StartTask(a1)
	must.NoError(t, err)
	waitHealthy(t, d, "hp")

	vol := func(plugin string) TaskConfig {
		return TaskConfig{Command: "/bin/sleep", Volumes: map[string]VolumeConfig{"data": {
			PluginID: plugin, VolumeID: "v1", Destination: "/data", AccessMode: "multi-node-multi-writer", AttachmentMode: "file-system",
		}}}
	}
	w := jobTask(t, vol("hp"), "alloc-w", "team-a", "web")
	_, _, err = d.StartTask(w)
	must.NoError(t, err)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))

	// Another namespace cannot use team-a's volume.
	other := jobTask(t, vol("hp"), "alloc-o", "team-b", "web")
	_, _, err = d.StartTask(other)
	must.ErrorContains(t, err, `belongs to namespace "team-a"`)
	must.ErrorContains(t, err, `not to namespace "team-b"`)
	must.ErrorContains(t, err, "allow_cross_namespace_volumes = true")
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))

	// The plugin task goes; another job cannot take the id while the
	// volume is there, the plugin's own job can.
	must.NoError(t, d.DestroyTask(a1.ID, true))
	b := jobTask(t, plugin, "alloc-b", "default", "plugin-b")
	_, _, err = d.StartTask(b)
	must.ErrorContains(t, err, `csi_plugin id "hp" cannot be served by job "plugin-b" in namespace "default" on this node: volumes of the plugin here were set up through job "plugin-a" in namespace "default"`)
	a2 := jobTask(t, plugin, "alloc-a2", "default", "plugin-a")
	_, _, err = d.StartTask(a2)
	must.NoError(t, err)
	st, _ := d.prober.Get("hp")
	must.Eq(t, a2.ID, st.TaskID)

	// Once the volume is released, the id is free for anyone.
	must.NoError(t, d.DestroyTask(w.ID, true))
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodeUnpublishVolume))
	must.NoError(t, d.DestroyTask(a2.ID, true))
	_, _, err = d.StartTask(b)
	must.NoError(t, err)

	// A controller plugin's id cannot be a workload's plugin_id.
	ctl := jobTask(t, TaskConfig{Command: "/bin/plugin", CSIPlugin: &PluginTaskConfig{ID: "ctl", Type: "controller", MountDir: "/csi"}}, "alloc-c", "default", "ctl")
	_, _, err = d.StartTask(ctl)
	must.NoError(t, err)
	waitHealthy(t, d, "ctl")
	_, _, err = d.StartTask(jobTask(t, vol("ctl"), "alloc-w2", "team-a", "web"))
	must.ErrorContains(t, err, `CSI plugin "ctl" is a controller plugin`)
	must.ErrorContains(t, err, "plugin_id")
}

func TestVolumes_allowCrossNamespace(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll, AllowCrossNamespaceVolumes: true})
	withFakePlugins(t, d)
	plugin := TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}
	_, _, err := d.StartTask(jobTask(t, plugin, "alloc-p", "default", "plugin"))
	must.NoError(t, err)
	waitHealthy(t, d, "hp")
	vol := TaskConfig{Command: "/bin/sleep", Volumes: map[string]VolumeConfig{"data": {
		PluginID: "hp", VolumeID: "v1", Destination: "/data", AccessMode: "multi-node-multi-writer", AttachmentMode: "file-system",
	}}}
	_, _, err = d.StartTask(jobTask(t, vol, "alloc-a", "team-a", "web"))
	must.NoError(t, err)
	_, _, err = d.StartTask(jobTask(t, vol, "alloc-b", "team-b", "web"))
	must.NoError(t, err)
}

func TestConfig_validatePolicy(t *testing.T) {
	c := Config{RootDir: "/var/lib/ncsi", CgroupParent: "x", PluginSocketDirs: []string{"/var/lib/ncsi/plugins"}}
	must.ErrorContains(t, c.validate(), `plugin_socket_dirs[0] "/var/lib/ncsi/plugins" must not be root_dir "/var/lib/ncsi" or inside it`)
	c.PluginSocketDirs = []string{"/var/lib/ncsi-sockets", "/var/lib"}
	must.NoError(t, c.validate())
}

// A plugin task that is gone after a driver restart keeps its id for its
// job's next task, over a socket that named itself so meanwhile; another
// job's task cannot take it from the socket.
func TestRecoverTask_lostPluginTaskKeepsIDForItsJob(t *testing.T) {
	sockets := shortTempDir(t)
	d := newTestDriver(t, Config{Enabled: true, PluginSocketDirs: []string{sockets}})
	withFakePlugins(t, d)
	plugin := TaskConfig{Command: "/bin/plugin", CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "controller", MountDir: "/csi"}}
	first := jobTask(t, plugin, "alloc-1", "default", "plugins")
	handle, _, err := d.StartTask(first)
	must.NoError(t, err)
	late := filepath.Join(sockets, "late", "csi.sock")
	listenUnix(t, late)

	d2 := newTestDriver(t, Config{Enabled: true, PluginSocketDirs: []string{sockets}})
	withFakePlugins(t, d2, func(fp2 *fakePlugins) {
		fp2.set(late, fingerprint.NewFake(fingerprint.PluginInfo{Name: "hp"}, fingerprint.NodeInfo{NodeID: "n1"}))
	})
	d2.recover = func(hclog.Logger, executor.State) (taskProcess, error) { return nil, executor.ErrGone }
	must.ErrorIs(t, d2.RecoverTask(persisted(t, handle)), executor.ErrGone)

	other := jobTask(t, plugin, "alloc-x", "default", "squatter")
	_, _, err = d2.StartTask(other)
	must.ErrorContains(t, err, "in plugin_socket_dirs")
	next := jobTask(t, plugin, "alloc-2", "default", "plugins")
	_, _, err = d2.StartTask(next)
	must.NoError(t, err)
	st, _ := d2.prober.Get("hp")
	must.Eq(t, next.ID, st.TaskID)
}

// The agent's plugin config block: the policy keys' defaults and values.
func TestConfigSpec_policyKeys(t *testing.T) {
	var c Config
	hclutils.NewConfigParser(configSpec).ParseHCL(t, `config {
  allow_privileged = true
}`, &c)
	must.True(t, c.PrivilegedPluginsOnly, must.Sprint("privileged_plugins_only must default to true"))
	must.False(t, c.AllowCrossNamespaceVolumes)

	c = Config{}
	hclutils.NewConfigParser(configSpec).ParseHCL(t, `config {
  privileged_plugins_only       = false
  allow_cross_namespace_volumes = true
}`, &c)
	must.False(t, c.PrivilegedPluginsOnly)
	must.True(t, c.AllowCrossNamespaceVolumes)
}

func TestConfigSpec_isolationKeys(t *testing.T) {
	var c Config
	hclutils.NewConfigParser(configSpec).ParseHCL(t, `config {}`, &c)
	must.Eq(t, "private", c.DefaultPIDMode)
	must.Eq(t, "private", c.DefaultIPCMode)
	must.Eq(t, []string{"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}, c.AllowCaps)
	must.MapEmpty(t, c.ChrootEnv)

	c = Config{}
	hclutils.NewConfigParser(configSpec).ParseHCL(t, `config {
  chroot_env {
    "/usr"      = "/usr"
    "/opt/tool" = "/tool"
  }
  default_pid_mode = "host"
  denied_host_uids = "0"
}`, &c)
	must.Eq(t, map[string]string{"/usr": "/usr", "/opt/tool": "/tool"}, c.ChrootEnv)
	must.Eq(t, "host", c.DefaultPIDMode)
	must.Eq(t, "0", c.DeniedHostUIDs)
}

// grantedPluginShares: a plugin task the operator granted, this driver's
// csi_plugin block or Nomad's (read from its plugin supervisor's mounts),
// weighs plugin_cpu_shares; one no grant names, or any other task, none.
func TestGrantedPluginShares(t *testing.T) {
	const alloc = "5b3c2f1e-0000-4000-8000-000000000001"
	// nomadPluginMounts' plugin id is the last element of its staging
	// directory.
	const id = "hostpath"
	nomad := &drivers.TaskConfig{AllocID: alloc, Mounts: nomadPluginMounts("/var/lib/nomad/client", alloc)}
	own := &TaskConfig{CSIPlugin: &PluginTaskConfig{ID: id, Type: "node", MountDir: "/csi"}}
	reserved := &Config{PluginCPUShares: 1024, PrivilegedGrants: []PrivilegedGrant{{Namespace: "*", Job: "ops", PluginID: id}}}
	free := &Config{PluginCPUShares: 1024, PrivilegedGrants: []PrivilegedGrant{{Namespace: "*", Job: "ops", PluginID: "other"}}}
	grant := &PrivilegedGrant{Namespace: "*", Job: "ops"}
	for _, tc := range []struct {
		name  string
		conf  *Config
		cfg   *drivers.TaskConfig
		tc    *TaskConfig
		grant *PrivilegedGrant
		want  int64
	}{
		{"Nomad's plugin, id reserved by a grant", reserved, nomad, &TaskConfig{}, nil, 1024},
		{"Nomad's plugin, privileged under a grant", free, nomad, &TaskConfig{}, grant, 1024},
		{"Nomad's plugin, no grant names it", free, nomad, &TaskConfig{}, nil, 0},
		{"own plugin, id reserved by a grant", reserved, &drivers.TaskConfig{}, own, nil, 1024},
		{"own plugin, no grant names it", free, &drivers.TaskConfig{}, own, nil, 0},
		{"no plugin, privileged under a grant", free, &drivers.TaskConfig{}, &TaskConfig{}, grant, 0},
		{"plugin_cpu_shares = 0", &Config{PrivilegedGrants: reserved.PrivilegedGrants}, nomad, &TaskConfig{}, grant, 0},
	} {
		must.Eq(t, tc.want, grantedPluginShares(tc.conf, tc.cfg, tc.tc, tc.grant), must.Sprint(tc.name))
	}
}
