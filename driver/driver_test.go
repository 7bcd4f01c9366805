package driver

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/nomad/structs"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	pstructs "github.com/hashicorp/nomad/plugins/shared/structs"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// fakeProcess is a task process that exits when told to.
type fakeProcess struct {
	pid   int
	state executor.State

	mu        sync.Mutex
	exitCh    chan struct{}
	status    *executor.ExitStatus
	signals   []syscall.Signal
	shutdowns []time.Duration
	killed    int
	destroyed int
	// ignore makes Shutdown's signal not end the task: only the kill after
	// the grace period does.
	ignore bool
	// destroyErr is what Destroy returns.
	destroyErr error
	onExit     []func()
}

func newFakeProcess(pid int) *fakeProcess {
	return &fakeProcess{pid: pid, exitCh: make(chan struct{}), state: executor.State{SupervisorPID: pid + 1, TaskPID: pid}}
}

func (p *fakeProcess) exit(st executor.ExitStatus) {
	p.mu.Lock()
	if p.status != nil {
		p.mu.Unlock()
		return
	}
	p.status = &st
	close(p.exitCh)
	hooks := p.onExit
	p.onExit = nil
	p.mu.Unlock()
	for _, f := range hooks {
		f()
	}
}

func (p *fakeProcess) OnExit(f func()) {
	p.mu.Lock()
	if p.status == nil {
		p.onExit = append(p.onExit, f)
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	f()
}

func (p *fakeProcess) Pid() int              { return p.pid }
func (p *fakeProcess) State() executor.State { return p.state }
func (p *fakeProcess) Wait(ctx context.Context) (*executor.ExitStatus, error) {
	select {
	case <-p.exitCh:
		p.mu.Lock()
		defer p.mu.Unlock()
		st := *p.status
		return &st, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
func (p *fakeProcess) Signal(sig syscall.Signal) error {
	p.mu.Lock()
	p.signals = append(p.signals, sig)
	p.mu.Unlock()
	return nil
}
func (p *fakeProcess) Shutdown(sig syscall.Signal, grace time.Duration) error {
	p.mu.Lock()
	p.signals = append(p.signals, sig)
	p.shutdowns = append(p.shutdowns, grace)
	ignore := p.ignore
	p.mu.Unlock()
	if ignore {
		p.exit(executor.ExitStatus{ExitCode: 137, Signal: int(syscall.SIGKILL)})
	} else {
		p.exit(executor.ExitStatus{ExitCode: 128 + int(sig), Signal: int(sig)})
	}
	return nil
}
func (p *fakeProcess) Kill() error {
	p.mu.Lock()
	p.killed++
	p.mu.Unlock()
	p.exit(executor.ExitStatus{ExitCode: 137, Signal: int(syscall.SIGKILL)})
	return nil
}
func (p *fakeProcess) Stats() (*cgroups.Stats, error) {
	return &cgroups.Stats{CPUTotalNanos: 5e8, MemoryRSS: 1 << 20, MemoryMeasured: []string{"RSS"}}, nil
}
func (p *fakeProcess) Exec(ctx context.Context, opts executor.ExecOptions) (int, error) {
	_, _ = opts.Stdout.Write([]byte(strings.Join(opts.Command, " ")))
	return 7, nil
}
func (p *fakeProcess) Destroy() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.destroyed++
	return p.destroyErr
}

type fakeHost struct {
	root      bool
	mountNS   error
	cgroupErr error
	writeErr  error
	// statfs is what Statfs reports (a roomy file system when nil).
	statfs    *unix.Statfs_t
	kernelErr error
}

func (h fakeHost) IsRoot() bool              { return h.root }
func (h fakeHost) MountNamespaces() error    { return h.mountNS }
func (h fakeHost) Cgroups() error            { return h.cgroupErr }
func (h fakeHost) Writable(dir string) error { return h.writeErr }
func (h fakeHost) Statfs(dir string, st *unix.Statfs_t) error {
	if h.statfs == nil {
		*st = unix.Statfs_t{Bsize: 4096, Blocks: 1 << 20, Bfree: 1 << 19, Files: 1 << 16, Ffree: 1 << 15}
		return nil
	}
	*st = *h.statfs
	return nil
}
func (h fakeHost) Kernel() error { return h.kernelErr }

// testDriver is a driver whose processes are fakes, configured with cfg.
type testDriver struct {
	*Driver
	mu      sync.Mutex
	started []*executor.Spec
	procs   []*fakeProcess
	// volDial is what the driver's volume lifecycle dials plugins with,
	// read at each dial: the lifecycle may be made in the background
	// before a test swaps in its fakes.
	volDial func(socket string) (csihook.Client, error)
}

// setVolumeDial makes the volume lifecycle dial plugins with dial from now
// on.
func (td *testDriver) setVolumeDial(dial func(socket string) (csihook.Client, error)) {
	td.mu.Lock()
	defer td.mu.Unlock()
	td.volDial = dial
}

func newTestDriver(t *testing.T, cfg Config, before ...func(*Driver)) *testDriver {
	t.Helper()
	d := NewPlugin(hclog.NewNullLogger())
	td := &testDriver{Driver: d}
	d.host = fakeHost{root: true}
	d.spares = nil
	d.start = func(_ hclog.Logger, s *executor.Spec, late func() ([]executor.Mount, error)) (taskProcess, error) {
		if late != nil {
			// As the executor does: the late mounts join the task's.
			mounts, err := late()
			if err != nil {
				return nil, err
			}
			c := *s
			c.Mounts = append(append([]executor.Mount(nil), s.Mounts...), mounts...)
			s = &c
		}
		td.mu.Lock()
		defer td.mu.Unlock()
		p := newFakeProcess(1000 + len(td.procs))
		td.started = append(td.started, s)
		td.procs = append(td.procs, p)
		return p, nil
	}
	d.recover = func(_ hclog.Logger, st executor.State) (taskProcess, error) {
		p := newFakeProcess(st.TaskPID)
		td.mu.Lock()
		td.procs = append(td.procs, p)
		td.mu.Unlock()
		return p, nil
	}
	if cfg.RootDir == "" {
		cfg.RootDir = shortTempDir(t)
	}
	// After the root's removal is registered, so that it runs before it.
	t.Cleanup(d.Shutdown)
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = DefaultCgroupParent
	}
	d.mounter = mounter.NewFake(mounter.MountPoint{Path: "/", Shared: true, PeerGroup: 1})
	d.dialVolume = func(socket string) (csihook.Client, error) {
		td.mu.Lock()
		dial := td.volDial
		td.mu.Unlock()
		if dial == nil {
			return csihook.DialUnix(socket)
		}
		return dial(socket)
	}
	for _, f := range before {
		f(d)
	}
	must.NoError(t, setConfig(d, cfg))
	return td
}

func setConfig(d *Driver, cfg Config) error {
	var buf []byte
	if err := base.MsgPackEncode(&buf, &cfg); err != nil {
		return err
	}
	return d.SetConfig(&base.Config{PluginConfig: buf, AgentConfig: &base.AgentConfig{Driver: &base.ClientDriverConfig{}}})
}

func taskConfig(t *testing.T, tc TaskConfig) *drivers.TaskConfig {
	t.Helper()
	cfg := &drivers.TaskConfig{
		ID:      "alloc-1/web/abc",
		Name:    "web",
		AllocID: "alloc-1",
		Env:     map[string]string{"B": "2", "A": "1"},
		Resources: &drivers.Resources{
			NomadResources: &structs.AllocatedTaskResources{
				Memory: structs.AllocatedMemoryResources{MemoryMB: 64},
			},
			LinuxResources: &drivers.LinuxResources{CPUShares: 100, MemoryLimitBytes: 64 << 20},
		},
	}
	must.NoError(t, cfg.EncodeConcreteDriverConfig(&tc))
	return cfg
}

func TestConfig_validate(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		want string
	}{
		{"ok", Config{RootDir: "/var/lib/x", CgroupParent: "nomad-csi"}, ""},
		{"relative root", Config{RootDir: "var/lib/x", CgroupParent: "nomad-csi"}, "root_dir must be an absolute path"},
		{"slash root", Config{RootDir: "/", CgroupParent: "nomad-csi"}, "root_dir must not be \"/\""},
		{"absolute cgroup", Config{RootDir: "/x", CgroupParent: "/nomad"}, "cgroup_parent must be a relative cgroup name"},
		{"escaping cgroup", Config{RootDir: "/x", CgroupParent: "../x"}, "cgroup_parent must be a relative cgroup name"},
		{"chroot_env ok", Config{RootDir: "/x", CgroupParent: "c", ChrootEnv: map[string]string{"/opt/bin": "/opt/bin"}}, ""},
		{"chroot_env relative", Config{RootDir: "/x", CgroupParent: "c", ChrootEnv: map[string]string{"/opt/bin": "bin"}}, "chroot_env entry \"/opt/bin\" = \"bin\" must map an absolute host path"},
		{"chroot_env under /tmp", Config{RootDir: "/x", CgroupParent: "c", ChrootEnv: map[string]string{"/tmp/ci/bin": "/tmp/ci/bin"}}, "/tmp in the task is Nomad's directory"},
		{"chroot_env over /local", Config{RootDir: "/x", CgroupParent: "c", ChrootEnv: map[string]string{"/srv": "/local"}}, "/local in the task is Nomad's directory"},
		{"chroot_env over /proc", Config{RootDir: "/x", CgroupParent: "c", ChrootEnv: map[string]string{"/proc": "/proc"}}, "would hide the task's own /proc"},
		{"bad pid mode", Config{RootDir: "/x", CgroupParent: "c", DefaultPIDMode: "shared"}, `default_pid_mode must be "private" or "host"`},
		{"bad allow_caps", Config{RootDir: "/x", CgroupParent: "c", AllowCaps: []string{"cap_flying"}}, `allow_caps: unknown capability "cap_flying"`},
		{"bad denied uids", Config{RootDir: "/x", CgroupParent: "c", DeniedHostUIDs: "10-1"}, "denied_host_uids: range \"10-1\""},
		{"bad denied gids", Config{RootDir: "/x", CgroupParent: "c", DeniedHostGIDs: "x"}, "denied_host_gids: \"x\" is not an id"},
		{"negative pids_limit", Config{RootDir: "/x", CgroupParent: "c", PidsLimit: -1}, "pids_limit must be 0 (no limit) or a number of processes from 1 to 4194304"},
		{"plugin_cpu_shares 1", Config{RootDir: "/x", CgroupParent: "c", PluginCPUShares: 1}, "plugin_cpu_shares must be 0 (plugin tasks weigh as their cpu) or a CPU weight from 2 to 262144"},
		{"plugin_cpu_shares above the kernel's", Config{RootDir: "/x", CgroupParent: "c", PluginCPUShares: 262145}, "plugin_cpu_shares must be 0 (plugin tasks weigh as their cpu) or a CPU weight from 2 to 262144"},
		{"negative cpu_total_compute", Config{RootDir: "/x", CgroupParent: "c", CPUTotalCompute: -1}, "cpu_total_compute must be 0 (measure the CPU speed) or the node's total CPU compute in MHz"},
		{"cpu_total_compute", Config{RootDir: "/x", CgroupParent: "c", CPUTotalCompute: 9600}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.validate()
			if tc.want == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, tc.want)
		})
	}
}

func TestTaskConfig_validate(t *testing.T) {
	allowed := &Config{AllowPrivileged: true}
	denied := &Config{}
	cases := []struct {
		name string
		tc   TaskConfig
		cfg  *Config
		want string
	}{
		{"ok", TaskConfig{Command: "/bin/true"}, denied, ""},
		{"empty command", TaskConfig{Command: "  "}, denied, "command must not be empty"},
		{"relative work_dir", TaskConfig{Command: "x", WorkDir: "tmp"}, denied, "work_dir must be an absolute path"},
		{"privileged denied", TaskConfig{Command: "x", Privileged: true}, denied, "allow_privileged = true"},
		{"privileged allowed", TaskConfig{Command: "x", Privileged: true}, allowed, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.tc.validate(c.cfg)
			if c.want == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, c.want)
		})
	}
}

func TestSetConfig_badRootDirNamesKey(t *testing.T) {
	d := NewPlugin(hclog.NewNullLogger())
	defer d.Shutdown()
	err := setConfig(d, Config{Enabled: true, RootDir: "relative/dir", CgroupParent: "nomad-csi"})
	must.ErrorContains(t, err, "root_dir")
}

func TestStartTask_specFromNomad(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sh", Args: []string{"-c", "true"}})
	cfg.User = "nobody"
	cfg.StdoutPath, cfg.StderrPath = "/tmp/out", "/tmp/err"
	cfg.Mounts = []*drivers.MountConfig{{TaskPath: "/data", HostPath: "/srv/data", Readonly: true}, {TaskPath: "/feed", HostPath: "/srv/feed", PropagationMode: "host-to-task"}}

	handle, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	must.Eq(t, drivers.TaskStateRunning, handle.State)

	var st TaskState
	must.NoError(t, handle.GetDriverState(&st))
	must.Eq(t, 1000, st.Process.TaskPID)

	spec := d.started[0]
	must.Eq(t, "/bin/sh", spec.Command)
	must.Eq(t, []string{"-c", "true"}, spec.Args)
	must.Eq(t, []string{"A=1", "B=2", "PATH=" + defaultTaskPath}, spec.Env)
	must.Eq(t, "nobody", spec.User)
	// Not privileged: isolated as exec's defaults say.
	must.Eq(t, &executor.Isolation{ChrootEnv: executor.DefaultChrootEnv, PrivatePID: true, PrivateIPC: true}, spec.Isolation)
	must.Eq(t, []string{"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}, spec.Capabilities)
	must.SliceEmpty(t, spec.AmbientCapabilities)
	must.Eq(t, "/tmp/out", spec.StdoutPath)
	must.False(t, spec.Privileged)
	must.Eq(t, int64(64<<20), spec.Limits.MemoryBytes)
	must.Eq(t, int64(100), spec.Limits.CPUShares)
	must.Eq(t, []executor.Mount{{Source: "/srv/data", Target: "/data", ReadOnly: true, Propagation: "private"}, {Source: "/srv/feed", Target: "/feed", Propagation: "host-to-task"}}, spec.Mounts)
	must.StrHasPrefix(t, d.currentConfig().tasksDir(), spec.StateDir)

	_, _, err = d.StartTask(cfg)
	must.ErrorContains(t, err, "already started")
}

func TestStartTask_isolation(t *testing.T) {
	cases := []struct {
		name     string
		conf     Config
		tc       TaskConfig
		user     string
		wantUser string
		wantErr  string
		check    func(t *testing.T, spec *executor.Spec)
	}{
		{name: "empty user is nobody", wantUser: "nobody"},
		{name: "explicit root stays", user: "root", wantUser: "root"},
		{name: "plugin task keeps root", tc: TaskConfig{CSIPlugin: &PluginTaskConfig{ID: "p", Type: "controller", MountDir: "/csi"}}, wantUser: ""},
		{name: "privileged keeps root and the host's view", conf: Config{AllowPrivileged: true, PrivilegedGrants: grantAll, PidsLimit: 100}, tc: TaskConfig{Privileged: true}, wantUser: "",
			check: func(t *testing.T, spec *executor.Spec) {
				must.Nil(t, spec.Isolation)
				must.True(t, spec.Privileged)
				must.Eq(t, 0, spec.Limits.PidsMax)
			}},
		{name: "pids_limit caps an isolated task", conf: Config{PidsLimit: 100}, wantUser: "nobody",
			check: func(t *testing.T, spec *executor.Spec) { must.Eq(t, 100, spec.Limits.PidsMax) }},
		{name: "denied uid", conf: Config{DeniedHostUIDs: "0-10"}, user: "root", wantErr: "denied_host_uids"},
		{name: "denied gid", conf: Config{DeniedHostGIDs: "0"}, user: "root", wantErr: "denied_host_gids"},
		{name: "nobody passes a root denial", conf: Config{DeniedHostUIDs: "0"}, wantUser: "nobody"},
		// One rule: denied_host_* apply to every task that is not
		// privileged, plugin tasks included; a privileged task is root by
		// its grant.
		{name: "granted privileged task passes a root denial", conf: Config{AllowPrivileged: true, PrivilegedGrants: grantAll, DeniedHostUIDs: "0", DeniedHostGIDs: "0"},
			tc: TaskConfig{Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "p", Type: "node", MountDir: "/csi"}}, wantUser: ""},
		{name: "plugin task that is not privileged is checked", conf: Config{DeniedHostUIDs: "0"},
			tc: TaskConfig{CSIPlugin: &PluginTaskConfig{ID: "p", Type: "controller", MountDir: "/csi"}}, wantErr: "denied_host_uids"},
		{name: "privileged task as nobody", conf: Config{AllowPrivileged: true, PrivilegedGrants: grantAll},
			tc: TaskConfig{Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "p", Type: "node", MountDir: "/csi"}}, user: "nobody", wantErr: "a privileged task runs as root only"},
		{name: "group of another user", user: "nobody:shadow", wantErr: `"nobody" is not a member of group "shadow"`},
		{name: "numeric group of another user", user: "65534:42", wantErr: `"65534" is not a member of group "42"`},
		{name: "group the operator lists", conf: Config{AllowUserGroups: []string{"shadow"}}, user: "nobody:shadow", wantUser: "nobody:shadow"},
		{name: "the user's own group", user: "nobody:nogroup", wantUser: "nobody:nogroup"},
		{name: "cap_add beyond allow_caps", tc: TaskConfig{CapAdd: []string{"sys_admin"}}, wantErr: "cap_add: sys_admin not allowed"},
		{name: "cap_add within allow_caps", conf: Config{AllowCaps: []string{"chown", "net_admin"}}, tc: TaskConfig{CapAdd: []string{"NET_ADMIN"}, CapDrop: []string{"chown"}}, wantUser: "nobody",
			check: func(t *testing.T, spec *executor.Spec) {
				must.Eq(t, []string{"NET_ADMIN"}, spec.Capabilities)
				must.Eq(t, []string{"NET_ADMIN"}, spec.AmbientCapabilities)
			}},
		{name: "pid host refused", tc: TaskConfig{PIDMode: "host"}, wantErr: `pid_mode = "host" is not allowed on this node`},
		{name: "pid and ipc host", conf: Config{AllowHostNamespaces: true}, tc: TaskConfig{PIDMode: "host", IPCMode: "host"}, wantUser: "nobody",
			check: func(t *testing.T, spec *executor.Spec) {
				must.False(t, spec.Isolation.PrivatePID)
				must.False(t, spec.Isolation.PrivateIPC)
			}},
		{name: "default modes from the plugin", conf: Config{DefaultPIDMode: "host"}, wantUser: "nobody",
			check: func(t *testing.T, spec *executor.Spec) {
				must.False(t, spec.Isolation.PrivatePID)
				must.True(t, spec.Isolation.PrivateIPC)
			}},
		{name: "bad pid_mode", tc: TaskConfig{PIDMode: "shared"}, wantErr: `pid_mode must be "private" or "host"`},
		{name: "chroot_env from the plugin", conf: Config{ChrootEnv: map[string]string{"/opt/tools": "/tools"}}, wantUser: "nobody",
			check: func(t *testing.T, spec *executor.Spec) {
				must.Eq(t, map[string]string{"/opt/tools": "/tools"}, spec.Isolation.ChrootEnv)
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			conf := tc.conf
			conf.Enabled = true
			d := newTestDriver(t, conf)
			task := tc.tc
			task.Command = "/bin/true"
			cfg := taskConfig(t, task)
			cfg.User = tc.user
			_, _, err := d.StartTask(cfg)
			if tc.wantErr != "" {
				must.ErrorContains(t, err, tc.wantErr)
				return
			}
			must.NoError(t, err)
			spec := d.started[len(d.started)-1]
			must.Eq(t, tc.wantUser, spec.User)
			if tc.check != nil {
				tc.check(t, spec)
			}
		})
	}
}

func TestStartTask_refusesBadInput(t *testing.T) {
	cases := []struct {
		name   string
		tc     TaskConfig
		mounts []*drivers.MountConfig
		want   string
	}{
		{"privileged not allowed", TaskConfig{Command: "/bin/true", Privileged: true}, nil, "privileged = true is not allowed"},
		{"bidirectional unprivileged", TaskConfig{Command: "/bin/true"},
			[]*drivers.MountConfig{{TaskPath: "/csi", HostPath: "/h", PropagationMode: "bidirectional"}},
			"needs privileged = true"},
		// Nomad's csi_plugin block mounts the socket and staging directories
		// bidirectionally for every type, a controller's too
		// (docs/plugins.md, "Migrating from Docker-run CSI plugins").
		{"Nomad's controller plugin unprivileged", TaskConfig{Command: "/bin/true"},
			nomadControllerMounts("/var/lib/nomad/client", "5b3c2f1e-0000-4000-8000-000000000001"),
			`mount "/csi": propagation_mode "bidirectional" needs privileged = true in the task config`},
		{"unknown propagation", TaskConfig{Command: "/bin/true"},
			[]*drivers.MountConfig{{TaskPath: "/csi", HostPath: "/h", PropagationMode: "sideways"}},
			"propagation_mode \"sideways\""},
		// Mounts the host makes later under the source reach the task as
		// the host made them, writable: the task would write below a
		// read-only host volume.
		{"read-only host-to-task unprivileged", TaskConfig{Command: "/bin/true"},
			[]*drivers.MountConfig{{TaskPath: "/data", HostPath: "/h", Readonly: true, PropagationMode: "host-to-task"}},
			`mount "/data": propagation_mode "host-to-task" cannot keep a read-only mount read-only`},
		{"relative task path", TaskConfig{Command: "/bin/true"},
			[]*drivers.MountConfig{{TaskPath: "csi", HostPath: "/h"}}, "must be absolute"},
		{"same task path twice", TaskConfig{Command: "/bin/true"},
			[]*drivers.MountConfig{{TaskPath: "/a", HostPath: "/h"}, {TaskPath: "/a/", HostPath: "/i"}}, "same task path"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDriver(t, Config{Enabled: true})
			cfg := taskConfig(t, c.tc)
			cfg.Mounts = c.mounts
			_, _, err := d.StartTask(cfg)
			must.ErrorContains(t, err, c.want)
			must.SliceEmpty(t, d.started)
			_, ok := d.tasks.Get(cfg.ID)
			must.False(t, ok)
		})
	}
}

func TestStartTask_disabled(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: false})
	_, _, err := d.StartTask(taskConfig(t, TaskConfig{Command: "/bin/true"}))
	must.ErrorContains(t, err, "enabled = true")
}

func TestStartTask_oldKernel(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	d.host = fakeHost{root: true, kernelErr: errors.New("the kernel (Linux 5.10.0-35-amd64) has no mount_setattr(2)")}
	_, _, err := d.StartTask(taskConfig(t, TaskConfig{Command: "/bin/true"}))
	must.ErrorContains(t, err, "has no mount_setattr(2)")
	d.mu.Lock()
	defer d.mu.Unlock()
	must.SliceEmpty(t, d.started, must.Sprint("a task was started on a kernel the driver refuses"))
}

func TestStartTask_startErrorCleansStateDir(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	var stateDir string
	d.start = func(_ hclog.Logger, s *executor.Spec, _ func() ([]executor.Mount, error)) (taskProcess, error) {
		stateDir = s.StateDir
		return nil, errors.New(`command "nope" not found in PATH`)
	}
	_, _, err := d.StartTask(taskConfig(t, TaskConfig{Command: "nope"}))
	must.ErrorContains(t, err, `command "nope" not found`)
	must.NotEq(t, "", stateDir)
	must.DirNotExists(t, stateDir)
}

func TestWaitStopDestroy(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep", Args: []string{"100"}})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	p := d.procs[0]

	// A running task cannot be destroyed without force.
	must.ErrorContains(t, d.DestroyTask(cfg.ID, false), "cannot destroy a running task")

	ch, err := d.WaitTask(context.Background(), cfg.ID)
	must.NoError(t, err)

	must.NoError(t, d.StopTask(cfg.ID, 3*time.Second, "SIGUSR1"))
	must.Eq(t, []syscall.Signal{syscall.SIGUSR1}, p.signals)
	must.Eq(t, []time.Duration{3 * time.Second}, p.shutdowns)

	select {
	case res := <-ch:
		must.Eq(t, int(syscall.SIGUSR1), res.Signal)
		must.Eq(t, 128+int(syscall.SIGUSR1), res.ExitCode)
	case <-time.After(5 * time.Second):
		t.Fatal("WaitTask did not report the exit")
	}

	status, err := d.InspectTask(cfg.ID)
	must.NoError(t, err)
	must.Eq(t, drivers.TaskStateExited, status.State)
	must.Eq(t, "1000", status.DriverAttributes["pid"])

	// Stopping an exited task is a no-op.
	must.NoError(t, d.StopTask(cfg.ID, time.Second, "SIGTERM"))

	must.NoError(t, d.DestroyTask(cfg.ID, false))
	must.Eq(t, 1, p.destroyed)
	_, err = d.InspectTask(cfg.ID)
	must.ErrorIs(t, err, drivers.ErrTaskNotFound)
}

func TestWaitTask_saysOOMKilled(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/hog"})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	d.procs[0].exit(executor.ExitStatus{ExitCode: 137, Signal: 9, OOMKilled: true})
	ch, err := d.WaitTask(context.Background(), cfg.ID)
	must.NoError(t, err)
	res := <-ch
	must.True(t, res.OOMKilled)
	must.EqError(t, res.Err, "OOM Killed")
}

// A task that exits 0 after the OOM killer ended one of its children
// succeeded: Nomad counts an exit with an error as a failure (restarts it,
// fails a batch job), where exec reports the kill and the success alike.
func TestWaitTask_childOOMKilledTaskSucceeds(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sh"})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	d.procs[0].exit(executor.ExitStatus{OOMKilled: true})
	ch, err := d.WaitTask(context.Background(), cfg.ID)
	must.NoError(t, err)
	res := <-ch
	must.True(t, res.OOMKilled)
	must.NoError(t, res.Err)
	must.True(t, res.Successful())
}

// A task that failed after its process limit refused forks is told why it
// may have failed; one that succeeded anyway, or never hit the limit, is
// not.
func TestWaitTask_saysPidsLimited(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status executor.ExitStatus
		want   string
	}{
		{"failed at the limit", executor.ExitStatus{ExitCode: 2, PidsLimited: 14},
			"the task reached its process limit 14 times (the driver's pids_limit caps its processes and threads)"},
		{"succeeded at the limit", executor.ExitStatus{PidsLimited: 3}, ""},
		{"failed without reaching it", executor.ExitStatus{ExitCode: 1}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDriver(t, Config{Enabled: true})
			cfg := taskConfig(t, TaskConfig{Command: "/bin/forker"})
			_, _, err := d.StartTask(cfg)
			must.NoError(t, err)
			d.procs[0].exit(tc.status)
			ch, err := d.WaitTask(context.Background(), cfg.ID)
			must.NoError(t, err)
			res := <-ch
			if tc.want == "" {
				must.NoError(t, res.Err)
				return
			}
			must.EqError(t, res.Err, tc.want)
		})
	}
}

func TestStopTask_defaultsToSIGINTAndRejectsUnknownSignal(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	must.ErrorContains(t, d.StopTask(cfg.ID, time.Second, "SIGWHATEVER"), "unknown signal")
	must.NoError(t, d.StopTask(cfg.ID, time.Second, ""))
	must.Eq(t, []syscall.Signal{syscall.SIGINT}, d.procs[0].signals)
}

func TestDestroyTask_forceKills(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	must.NoError(t, d.DestroyTask(cfg.ID, true))
	must.Eq(t, 1, d.procs[0].killed)
	must.Eq(t, 1, d.procs[0].destroyed)
}

func TestRecoverTask(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
	handle, _, err := d.StartTask(cfg)
	must.NoError(t, err)

	// Known task: no-op.
	must.NoError(t, d.RecoverTask(handle))
	must.Len(t, 1, d.procs)

	// A fresh driver (after a restart) takes the task back from its state.
	d2 := newTestDriver(t, Config{Enabled: true})
	must.NoError(t, d2.RecoverTask(handle))
	must.Len(t, 1, d2.procs)
	must.Eq(t, 1000, d2.procs[0].Pid())
	status, err := d2.InspectTask(cfg.ID)
	must.NoError(t, err)
	must.Eq(t, drivers.TaskStateRunning, status.State)

	// A process that cannot be found again is an error Nomad acts on.
	d3 := newTestDriver(t, Config{Enabled: true})
	d3.recover = func(hclog.Logger, executor.State) (taskProcess, error) { return nil, executor.ErrGone }
	err = d3.RecoverTask(handle)
	must.ErrorIs(t, err, executor.ErrGone)

	must.ErrorContains(t, d3.RecoverTask(nil), "handle is nil")
}

func TestExecTask(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	res, err := d.ExecTask(cfg.ID, []string{"echo", "hi"}, time.Second)
	must.NoError(t, err)
	must.Eq(t, "echo hi", string(res.Stdout))
	must.Eq(t, 7, res.ExitResult.ExitCode)

	_, err = d.ExecTask(cfg.ID, nil, time.Second)
	must.ErrorContains(t, err, "command must not be empty")
	_, err = d.ExecTask("nope", []string{"x"}, time.Second)
	must.ErrorIs(t, err, drivers.ErrTaskNotFound)
}

// ExecTask (Nomad's script checks, whose command the job names) keeps at
// most drivers.CheckBufSize of each output, its end, as Nomad's own
// executor does: a command that writes without end must not grow the
// driver, which serves every task on the node.
func TestExecTask_outputBounded(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	// The fake writes the command back: 1 MiB, then a tail.
	long := strings.Repeat("x", 1<<20) + "the-end"
	res, err := d.ExecTask(cfg.ID, []string{long}, time.Second)
	must.NoError(t, err)
	must.Eq(t, drivers.CheckBufSize, len(res.Stdout))
	must.StrHasSuffix(t, "the-end", string(res.Stdout))
}

func TestTaskStats(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := d.TaskStats(ctx, cfg.ID, 10*time.Millisecond)
	must.NoError(t, err)
	usage := <-ch
	must.Eq(t, uint64(1<<20), usage.ResourceUsage.MemoryStats.RSS)
	must.Eq(t, []string{"RSS"}, usage.ResourceUsage.MemoryStats.Measured)
}

func TestCPUCalc(t *testing.T) {
	c := &cpuCalc{mhzPerCore: 2000}
	t0 := time.Unix(100, 0)
	first := c.usage(&cgroups.Stats{CPUTotalNanos: 1e9}, t0)
	must.Eq(t, 0.0, first.ResourceUsage.CpuStats.Percent)
	// Percent is listed, as exec lists it: nomad alloc status -stats
	// prints only the measured fields.
	must.Eq(t, []string{"User Mode", "Percent"}, c.usage(&cgroups.Stats{CPUTotalNanos: 1e9, CPUMeasured: []string{"User Mode"}}, t0).ResourceUsage.CpuStats.Measured)
	c = &cpuCalc{mhzPerCore: 2000}
	c.usage(&cgroups.Stats{CPUTotalNanos: 1e9}, t0)
	// Half a core for one second.
	second := c.usage(&cgroups.Stats{CPUTotalNanos: 1.5e9, CPUUserNanos: 5e8}, t0.Add(time.Second))
	must.Eq(t, 50.0, second.ResourceUsage.CpuStats.Percent)
	must.Eq(t, 50.0, second.ResourceUsage.CpuStats.UserMode)
	must.Eq(t, 1000.0, second.ResourceUsage.CpuStats.TotalTicks)
}

func TestTaskLimits_memoryMax(t *testing.T) {
	cfg := &drivers.TaskConfig{Resources: &drivers.Resources{
		NomadResources: &structs.AllocatedTaskResources{
			Memory: structs.AllocatedMemoryResources{MemoryMB: 100, MemoryMaxMB: 300},
		},
		LinuxResources: &drivers.LinuxResources{MemoryLimitBytes: 100 << 20},
	}}
	l := taskLimits(cfg)
	must.Eq(t, int64(300<<20), l.MemoryBytes)
	must.Eq(t, int64(100<<20), l.MemoryReservationBytes)
}

func TestBuildFingerprint(t *testing.T) {
	cases := []struct {
		name    string
		enabled bool
		host    fakeHost
		health  drivers.HealthState
		desc    string
	}{
		{"healthy", true, fakeHost{root: true}, drivers.HealthStateHealthy, drivers.DriverHealthy},
		{"disabled", false, fakeHost{root: true}, drivers.HealthStateUndetected, "enabled = true"},
		{"not root", true, fakeHost{}, drivers.HealthStateUndetected, "must run as root"},
		{"no mount ns", true, fakeHost{root: true, mountNS: errors.New("no mount namespaces")}, drivers.HealthStateUndetected, "no mount namespaces"},
		{"old kernel", true, fakeHost{root: true, kernelErr: errors.New("the kernel (Linux 5.10.0-35-amd64) has no mount_setattr(2)")}, drivers.HealthStateUndetected, "has no mount_setattr(2)"},
		{"no cgroups", true, fakeHost{root: true, cgroupErr: errors.New("the memory cgroup controller is not mounted")}, drivers.HealthStateUnhealthy, "memory cgroup controller"},
		{"root dir", true, fakeHost{root: true, writeErr: errors.New("read-only file system")}, drivers.HealthStateUnhealthy, "root_dir"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDriver(t, Config{Enabled: c.enabled})
			d.host = c.host
			fp := d.buildFingerprint()
			must.Eq(t, c.health, fp.Health)
			must.StrContains(t, fp.HealthDescription, c.desc)
			if c.health == drivers.HealthStateHealthy {
				v, ok := fp.Attributes["driver.csi.version"].GetString()
				must.True(t, ok)
				must.Eq(t, Version, v)
			}
		})
	}
}

func TestFingerprint_sendsAtOnce(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := d.Fingerprint(ctx)
	must.NoError(t, err)
	select {
	case fp := <-ch:
		must.Eq(t, drivers.HealthStateHealthy, fp.Health)
	case <-time.After(2 * time.Second):
		t.Fatal("no fingerprint within 2s")
	}
}

func TestClearDropped(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	fp := &drivers.Fingerprint{Attributes: map[string]*pstructs.Attribute{
		"driver.csi.plugin.p.healthy":            pstructs.NewBoolAttribute(false),
		"driver.csi.plugin.p.health_description": pstructs.NewStringAttribute("socket gone"),
	}}
	d.clearDropped(fp)
	must.MapLen(t, 2, fp.Attributes)

	// The description is gone from the next fingerprint: it is sent empty,
	// which is how Nomad removes a node attribute.
	fp = &drivers.Fingerprint{Attributes: map[string]*pstructs.Attribute{
		"driver.csi.plugin.p.healthy": pstructs.NewBoolAttribute(true),
	}}
	d.clearDropped(fp)
	v, ok := fp.Attributes["driver.csi.plugin.p.health_description"].GetString()
	must.True(t, ok)
	must.Eq(t, "", v)

	// Once cleared, it is not sent again.
	fp = &drivers.Fingerprint{Attributes: map[string]*pstructs.Attribute{
		"driver.csi.plugin.p.healthy": pstructs.NewBoolAttribute(true),
	}}
	d.clearDropped(fp)
	must.MapLen(t, 1, fp.Attributes)
}

func TestParseSignal(t *testing.T) {
	for in, want := range map[string]syscall.Signal{"SIGTERM": syscall.SIGTERM, "TERM": syscall.SIGTERM, "SIGUSR1": syscall.SIGUSR1, "SIGKILL": syscall.SIGKILL} {
		got, err := parseSignal(in)
		must.NoError(t, err)
		must.Eq(t, want, got)
	}
	_, err := parseSignal("SIGNOPE")
	must.ErrorContains(t, err, "unknown signal")

	// Every name Nomad takes for a signal (consul-template's
	// signals.SignalLookup, which exec looks kill_signal up in and a
	// template's change_signal is checked against) is one here too:
	// SIGIOT is SIGABRT, SIGNULL is 0 (a probe that delivers nothing).
	for in, want := range map[string]syscall.Signal{
		"SIGNULL": 0, "SIGABRT": unix.SIGABRT, "SIGALRM": unix.SIGALRM, "SIGBUS": unix.SIGBUS, "SIGCONT": unix.SIGCONT,
		"SIGFPE": unix.SIGFPE, "SIGHUP": unix.SIGHUP, "SIGILL": unix.SIGILL, "SIGINT": unix.SIGINT, "SIGIO": unix.SIGIO,
		"SIGIOT": unix.SIGIOT, "SIGKILL": unix.SIGKILL, "SIGPIPE": unix.SIGPIPE, "SIGPROF": unix.SIGPROF,
		"SIGQUIT": unix.SIGQUIT, "SIGSEGV": unix.SIGSEGV, "SIGSTOP": unix.SIGSTOP, "SIGSYS": unix.SIGSYS,
		"SIGTERM": unix.SIGTERM, "SIGTRAP": unix.SIGTRAP, "SIGTSTP": unix.SIGTSTP, "SIGTTIN": unix.SIGTTIN,
		"SIGTTOU": unix.SIGTTOU, "SIGUSR1": unix.SIGUSR1, "SIGUSR2": unix.SIGUSR2, "SIGWINCH": unix.SIGWINCH,
		"SIGXCPU": unix.SIGXCPU, "SIGXFSZ": unix.SIGXFSZ,
	} {
		got, err := parseSignal(in)
		must.NoError(t, err, must.Sprint(in))
		must.Eq(t, want, got, must.Sprint(in))
	}

	// Real-time signals as Docker and the C library name them (SIGRTMIN
	// is 34: 32 and 33 are the C library's), which a handle keeps for an
	// image's STOPSIGNAL.
	for in, want := range map[string]syscall.Signal{
		"SIGRTMIN": 34, "RTMIN": 34, "SIGRTMIN+3": 37, "RTMIN+3": 37, "SIGRTMIN+30": 64,
		"SIGRTMAX": 64, "RTMAX-1": 63, "SIGRTMAX-30": 34,
	} {
		got, err := parseSignal(in)
		must.NoError(t, err, must.Sprint(in))
		must.Eq(t, want, got, must.Sprint(in))
		back, err := parseSignal(signalName(got))
		must.NoError(t, err, must.Sprint(in))
		must.Eq(t, got, back, must.Sprint(in))
	}
	for _, in := range []string{"SIGRTMIN+31", "SIGRTMAX-31", "SIGRTMIN-1", "SIGRTMAX+1", "SIGRTMIN+", "SIGRTMAX-",
		"SIGRTMIN+003", "SIGRTMIN+ 3", "SIGRTMIN3", "SIGRTMIN+-3", "SIGRTMIN+0x3", "SIGRTMINX"} {
		_, err := parseSignal(in)
		must.ErrorContains(t, err, "unknown signal", must.Sprint(in))
	}
}

// shortTempDir is a temporary root_dir short enough for CSI socket paths
// (t.TempDir's names are too long).
func shortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ncsi")
	must.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}
