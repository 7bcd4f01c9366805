package driver

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"testing/fstest"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// The driver's tests start real tasks: the test binary must also be able to
// act as the supervisor the executor re-executes.
func TestMain(m *testing.M) {
	if supervisor.RunReexec() {
		return
	}
	// Tasks run from this test binary, never from an embedded shim that may
	// predate the code under test (the e2e tests run the shim, built fresh).
	shimSource = fstest.MapFS{}
	os.Exit(m.Run())
}

func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the driver makes mount namespaces and control groups")
	}
}

// harnessDriver is the real driver behind the gRPC harness (harness_test.go).
// before runs on the driver before its configuration.
func harnessDriver(t *testing.T, cfg Config, before ...func(*Driver)) (*driverHarness, *Driver) {
	t.Helper()
	d := NewPlugin(hclog.NewNullLogger())
	for _, f := range before {
		f(d)
	}
	// A volume whose plugin is missing fails within a test's patience.
	d.pluginWait = 200 * time.Millisecond
	h := newDriverHarness(t, d)
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = "nomad-csi-test"
	}
	t.Cleanup(func() { removeCgroupParent(cfg.CgroupParent) })
	if cfg.RootDir == "" {
		cfg.RootDir = shortTempDir(t)
	}
	// After the root's removal is registered, so that it runs before it.
	t.Cleanup(d.Shutdown)
	cfg.Enabled = true
	var buf []byte
	must.NoError(t, base.MsgPackEncode(&buf, &cfg))
	must.NoError(t, h.SetConfig(&base.Config{PluginConfig: buf, AgentConfig: &base.AgentConfig{Driver: &base.ClientDriverConfig{}}}))
	return h, d
}

// mkAllocDir makes a task's directories (and, with logs, its log FIFOs);
// the returned function removes them.
func mkAllocDir(t *testing.T, h *driverHarness, cfg *drivers.TaskConfig, logs bool) func() {
	t.Helper()
	return h.MkAllocDir(cfg, logs)
}

// removeCgroupParent removes a test's cgroup parent in every hierarchy
// where it is empty; one still in use by another test stays.
func removeCgroupParent(parent string) {
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*/" + parent)
	for _, dir := range append(dirs, "/sys/fs/cgroup/"+parent) {
		_ = unix.Rmdir(dir)
	}
}

func TestDriver_runsTaskWithLogsAndExitCode(t *testing.T) {
	requireRoot(t)
	h, _ := harnessDriver(t, Config{})
	cfg := realTask(t, "hello", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "echo out-$GREETING; echo err >&2; pwd; exit 3"}})
	cfg.Env = map[string]string{"GREETING": "hi"}
	cleanup := mkAllocDir(t, h, cfg, true)
	defer cleanup()

	startTask(t, h, cfg)
	res := waitExit(t, h, cfg.ID, 20*time.Second)
	must.Eq(t, 3, res.ExitCode)
	must.Eq(t, 0, res.Signal)
	must.NoError(t, h.DestroyTask(cfg.ID, false))

	taskDir := cfg.TaskDir()
	// Like exec's, the task starts in its root, where Nomad's directories
	// are (FSIsolation image).
	eventually(t, 5*time.Second, fileHas(filepath.Join(taskDir.LogDir, "hello.stdout.0"), "out-hi\n/\n"))
	eventually(t, 5*time.Second, fileHas(filepath.Join(taskDir.LogDir, "hello.stderr.0"), "err\n"))
}

// eventually retries cond until it returns nil or the timeout passes.
func eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %s: %v", timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func fileHas(path, want string) func() error {
	return func() error {
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if string(data) != want {
			return fmt.Errorf("%s holds %q, want %q", path, data, want)
		}
		return nil
	}
}

func mountedAt(path string) func() error {
	return func() error {
		ok, err := mounter.New().IsMountPoint(path)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("%s is not a mount point", path)
		}
		return nil
	}
}

func TestDriver_stopHonoursSignalAndRecoversAfterRestart(t *testing.T) {
	requireRoot(t)
	root := shortTempDir(t)
	h, _ := harnessDriver(t, Config{RootDir: root})
	script := `trap 'echo got-usr1; exit 0' USR1; echo $$ > "$NOMAD_TASK_DIR/pid"; while :; do sleep 0.1; done`
	cfg := realTask(t, "svc", TaskConfig{Command: "/bin/sh", Args: []string{"-c", script}})
	cleanup := mkAllocDir(t, h, cfg, true)
	defer cleanup()

	handle := startTask(t, h, cfg)
	// The pid file is written after the trap is set. The shell creates
	// it before it writes the number: wait for the whole line.
	pidFile := filepath.Join(cfg.TaskDir().LocalDir, "pid")
	eventually(t, 10*time.Second, func() error {
		data, err := os.ReadFile(pidFile)
		if err == nil && !strings.HasSuffix(string(data), "\n") {
			err = fmt.Errorf("%s holds %q so far", pidFile, data)
		}
		return err
	})
	status, err := h.InspectTask(cfg.ID)
	must.NoError(t, err)
	pid, err := strconv.Atoi(status.DriverAttributes["pid"])
	must.NoError(t, err)
	written, err := os.ReadFile(pidFile)
	must.NoError(t, err)
	// The task sees itself by its number in its own PID namespace; the
	// driver reports the host's number of the same process.
	nspid := procNSpid(t, pid)
	must.Eq(t, strconv.Itoa(nspid[len(nspid)-1])+"\n", string(written))
	must.Eq(t, pid, nspid[0])
	must.Greater(t, 1, len(nspid))

	// A new driver process (as after an agent restart) takes the task back
	// from the handle Nomad stored: same PID, still running.
	h2, _ := harnessDriver(t, Config{RootDir: root})
	must.NoError(t, h2.RecoverTask(handle))
	status, err = h2.InspectTask(cfg.ID)
	must.NoError(t, err)
	must.Eq(t, drivers.TaskStateRunning, status.State)
	must.Eq(t, strconv.Itoa(pid), status.DriverAttributes["pid"])
	must.NoError(t, syscall.Kill(pid, 0))

	must.NoError(t, h2.StopTask(cfg.ID, 5*time.Second, "SIGUSR1"))
	res := waitExit(t, h2, cfg.ID, 10*time.Second)
	must.Eq(t, 0, res.ExitCode)
	must.NoError(t, h2.DestroyTask(cfg.ID, false))
}

func TestDriver_killsAfterTimeoutAndExec(t *testing.T) {
	requireRoot(t)
	h, _ := harnessDriver(t, Config{})
	cfg := realTask(t, "stubborn", TaskConfig{Command: "/bin/sh", Args: []string{"-c", `trap '' TERM; while :; do sleep 0.1; done`}})
	cleanup := mkAllocDir(t, h, cfg, true)
	defer cleanup()
	startTask(t, h, cfg)
	must.NoError(t, h.WaitUntilStarted(cfg.ID, 10*time.Second))

	res, err := h.ExecTask(cfg.ID, []string{"/bin/sh", "-c", "echo in-task; exit 4"}, 10*time.Second)
	must.NoError(t, err)
	must.Eq(t, "in-task\n", string(res.Stdout))
	must.Eq(t, 4, res.ExitResult.ExitCode)

	start := time.Now()
	must.NoError(t, h.StopTask(cfg.ID, time.Second, "SIGTERM"))
	exit := waitExit(t, h, cfg.ID, 10*time.Second)
	must.Eq(t, int(syscall.SIGKILL), exit.Signal)
	must.Greater(t, time.Second-50*time.Millisecond, time.Since(start))
	must.NoError(t, h.DestroyTask(cfg.ID, false))
}

// A real command that floods both outputs of ExecTask: the driver keeps
// the last drivers.CheckBufSize bytes of each, not the 64 MiB written.
func TestDriver_execTaskOutputBounded(t *testing.T) {
	requireRoot(t)
	h, _ := harnessDriver(t, Config{})
	cfg := realTask(t, "flood", TaskConfig{Command: "/bin/sleep", Args: []string{"300"}})
	cleanup := mkAllocDir(t, h, cfg, true)
	defer cleanup()
	startTask(t, h, cfg)
	must.NoError(t, h.WaitUntilStarted(cfg.ID, 10*time.Second))

	res, err := h.ExecTask(cfg.ID, []string{"/bin/sh", "-c",
		"head -c 67108864 /dev/zero; echo out-end; head -c 67108864 /dev/zero >&2; echo err-end >&2; exit 3"}, time.Minute)
	must.NoError(t, err)
	must.Eq(t, 3, res.ExitResult.ExitCode)
	must.Eq(t, drivers.CheckBufSize, len(res.Stdout))
	must.Eq(t, drivers.CheckBufSize, len(res.Stderr))
	must.StrHasSuffix(t, "out-end\n", string(res.Stdout))
	must.StrHasSuffix(t, "err-end\n", string(res.Stderr))

	must.NoError(t, h.StopTask(cfg.ID, time.Second, "SIGKILL"))
	waitExit(t, h, cfg.ID, 10*time.Second)
	must.NoError(t, h.DestroyTask(cfg.ID, false))
}

func TestDriver_privilegedRefusedUnlessAllowed(t *testing.T) {
	requireRoot(t)
	h, _ := harnessDriver(t, Config{})
	cfg := realTask(t, "priv", TaskConfig{Command: "/bin/true", Privileged: true})
	cleanup := mkAllocDir(t, h, cfg, false)
	defer cleanup()
	_, _, err := h.StartTask(cfg)
	must.ErrorContains(t, err, "allow_privileged")
}

// A privileged task with a bidirectional mount whose source is not a mount
// point: the driver makes the source a shared mount point, a mount the task
// makes there reaches the host, and once the task is gone nothing is left.
func TestDriver_bidirectionalMountReachesHost(t *testing.T) {
	requireRoot(t)
	h, _ := harnessDriver(t, Config{AllowPrivileged: true, PrivilegedGrants: grantAll})
	src := t.TempDir()
	cfg := realTask(t, "bidi", TaskConfig{
		Command:    "/bin/sh",
		Args:       []string{"-c", `mkdir -p /bidi/sub && mount -t tmpfs bidi-test /bidi/sub && touch /bidi/sub/ok && while :; do sleep 0.1; done`},
		Privileged: true,
	})
	cfg.Mounts = []*drivers.MountConfig{{TaskPath: "/bidi", HostPath: src, PropagationMode: "bidirectional"}}
	cleanup := mkAllocDir(t, h, cfg, true)
	defer cleanup()
	t.Cleanup(func() {
		_ = unix.Unmount(filepath.Join(src, "sub"), unix.MNT_DETACH)
		_ = unix.Unmount(src, unix.MNT_DETACH)
	})

	startTask(t, h, cfg)

	// The tmpfs the task mounted is on the host, with the file it wrote.
	eventually(t, 10*time.Second, mountedAt(filepath.Join(src, "sub")))
	eventually(t, 5*time.Second, func() error {
		_, err := os.Stat(filepath.Join(src, "sub", "ok"))
		return err
	})

	must.NoError(t, h.StopTask(cfg.ID, time.Second, "SIGTERM"))
	waitExit(t, h, cfg.ID, 10*time.Second)
	// The task's mount stays (a plugin's staged volumes outlive it), so the
	// self-bind stays too until that mount is gone.
	must.NoError(t, h.DestroyTask(cfg.ID, false))
	ok, err := mounter.New().IsMountPoint(src)
	must.NoError(t, err)
	must.True(t, ok)
}

// With nothing mounted beneath it any more, the self-bind goes with the
// last task that used it.
func TestDriver_selfBindRemovedWithLastTask(t *testing.T) {
	requireRoot(t)
	h, _ := harnessDriver(t, Config{AllowPrivileged: true, PrivilegedGrants: grantAll})
	src := t.TempDir()
	cfg := realTask(t, "bidi", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "sleep 60"}, Privileged: true})
	cfg.Mounts = []*drivers.MountConfig{{TaskPath: "/bidi2", HostPath: src, PropagationMode: "bidirectional"}}
	cleanup := mkAllocDir(t, h, cfg, true)
	defer cleanup()
	t.Cleanup(func() { _ = unix.Unmount(src, unix.MNT_DETACH) })

	startTask(t, h, cfg)
	eventually(t, 5*time.Second, mountedAt(src))
	must.NoError(t, h.DestroyTask(cfg.ID, true))
	ok, err := mounter.New().IsMountPoint(src)
	must.NoError(t, err)
	must.False(t, ok)
}

// buildFixture builds the project's CSI plugin fixture into a temp dir.
func buildFixture(t testing.TB) string {
	t.Helper()
	out := filepath.Join(shortTempDir(t), "csi-fixture")
	cmd := exec.Command("go", "build", "-o", out, "github.com/nomad-driver-csi/nomad-driver-csi/e2e/csiplugin")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	b, err := cmd.CombinedOutput()
	must.NoError(t, err, must.Sprintf("go build: %s", b))
	return out
}

// mountsUnder lists the mount points at or below dir.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	mps, err := mounter.New().List()
	must.NoError(t, err)
	var out []string
	for _, mp := range mps {
		if mounter.PathWithin(mp.Path, dir) {
			out = append(out, mp.Path)
		}
	}
	return out
}

// unmountUnder removes every mount at or below dir, deepest first, and
// detaches the fixture's loop devices (test cleanup after a failure).
func unmountUnder(dir string) {
	for i := 0; i < 5; i++ {
		mps, _ := mounter.New().List()
		any := false
		for j := len(mps) - 1; j >= 0; j-- {
			if mounter.PathWithin(mps[j].Path, dir) {
				any = true
				_ = unix.Unmount(mps[j].Path, unix.MNT_DETACH)
			}
		}
		if !any {
			break
		}
	}
	out, _ := exec.Command("losetup", "-j", "x", "-a").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, dir) {
			_ = exec.Command("losetup", "-d", strings.TrimSuffix(strings.Fields(line)[0], ":")).Run()
		}
	}
}

// The whole chain through Nomad's harness: the fixture plugin as a
// privileged monolith task, fingerprinted healthy; a task whose volume is
// created, staged, published, written to and torn down; a second task that
// reads the data back read-only; and nothing left mounted under root_dir.
func TestDriver_pluginTaskAndVolumeLifecycle(t *testing.T) {
	requireRoot(t)
	fixture := buildFixture(t)
	root := shortTempDir(t)
	state := shortTempDir(t)
	work := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })

	h, d := harnessDriver(t, Config{RootDir: root, AllowPrivileged: true, PrivilegedGrants: grantAll})
	plugin := fixturePluginTask(t, fixture, state)
	cleanupPlugin := mkAllocDir(t, h, plugin, true)
	defer cleanupPlugin()
	startTask(t, h, plugin)
	defer func() {
		_ = h.StopTask(plugin.ID, 5*time.Second, "SIGTERM")
		_ = h.DestroyTask(plugin.ID, true)
	}()

	eventually(t, 15*time.Second, func() error {
		st, ok := d.prober.Get("fixture")
		if !ok || !st.Healthy {
			return fmt.Errorf("plugin not healthy yet: %+v", st.HealthDescription)
		}
		return nil
	})
	st, _ := d.prober.Get("fixture")
	must.Eq(t, "test-node", st.Node.NodeID)
	must.Eq(t, "fixture.csi.nomad-driver-csi", st.Info.Name)

	dest := filepath.Join(work, "data")
	writer := realTask(t, "writer", TaskConfig{
		Command: "/bin/sh",
		Args:    []string{"-c", `echo written-by-task > "$DEST/file" && grep -q " $DEST " /proc/self/mountinfo`},
		Volumes: map[string]VolumeConfig{"data": {
			PluginID:    "fixture",
			VolumeID:    "vol-1",
			Destination: dest,
			AccessMode:  "single-node-writer",
			Create:      &VolumeCreateBlock{CapacityMin: "16MiB", Parameters: map[string]string{"type": "dir"}},
			Secrets:     map[string]string{"token": "canary-secret-value"},
		}},
	})
	writer.Env = map[string]string{"DEST": dest}
	cleanupWriter := mkAllocDir(t, h, writer, true)
	defer cleanupWriter()
	startTask(t, h, writer)
	res := waitExit(t, h, writer.ID, 20*time.Second)
	must.Eq(t, 0, res.ExitCode)
	must.NoError(t, h.DestroyTask(writer.ID, false))
	must.SliceEmpty(t, mountsUnder(t, filepath.Join(root, "mnt", "publish")))

	reader := realTask(t, "reader", TaskConfig{
		Command: "/bin/sh",
		Args:    []string{"-c", `cat "$DEST/file" && ! touch "$DEST/other" 2>/dev/null`},
		Volumes: map[string]VolumeConfig{"data": {
			PluginID:    "fixture",
			VolumeID:    "vol-1",
			Destination: dest,
			ReadOnly:    true,
			AccessMode:  "single-node-reader-only",
		}},
	})
	reader.Env = map[string]string{"DEST": dest}
	cleanupReader := mkAllocDir(t, h, reader, true)
	defer cleanupReader()
	startTask(t, h, reader)
	res = waitExit(t, h, reader.ID, 20*time.Second)
	must.Eq(t, 0, res.ExitCode)
	eventually(t, 5*time.Second, fileHas(filepath.Join(reader.TaskDir().LogDir, "reader.stdout.0"), "written-by-task\n"))
	must.NoError(t, h.DestroyTask(reader.ID, false))

	// An unknown plugin fails the task once the wait for it is over,
	// naming the plugin.
	bad := realTask(t, "bad", TaskConfig{
		Command: "/bin/true",
		Volumes: map[string]VolumeConfig{"data": {PluginID: "nope", VolumeID: "v", Destination: dest, AccessMode: "single-node-writer"}},
	})
	cleanupBad := mkAllocDir(t, h, bad, true)
	defer cleanupBad()
	_, _, err := h.StartTask(bad)
	must.ErrorContains(t, err, `CSI plugin "nope"`)

	// With the plugin gone too, nothing is mounted under root_dir.
	must.NoError(t, h.StopTask(plugin.ID, 5*time.Second, "SIGTERM"))
	waitExit(t, h, plugin.ID, 10*time.Second)
	must.NoError(t, h.DestroyTask(plugin.ID, false))
	must.SliceEmpty(t, mountsUnder(t, root))
}

// procNSpid reads the NSpid line of a host process: its number in each PID
// namespace it is in, the host's first.
func procNSpid(t *testing.T, pid int) []int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	must.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			var out []int
			for _, f := range strings.Fields(v) {
				n, err := strconv.Atoi(f)
				must.NoError(t, err)
				out = append(out, n)
			}
			return out
		}
	}
	t.Fatalf("no NSpid in /proc/%d/status", pid)
	return nil
}

// fixturePluginTask is the e2e fixture plugin as a privileged monolith
// plugin task "fixture" keeping its volumes in state.
func fixturePluginTask(t *testing.T, fixture, state string) *drivers.TaskConfig {
	t.Helper()
	return realTask(t, "plugin", TaskConfig{
		Command:    fixture,
		Args:       []string{"--state-dir", state, "--node-id", "test-node"},
		Privileged: true,
		CSIPlugin:  &PluginTaskConfig{ID: "fixture", Type: "monolith", MountDir: "/csi"},
	})
}
