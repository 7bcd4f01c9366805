package driver

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

func TestPinnedPath(t *testing.T) {
	must.Eq(t, []string{"/usr/bin", "", "bin"}, pinnedPath([]string{"A=1", "PATH=/usr/bin::bin"}))
	must.Eq(t, []string{""}, pinnedPath([]string{"PATH="}), must.Sprint("an empty PATH is the working directory"))
	must.Eq(t, []string{"/a", "/b"}, pinnedPath([]string{"PATH=/a", "PATH=/b"}), must.Sprint("every PATH is checked"))
}

func TestCheckPinnedDir_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the directories must be root's")
	}
	top := t.TempDir() // root's, 0700, under /tmp (sticky)
	bin := filepath.Join(top, "bin")
	must.NoError(t, os.Mkdir(bin, 0o755))
	tenant := filepath.Join(top, "tenant")
	must.NoError(t, os.Mkdir(tenant, 0o755))
	must.NoError(t, os.Chown(tenant, 65534, 65534))
	sticky := filepath.Join(top, "sticky")
	must.NoError(t, os.Mkdir(sticky, 0o755))
	must.NoError(t, os.Chmod(sticky, 0o777|os.ModeSticky))
	allocs := filepath.Join(top, "alloc")
	must.NoError(t, os.MkdirAll(filepath.Join(allocs, "a1", "t", "local", "bin"), 0o755))
	must.NoError(t, os.Symlink(filepath.Join(allocs, "a1", "t", "local", "bin"), filepath.Join(top, "to-alloc")))

	for _, ok := range []string{bin, bin + "/", filepath.Join(bin, "missing"), filepath.Join(bin, "missing", "deeper")} {
		must.NoError(t, checkPinnedDir(ok, []string{"/local"}, []string{allocs}, true), must.Sprint(ok))
	}
	for _, c := range []struct{ dir, want string }{
		{"", "is relative"},
		{"bin", "is relative"},
		{"./bin", "is relative"},
		{"/local/bin", `inside the task's mount "/local"`},
		{"/local", `inside the task's mount "/local"`},
		{tenant, "owned by uid 65534, not root"},
		{filepath.Join(tenant, "missing"), "does not exist, and whoever can write"},
		{sticky, "writable by its group or by others"},
		{filepath.Join(sticky, "missing"), "does not exist, and whoever can write"},
		{filepath.Join(top, "to-alloc"), "where tasks write"},
		// /proc's links lead into any process's view, a task's root
		// among them, whatever filepath.EvalSymlinks reads in them.
		{fmt.Sprintf("/proc/%d/root/data", os.Getpid()), `goes through "/proc"`},
		{"/proc/self/root/usr/bin", `goes through "/proc"`},
		{"/dev/fd/3", `goes through "/dev/fd", in /proc`},
	} {
		err := checkPinnedDir(c.dir, []string{"/local"}, []string{allocs}, true)
		must.ErrorContains(t, err, c.want, must.Sprint(c.dir))
	}
	// In an image (host false) only what the job places is checked: the
	// image's own files are the digest's.
	must.NoError(t, checkPinnedDir(tenant, []string{"/local"}, nil, false))
	must.ErrorContains(t, checkPinnedDir("/local/bin", []string{"/local"}, nil, false), "inside the task's mount")
	must.ErrorContains(t, checkPinnedDir("bin", nil, nil, false), "is relative")
}

func TestPinnedLoadDirs_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the files must be root's")
	}
	top := t.TempDir()
	write := func(p, body string) string {
		t.Helper()
		must.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		must.NoError(t, os.WriteFile(p, []byte(body), 0o755))
		must.NoError(t, os.Chmod(p, 0o755))
		return p
	}
	sh, err := filepath.EvalSymlinks("/bin/sh")
	must.NoError(t, err)

	// A script: its directory and its interpreter's, and the loader the
	// interpreter names.
	plugin := write(filepath.Join(top, "opt", "bin", "plugin"), "#!/bin/sh -e\nexit 0\n")
	dirs, err := pinnedLoadDirs(plugin, nil, nil)
	must.NoError(t, err)
	must.SliceContains(t, dirs, filepath.Join(top, "opt", "bin"))
	must.SliceContains(t, dirs, filepath.Dir(sh))

	// The interpreter is checked as the command is: a tenant's, in a
	// mount of the task, relative, or a chain too long.
	tenant := write(filepath.Join(top, "tenant", "interp"), "#!/bin/sh\n")
	must.NoError(t, os.Chown(filepath.Dir(tenant), 65534, 65534))
	for _, c := range []struct{ line, want string }{
		{"#!" + tenant + "\n", "owned by uid 65534, not root"},
		{"#!/local/python3\n", `inside the task's mount "/local"`},
		{"#!python3\n", "is relative"},
	} {
		write(plugin, c.line)
		_, err := pinnedLoadDirs(plugin, []string{"/local"}, nil)
		must.ErrorContains(t, err, c.want, must.Sprint(c.line))
	}
	prev := "/bin/sh"
	for i := range maxInterpreters + 1 {
		prev = write(filepath.Join(top, "opt", "chain", string(rune('a'+i))), "#!"+prev+"\n")
	}
	_, err = pinnedLoadDirs(prev, nil, nil)
	must.ErrorContains(t, err, `"#!" interpreters in a row`)

	// An ELF program's RUNPATH ($ORIGIN/../lib) is where its libraries
	// come from: a mount of the job's there is refused.
	if _, err := exec.LookPath("cc"); err != nil {
		t.Skip("no C compiler to build a program with a RUNPATH")
	}
	src := filepath.Join(top, "main.c")
	must.NoError(t, os.WriteFile(src, []byte("int main(void) { return 0; }\n"), 0o644))
	elfBin := filepath.Join(top, "ebs", "bin", "driver")
	must.NoError(t, os.MkdirAll(filepath.Dir(elfBin), 0o755))
	out, err := exec.Command("cc", "-o", elfBin, src, "-Wl,--enable-new-dtags,-rpath,$ORIGIN/../lib").CombinedOutput()
	must.NoError(t, err, must.Sprint(string(out)))
	dirs, err = pinnedLoadDirs(elfBin, nil, nil)
	must.NoError(t, err)
	must.SliceContains(t, dirs, filepath.Join(top, "ebs", "lib"))
	must.NotEq(t, "", pinnedMountReason(filepath.Join(top, "ebs", "lib"), dirs))
	must.NotEq(t, "", pinnedMountReason(filepath.Join(top, "ebs"), dirs))
	must.Eq(t, "", pinnedMountReason(filepath.Join(top, "ebs-data"), dirs))

	must.Eq(t, "/opt/x/lib", filepath.Clean(expandOrigin("$ORIGIN/../lib", "/opt/x/bin")))
	must.Eq(t, "/opt/x/bin/lib", expandOrigin("${ORIGIN}/lib", "/opt/x/bin"))
	must.Eq(t, "/opt/x", expandOrigin("/opt/x/$LIB", "/b"), must.Sprint("another token: the directory before it"))
	must.Eq(t, "/opt", expandOrigin("/opt/x$PLATFORM/y", "/b"))
}

// authorize with a pinned command: the PATH the program inherits, and the
// mounts over it.
func TestAuthorize_pinnedPath_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the command's files must be root's")
	}
	top := t.TempDir()
	bin := installRootBinary(t, filepath.Join(top, "bin"), "plugin")
	tenant := filepath.Join(top, "tenant")
	must.NoError(t, os.Mkdir(tenant, 0o755))
	must.NoError(t, os.Chown(tenant, 65534, 65534))
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: []PrivilegedGrant{
		{Namespace: "storage", Job: "hp", Command: bin, PluginID: "hp"},
	}}
	cfg := &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "storage", JobID: "hp"}
	tc := &TaskConfig{Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}
	spec := func(path string) *executor.Spec {
		return &executor.Spec{Command: bin, Dir: "/local", Env: []string{"PATH=" + path},
			Mounts: []executor.Mount{{Source: "/x", Target: "/local"}, {Source: "/y", Target: "/csi"}}}
	}

	_, err := authorize(conf, cfg, tc, spec(defaultTaskPath), taskImage{})
	must.NoError(t, err)
	for _, c := range []struct{ path, want string }{
		{"/local/bin:" + defaultTaskPath, `its env PATH entry "/local/bin" is inside the task's mount "/local"`},
		{defaultTaskPath + ":.", `its env PATH entry "." is relative`},
		{defaultTaskPath + ":", `its env PATH entry "" is relative`},
		{tenant + ":" + defaultTaskPath, "owned by uid 65534, not root"},
	} {
		_, err := authorize(conf, cfg, tc, spec(c.path), taskImage{})
		must.ErrorContains(t, err, c.want, must.Sprint(c.path))
		must.ErrorContains(t, err, "drop PATH from the task's env")
	}

	// A mount of the job's over a directory of its PATH, or the
	// command's.
	opt := filepath.Join(top, "opt", "bin")
	must.NoError(t, os.MkdirAll(opt, 0o755))
	for _, c := range []struct{ dest, want string }{
		{filepath.Join(top, "opt"), `is inside the task's mount "` + filepath.Join(top, "opt") + `"`},
		{opt, `is inside the task's mount "` + opt + `"`},
		{filepath.Join(opt, "mount"), `a mount at "` + filepath.Join(opt, "mount") + `" would put the job's files into ` + opt},
		{filepath.Join(top, "bin"), `inside the task's mount "` + filepath.Join(top, "bin") + `": a file of the job's`},
	} {
		tc.Volumes = map[string]VolumeConfig{"v": {Destination: c.dest}}
		_, err := authorize(conf, cfg, tc, spec(opt+":"+defaultTaskPath), taskImage{})
		must.ErrorContains(t, err, c.want, must.Sprint(c.dest))
	}
	tc.Volumes = map[string]VolumeConfig{"v": {Destination: "/local/data"}}
	_, err = authorize(conf, cfg, tc, spec(opt+":"+defaultTaskPath), taskImage{})
	must.NoError(t, err)

	// Nomad's data directory holds what tasks write beyond their
	// allocations: its CSI volumes' staging and per-alloc directories,
	// the dynamic host volumes. A directory there a root task made is
	// root's, and still the job's.
	inData := *cfg
	inData.AllocDir = filepath.Join(top, "data", "alloc", "a1")
	hvBin := filepath.Join(top, "data", "host_volumes", "v1", "bin")
	must.NoError(t, os.MkdirAll(hvBin, 0o755))
	_, err = authorize(conf, &inData, tc, spec(hvBin+":"+defaultTaskPath), taskImage{})
	must.ErrorContains(t, err, `inside "`+filepath.Join(top, "data")+`", where tasks write`)

	// Elsewhere, a volume of the job's would stand in for host files the
	// program reads on its own: its home's credentials, the device links
	// it resolves. The job's volume blocks and its volume_mounts alike.
	for _, dest := range []string{"/root/.aws", filepath.Join(top, "data"), "/var/lib/kubelet", "/run/udev", "/alloc/data/x"} {
		tc.Volumes = map[string]VolumeConfig{"v": {Destination: dest}}
		_, err = authorize(conf, cfg, tc, spec(defaultTaskPath), taskImage{})
		must.ErrorContains(t, err, `its mount at "`+dest+`" is outside /local or /secrets`, must.Sprint(dest))
	}
	tc.Volumes = nil
	hostVol := *cfg
	hostVol.Mounts = []*drivers.MountConfig{{TaskPath: "/dev/disk/by-id", HostPath: "/srv/volumes/links"}}
	_, err = authorize(conf, &hostVol, tc, spec(defaultTaskPath), taskImage{})
	must.ErrorContains(t, err, `its mount at "/dev/disk/by-id" is outside /local or /secrets`)
	// Nomad's own: the plugin supervisor's socket, staging and /dev
	// mounts, and the devices of its device plugins.
	nomad := *cfg
	nomad.Mounts = nomadPluginMounts("/var/lib/nomad/client", cfg.AllocID)
	nomad.Mounts[1].HostPath = "/var/lib/nomad/client/csi/monolith/hp"
	nomad.Devices = []*drivers.DeviceConfig{{TaskPath: "/dev/nvidia0", HostPath: "/dev/nvidia0"}}
	_, err = authorize(conf, &nomad, &TaskConfig{Privileged: true}, spec(defaultTaskPath), taskImage{})
	must.NoError(t, err)

	// Without a pin the job is trusted with what runs: its PATH is its own.
	conf.PrivilegedGrants[0].Command = ""
	_, err = authorize(conf, cfg, tc, spec("/local/bin:"+defaultTaskPath), taskImage{})
	must.NoError(t, err)
}

// Nothing is exec'd into a task whose grant pins its program (nomad alloc
// exec, script checks, change_script and actions all come this way), in
// the driver that started it or in one that recovered it.
func TestExecTask_pinnedRefused_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the command's files must be root's")
	}
	bin := installRootBinary(t, filepath.Join(t.TempDir(), "bin"), "plugin")
	pinned := []PrivilegedGrant{{Namespace: "*", Job: "*", Command: bin}}
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: pinned})
	cfg := taskConfig(t, TaskConfig{Command: bin, Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}})
	handle, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	var st TaskState
	must.NoError(t, handle.GetDriverState(&st))
	must.StrContains(t, st.PinnedBy, `command = "`+bin+`"`)

	refused := func(d *testDriver) {
		t.Helper()
		_, err := d.ExecTask(cfg.ID, []string{"/bin/sh", "-c", "id"}, time.Second)
		must.ErrorContains(t, err, "exec into this task is refused: it runs privileged under privileged_grant")
		_, err = d.ExecTaskStreaming(context.Background(), cfg.ID, &drivers.ExecOptions{Command: []string{"/bin/sh"}})
		must.ErrorContains(t, err, "exec into this task is refused")
	}
	refused(d)
	d2 := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: pinned})
	must.NoError(t, d2.RecoverTask(persisted(t, handle)))
	refused(d2)

	// Under a grant that pins nothing, the job is trusted with what runs
	// in its task, exec included.
	d3 := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	_, _, err = d3.StartTask(cfg)
	must.NoError(t, err)
	res, err := d3.ExecTask(cfg.ID, []string{"id"}, time.Second)
	must.NoError(t, err)
	must.Eq(t, 7, res.ExitResult.ExitCode)
}

// A plugin task taken back after the driver restarted does not keep an
// id the operator has since reserved for another job: it started before
// the grant (an upgrade, or a config change with the restart), and would
// otherwise serve the id, and get its volumes' calls and secrets, while
// the granted job's plugin is refused.
func TestRecoverTask_reservedPluginID(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	cfg := taskConfig(t, TaskConfig{Command: "/usr/bin/plugin", Privileged: true,
		CSIPlugin: &PluginTaskConfig{ID: "ebs", Type: "monolith", MountDir: "/csi"}})
	cfg.Namespace, cfg.JobID = "default", "squatter"
	handle, _, err := d.StartTask(cfg)
	must.NoError(t, err)

	reserved := []PrivilegedGrant{{Namespace: "storage", Job: "ebs-node", PluginID: "ebs"}, {Namespace: "*", Job: "*"}}
	d2 := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: reserved})
	must.NoError(t, d2.RecoverTask(persisted(t, handle)))
	_, ok := d2.prober.Get("ebs")
	must.False(t, ok, must.Sprint("the recovered squatter serves the reserved id"))
	_, held := d2.plugins.job("ebs", cfg.ID)
	must.False(t, held, must.Sprint("the recovered squatter holds the reserved id"))
	h, ok := d2.tasks.Get(cfg.ID)
	must.True(t, ok, must.Sprint("the task itself is taken back"))
	must.Nil(t, h.plugin)

	// The granted job's plugin starts.
	op := taskConfig(t, TaskConfig{Command: "/usr/bin/plugin", Privileged: true,
		CSIPlugin: &PluginTaskConfig{ID: "ebs", Type: "monolith", MountDir: "/csi"}})
	op.ID, op.AllocID, op.Namespace, op.JobID = "alloc-9/plugin/x", "alloc-9", "storage", "ebs-node"
	_, _, err = d2.StartTask(op)
	must.NoError(t, err)

	// The granted job's own task is taken back with its id.
	d3 := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: reserved})
	opHandle, _, err := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: reserved}).StartTask(op)
	must.NoError(t, err)
	must.NoError(t, d3.RecoverTask(persisted(t, opHandle)))
	ps, ok := d3.prober.Get("ebs")
	must.True(t, ok)
	must.Eq(t, op.ID, ps.TaskID)
}

// The process on a plugin task's socket must be the task's: another
// privileged task's program given the socket's path would otherwise take
// the plugin's calls.
func TestSocketPeer(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	conf := d.currentConfig()
	must.Nil(t, d.socketPeer("/run/csi/other/csi.sock"), must.Sprint("an operator's socket is not checked"))
	peer := d.socketPeer(conf.pluginSocket("hp"))
	must.NotNil(t, peer)
	must.ErrorContains(t, peer(int32(os.Getpid())), `no task serves csi_plugin "hp" on this node`)

	cfg := taskConfig(t, TaskConfig{Command: "/usr/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}})
	_, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	must.ErrorContains(t, peer(int32(os.Getpid())), "is not the plugin task's (control group \""+taskCgroupName(cfg)+"\")")

	// A process in a control group of the task's name passes: this one's
	// own, read from /proc.
	b, err := os.ReadFile("/proc/self/cgroup")
	must.NoError(t, err)
	var own string
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if parts := strings.SplitN(line, ":", 3); len(parts) == 3 && filepath.Base(parts[2]) != "/" && filepath.Base(parts[2]) != "." {
			own = filepath.Base(parts[2])
		}
	}
	if own == "" {
		t.Skip("this process is in the root control group")
	}
	must.NoError(t, inTaskCgroup(int32(os.Getpid()), own))
	must.ErrorContains(t, inTaskCgroup(int32(os.Getpid()), own+"x"), "is not the plugin task's")
	must.NoError(t, inTaskCgroup(int32(os.Getpid()), own+"x", own), must.Sprint("any of the task's names passes"))
}

// On cgroup v2, where Nomad lays out a group for each task, the task runs
// in Nomad's scope (cgroups.Create), and the socket's check accepts that
// name beside the driver's own; a v1 cpuset group of Nomad's is no task's.
func TestTaskCgroupNames(t *testing.T) {
	cfg := &drivers.TaskConfig{ID: "a1/t/0f", Resources: &drivers.Resources{LinuxResources: &drivers.LinuxResources{
		CpusetCgroupPath: "/sys/fs/cgroup/nomad.slice/share.slice/a1.t.scope"}}}
	must.Eq(t, []string{"a1.t.0f", "a1.t.scope"}, taskCgroupNames(cfg))
	cfg.Resources.LinuxResources.CpusetCgroupPath = "/sys/fs/cgroup/cpuset/nomad/shared"
	must.Eq(t, []string{"a1.t.0f"}, taskCgroupNames(cfg))
	cfg.Resources = nil
	must.Eq(t, []string{"a1.t.0f"}, taskCgroupNames(cfg))
}

// Every spelling of user that the supervisor would run as uid 0 or with
// gid 0 is refused by denied_host_uids/denied_host_gids = "0"; the
// spellings it cannot resolve are refused too, never passed through.
func TestCheckHostIDs_userForms(t *testing.T) {
	conf := &Config{DeniedHostUIDs: "0", DeniedHostGIDs: "0"}
	for _, u := range []string{"root", "0", "00", "000", "root:0", "root:root", "0:0", "00:00", "nobody:0", "nobody:00", "nobody:root",
		"+0", " 0", "0 ", "-0", "0x0", "4294967296", "65534:+0", "nobody: 0", "root "} {
		cred, rerr := taskuser.Resolve(u)
		herr := checkHostIDs(conf, u)
		if rerr != nil {
			must.Error(t, herr, must.Sprintf("%q does not resolve (%v) but passes the check", u, rerr))
			continue
		}
		if cred.UID == 0 || cred.GID == 0 {
			must.Error(t, herr, must.Sprintf("%q runs as uid %d gid %d", u, cred.UID, cred.GID))
		}
	}
}

// A task that is not privileged gets no host path that holds, or is in,
// the host's kernel interfaces, nor one through /proc: a host volume of
// "/" (which with ACLs off any job can register) brought the host's /proc.
func TestCheckHostMountSources(t *testing.T) {
	table := []mounter.MountPoint{
		{Path: "/", FSType: "ext4"},
		{Path: "/proc", FSType: "proc"},
		{Path: "/proc/sys/fs/binfmt_misc", FSType: "binfmt_misc"},
		{Path: "/sys", FSType: "sysfs"},
		{Path: "/sys/fs/cgroup/memory", FSType: "cgroup"},
		{Path: "/run/netns/x", FSType: "nsfs"},
		{Path: "/srv", FSType: "xfs"},
		{Path: "/dev", FSType: "devtmpfs"},
	}
	mount := func(src string) []executor.Mount { return []executor.Mount{{Source: src, Target: "/host"}} }
	nobody := func(string) bool { return false }
	for _, c := range []struct{ src, want string }{
		{"/", `is in or holds the host's proc file system at "/proc"`},
		{"/sys/fs", `is in or holds the host's sysfs file system at "/sys"`},
		{"/sys/fs/cgroup/memory/x", `the host's sysfs file system at "/sys"`},
		{"/proc/1/root/srv", `goes through "/proc"`},
		{fmt.Sprintf("/proc/%d/root", os.Getpid()), `goes through "/proc"`},
		{"/run", `is in or holds the host's nsfs file system at "/run/netns/x"`},
	} {
		must.ErrorContains(t, checkHostMountSources(mount(c.src), table, nil, nobody), c.want, must.Sprint(c.src))
	}
	for _, ok := range []string{"/srv", "/etc/ssl/certs", "/dev/fuse", "/var/lib"} {
		must.NoError(t, checkHostMountSources(mount(ok), table, nil, nobody), must.Sprint(ok))
	}

	// Other allocations' directories (their tasks' /secrets), the
	// driver's root_dir and Nomad's client state (other allocations' CSI
	// volumes); the task's own allocation directory and its own CSI
	// volumes' per-alloc directories are its.
	others, mine := othersDirs(&Config{RootDir: "/var/lib/nomad-driver-csi"},
		&drivers.TaskConfig{AllocID: "a1", AllocDir: "/var/lib/nomad/alloc/a1"})
	for _, bad := range []string{"/var/lib/nomad/alloc/a2/web/secrets", "/var/lib/nomad/alloc", "/var/lib/nomad", "/var/lib/nomad-driver-csi/tasks",
		"/var/lib/nomad/client/csi/node/p/per-alloc/a2/v/rw", "/var/lib/nomad/client/csi/node/p/staging/v", "/var/lib/nomad/client/state.db"} {
		must.ErrorContains(t, checkHostMountSources(mount(bad), nil, others, mine), "the directories of other allocations or of the driver", must.Sprint(bad))
	}
	for _, ok := range []string{"/var/lib/nomad/alloc/a1/alloc/data", "/var/lib/nomad/client/csi/node/p/per-alloc/a1/v/rw-file-system-single-node-writer", "/srv", "/var/lib/nomad/host_volumes/x"} {
		must.NoError(t, checkHostMountSources(mount(ok), nil, others, mine), must.Sprint(ok))
	}
}

// StartTask applies checkHostMountSources to the mounts Nomad hands a task
// that is not privileged, and not to a privileged one.
func TestStartTask_hostVolumeOfRoot(t *testing.T) {
	fake := func(d *Driver) {
		d.mounter = mounter.NewFake(mounter.MountPoint{Path: "/", Shared: true, PeerGroup: 1}, mounter.MountPoint{Path: "/proc", FSType: "proc"})
	}
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll, PrivilegedPluginsOnly: false}, fake)
	cfg := taskConfig(t, TaskConfig{Command: "/bin/sh"})
	cfg.Mounts = []*drivers.MountConfig{{TaskPath: "/host", HostPath: "/", Readonly: true}}
	_, _, err := d.StartTask(cfg)
	must.ErrorContains(t, err, `mount "/host": its host path "/" is in or holds the host's proc file system at "/proc"`)
	must.SliceEmpty(t, d.started)

	priv := taskConfig(t, TaskConfig{Command: "/bin/sh", Privileged: true})
	priv.Mounts = cfg.Mounts
	_, _, err = d.StartTask(priv)
	must.NoError(t, err)
}

// Under an image grant the task sees its image, not the host: its state
// volume may go where the image keeps state; the image's system
// directories, PATH and exec stay the pin's.
func TestAuthorize_imagePinnedMounts(t *testing.T) {
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: []PrivilegedGrant{
		{Namespace: "storage", Job: "ebs-node", Image: "registry.example/ebs@" + digestA, PluginID: "ebs"},
	}}
	cfg := &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "storage", JobID: "ebs-node"}
	tc := &TaskConfig{Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "ebs", Type: "node", MountDir: "/csi"}}
	img := taskImage{Ref: "registry.example/ebs:1", Digest: digestA, Entrypoint: []string{"/bin/aws-ebs-csi-driver"}}
	spec := func(path string) *executor.Spec {
		return &executor.Spec{Command: "/bin/aws-ebs-csi-driver", Dir: "/", Env: []string{"PATH=" + path},
			Mounts: []executor.Mount{{Source: "/x", Target: "/local"}, {Source: "/y", Target: "/csi"}}}
	}
	cfg.Mounts = []*drivers.MountConfig{{TaskPath: "/var/lib/ebs", HostPath: "/srv/ebs-state"}}
	g, err := authorize(conf, cfg, tc, spec(defaultTaskPath), img)
	must.NoError(t, err)
	must.True(t, g.pins())
	cfg.Mounts = []*drivers.MountConfig{{TaskPath: "/usr/lib/ebs", HostPath: "/srv/ebs-state"}}
	sp := spec(defaultTaskPath)
	sp.Mounts = append(sp.Mounts, executor.Mount{Source: "/srv/ebs-state", Target: "/usr/lib/ebs"})
	_, err = authorize(conf, cfg, tc, sp, img)
	must.ErrorContains(t, err, `a mount at "/usr/lib/ebs" would put the job's files into /usr`)
	cfg.Mounts = nil
	_, err = authorize(conf, cfg, tc, spec("/local/bin:"+defaultTaskPath), img)
	must.ErrorContains(t, err, `its env PATH entry "/local/bin" is inside the task's mount "/local"`)
}

// Under an image grant the image's own program runs: a job's entrypoint
// (or, for an image with only a cmd, its command or first arg) would run
// any program of the image, a shell with the job's script as root among
// them, and is refused; arguments to the image's program are the job's.
func TestAuthorize_imagePinnedProgram(t *testing.T) {
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: []PrivilegedGrant{
		{Namespace: "storage", Job: "ebs-node", Image: "registry.example/ebs@" + digestA, PluginID: "ebs"},
	}}
	cfg := &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "storage", JobID: "ebs-node"}
	spec := func() *executor.Spec {
		return &executor.Spec{Command: "/bin/aws-ebs-csi-driver", Dir: "/", Env: []string{"PATH=" + defaultTaskPath}}
	}
	withEntry := taskImage{Ref: "registry.example/ebs:1", Digest: digestA, Entrypoint: []string{"/bin/aws-ebs-csi-driver"}, Cmd: []string{"node"}}
	cmdOnly := taskImage{Ref: "registry.example/ebs:1", Digest: digestA, Cmd: []string{"/bin/aws-ebs-csi-driver", "node"}}
	plugin := func(edit func(tc *TaskConfig)) *TaskConfig {
		tc := &TaskConfig{Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "ebs", Type: "node", MountDir: "/csi"}}
		edit(tc)
		return tc
	}
	for _, c := range []struct {
		name string
		img  taskImage
		tc   *TaskConfig
		err  string
	}{
		{"args", withEntry, plugin(func(tc *TaskConfig) { tc.Args = []string{"node", "--endpoint=${CSI_ENDPOINT}"} }), ""},
		{"command as an argument", withEntry, plugin(func(tc *TaskConfig) { tc.Command = "node" }), ""},
		{"the image's entrypoint", withEntry, plugin(func(tc *TaskConfig) { tc.Entrypoint = []string{"/bin/aws-ebs-csi-driver"} }), ""},
		{"a shell entrypoint", withEntry, plugin(func(tc *TaskConfig) { tc.Entrypoint = []string{"/bin/sh", "-c", "id"} }),
			`entrypoint ["/bin/sh" "-c" "id"] is not allowed in this task: it would run another program of the image than its own ["/bin/aws-ebs-csi-driver"]`},
		{"cmd-only image, its program", cmdOnly, plugin(func(tc *TaskConfig) { tc.Command = "/bin/aws-ebs-csi-driver"; tc.Args = []string{"node"} }), ""},
		{"cmd-only image, no override", cmdOnly, plugin(func(*TaskConfig) {}), ""},
		{"cmd-only image, another command", cmdOnly, plugin(func(tc *TaskConfig) { tc.Command = "/bin/sh"; tc.Args = []string{"-c", "id"} }),
			`command "/bin/sh" is not allowed in this task: it would run another program of the image than its own "/bin/aws-ebs-csi-driver"`},
		{"an image with no program", taskImage{Ref: "registry.example/ebs:1", Digest: digestA}, plugin(func(tc *TaskConfig) { tc.Command = "/bin/aws-ebs-csi-driver" }),
			"the image names no program of its own"},
		{"cmd-only image, another first arg", cmdOnly, plugin(func(tc *TaskConfig) { tc.Args = []string{"/bin/sh", "-c", "id"} }),
			`args' first element "/bin/sh" is not allowed in this task: it would run another program of the image than its own "/bin/aws-ebs-csi-driver"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := authorize(conf, cfg, c.tc, spec(), c.img)
			if c.err == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, c.err)
			must.ErrorContains(t, err, "privileged_grant")
		})
	}
}

// Under an image grant the program the image names is the one that runs:
// a relative program (democratic-csi's ENTRYPOINT ["bin/democratic-csi"]
// from WORKDIR /home/csi/app) is found in the working directory, which a
// job's work_dir would move to its own files (/local, which its templates
// and artifacts write), and a job's mount over the program, its directory
// or the image's working directory would put the job's files in its place.
func TestAuthorize_imagePinnedProgramPlace(t *testing.T) {
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: []PrivilegedGrant{
		{Namespace: "storage", Job: "dcsi", Image: "docker.io/democraticcsi/democratic-csi@" + digestA, PluginID: "nfs"},
	}}
	relative := taskImage{Ref: "democraticcsi/democratic-csi:v1", Digest: digestA, Entrypoint: []string{"bin/democratic-csi"}, WorkingDir: "/home/csi/app"}
	cmdOnly := taskImage{Ref: "democraticcsi/democratic-csi:v1", Digest: digestA, Cmd: []string{"bin/democratic-csi"}, WorkingDir: "/home/csi/app"}
	absolute := taskImage{Ref: "democraticcsi/democratic-csi:v1", Digest: digestA, Entrypoint: []string{"/opt/csi/bin/plugin"}}
	atRoot := taskImage{Ref: "democraticcsi/democratic-csi:v1", Digest: digestA, Entrypoint: []string{"/hostpathplugin"}}
	inCSI := taskImage{Ref: "democraticcsi/democratic-csi:v1", Digest: digestA, Entrypoint: []string{"bin/plugin"}, WorkingDir: "/csi"}
	for _, c := range []struct {
		name    string
		img     taskImage
		workDir string
		mount   string
		err     string
	}{
		{"relative, the image's working directory", relative, "", "", ""},
		{"relative, work_dir the image's", relative, "/home/csi/app/", "", ""},
		{"relative, work_dir the job's", relative, "/local", "", `work_dir "/local" is not allowed in this task`},
		{"relative cmd, work_dir the job's", cmdOnly, "/local", "", `work_dir "/local" is not allowed in this task`},
		{"absolute, work_dir the job's", absolute, "/local", "", ""},
		{"a state mount", relative, "", "/var/lib/dcsi", ""},
		{"a mount on the working directory", relative, "", "/home/csi/app", `a mount at "/home/csi/app"`},
		{"a mount in the working directory", relative, "", "/home/csi/app/node_modules", `a mount at "/home/csi/app/node_modules"`},
		{"a mount above the program", relative, "", "/home", `a mount at "/home"`},
		{"a mount on the program's directory", absolute, "", "/opt/csi/bin", `a mount at "/opt/csi/bin"`},
		{"a mount on the program", atRoot, "", "/hostpathplugin", `a mount at "/hostpathplugin"`},
		{"a mount beside a program at the root", atRoot, "", "/var/lib/hostpath", ""},
		// The socket directory outlives the task and holds what any task
		// that served the id wrote (a task that is not privileged
		// too): over the program's directory, it is refused, naming
		// mount_dir.
		{"mount_dir on the working directory", inCSI, "", "", `csi_plugin mount_dir "/csi" would put the plugin's socket directory in place of the image's program "bin/plugin"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "storage", JobID: "dcsi"}
			tc := &TaskConfig{Privileged: true, WorkDir: c.workDir, CSIPlugin: &PluginTaskConfig{ID: "nfs", Type: "node", MountDir: "/csi"}}
			if len(c.img.Entrypoint) > 0 {
				tc.Args = []string{"--csi-mode=node"}
			}
			dir := c.workDir
			if dir == "" {
				dir = "/"
			}
			spec := &executor.Spec{Command: "bin/democratic-csi", Dir: dir, Env: []string{"PATH=" + defaultTaskPath},
				Mounts: []executor.Mount{{Source: "/x", Target: "/local"}, {Source: "/y", Target: "/csi"}}}
			if c.mount != "" {
				cfg.Mounts = []*drivers.MountConfig{{TaskPath: c.mount, HostPath: "/srv/dcsi"}}
				spec.Mounts = append(spec.Mounts, executor.Mount{Source: "/srv/dcsi", Target: c.mount})
			}
			_, err := authorize(conf, cfg, tc, spec, c.img)
			if c.err == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, c.err)
			must.ErrorContains(t, err, "privileged_grant")
		})
	}
}

// Under an image grant, the program's file is where the image's symlinks
// lead (/usr/local/bin/plugin -> /opt/plugin/bin/plugin), and the image's
// PATH is where it is found by name and where it runs the programs it
// names (mount, mkfs.ext4): a job's mount on either puts the job's files
// in their place.
func TestAuthorize_imagePinnedProgramFile(t *testing.T) {
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: []PrivilegedGrant{
		{Namespace: "storage", Job: "p", Image: "registry.example/p@" + digestA, PluginID: "p"},
	}}
	linked := taskImage{Ref: "registry.example/p:1", Digest: digestA, Entrypoint: []string{"/usr/local/bin/plugin"}, ProgramFile: "/opt/plugin/bin/plugin"}
	named := taskImage{Ref: "registry.example/p:1", Digest: digestA, Entrypoint: []string{"plugin"}, Env: []string{"PATH=/opt/plugin/bin:/usr/bin"}}
	namedInDir := named
	namedInDir.WorkingDir = "/w"
	for _, c := range []struct {
		name  string
		img   taskImage
		mount string
		err   string
	}{
		{"a state mount, linked program", linked, "/var/lib/p", ""},
		{"a mount on the program's file's directory", linked, "/opt/plugin/bin", `a mount at "/opt/plugin/bin"`},
		{"a mount above the program's file", linked, "/opt", `a mount at "/opt"`},
		{"a state mount, named program", named, "/var/lib/p", ""},
		{"a mount on the image's PATH", named, "/opt/plugin/bin", `a mount at "/opt/plugin/bin"`},
		{"a mount on the image's PATH, from a working directory", namedInDir, "/opt/plugin/bin", `a mount at "/opt/plugin/bin"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "storage", JobID: "p",
				Mounts: []*drivers.MountConfig{{TaskPath: c.mount, HostPath: "/srv/p"}}}
			tc := &TaskConfig{Privileged: true, Args: []string{"--node"}, CSIPlugin: &PluginTaskConfig{ID: "p", Type: "node", MountDir: "/csi"}}
			spec := &executor.Spec{Command: c.img.Entrypoint[0], Dir: "/", Env: []string{"PATH=" + defaultTaskPath},
				Mounts: []executor.Mount{{Source: "/x", Target: "/local"}, {Source: "/y", Target: "/csi"}, {Source: "/srv/p", Target: c.mount}}}
			_, err := authorize(conf, cfg, tc, spec, c.img)
			if c.err == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, c.err)
			must.ErrorContains(t, err, "privileged_grant")
		})
	}
}

// imageProgramFile follows the image's symlinks from its program: from the
// image's working directory for a relative one, through its PATH for a
// name.
func TestImageProgramFile(t *testing.T) {
	fs := newLayeredFS(testLayers(t, map[string]string{
		"opt/plugin/bin/plugin":  "#!/bin/sh\n",
		"usr/local/bin/plugin":   "->../../../opt/plugin/bin/plugin",
		"usr/bin/abs":            "->/opt/plugin/bin/plugin",
		"home/csi/app/bin/dcsi":  "js",
		"home/csi/app/bin/alias": "->dcsi",
	}))
	for _, c := range []struct {
		prog, dir string
		path      []string
		want      string
	}{
		{"/usr/local/bin/plugin", "/", nil, "/opt/plugin/bin/plugin"},
		{"/usr/bin/abs", "/", nil, "/opt/plugin/bin/plugin"},
		{"bin/alias", "/home/csi/app", nil, "/home/csi/app/bin/dcsi"},
		{"abs", "/", []string{"/nonexistent", "/usr/bin"}, "/opt/plugin/bin/plugin"},
		{"missing", "/", []string{"/usr/bin"}, ""},
		{"/opt/plugin/bin/plugin", "/", nil, "/opt/plugin/bin/plugin"},
	} {
		must.Eq(t, c.want, imageProgramFile(fs, c.prog, c.dir, c.path), must.Sprint(c.prog))
	}
	// What a starting task's authorize is told of its image.
	layers := testLayers(t, map[string]string{"opt/p/plugin": "x", "usr/local/bin/plugin": "->/opt/p/plugin"})
	img := &image.Image{Ref: "r/p:1", Digest: digestA, Layers: layers, Config: image.Config{Entrypoint: []string{"plugin"},
		WorkingDir: "/w", Env: []string{"PATH=/usr/local/bin:/usr/bin"}}}
	must.Eq(t, taskImage{Ref: "r/p:1", Digest: digestA, Entrypoint: []string{"plugin"}, WorkingDir: "/w",
		Env: []string{"PATH=/usr/local/bin:/usr/bin"}, ProgramFile: "/opt/p/plugin"}, newTaskImage(img))
}
