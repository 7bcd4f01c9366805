//go:build e2e

package e2e

// The CSI tests need no Nomad agent: they check the CSI plugin fixture
// (e2e/csiplugin) with the kubernetes-csi conformance suite and with the
// gocsi client, and that the third-party mock plugins start. The binaries
// come from e2e/tools/build.sh (run here unless E2E_SKIP_BUILD is set) in
// build/csi/. Every test kills what it started by PID and unmounts and
// detaches whatever is left under its temporary directory.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

var (
	csiBuildOnce sync.Once
	csiBuildErr  error
)

// csiBin returns the path of a binary in build/csi, building them all once.
func csiBin(t *testing.T, name string) string {
	t.Helper()
	root, err := RepoRoot()
	must.NoError(t, err)
	csiBuildOnce.Do(func() {
		if os.Getenv("E2E_SKIP_BUILD") != "" {
			return
		}
		cmd := exec.Command(filepath.Join(root, "e2e", "tools", "build.sh"))
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			csiBuildErr = fmt.Errorf("e2e/tools/build.sh failed: %w\n%s", err, out)
		}
	})
	must.NoError(t, csiBuildErr)
	bin := filepath.Join(root, "build", "csi", name)
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("no %s: run e2e/tools/build.sh to build the CSI test binaries into build/csi/ (%v)", bin, err)
	}
	return bin
}

// csiTempDir makes a short directory under /tmp (unix socket paths are
// limited to 107 bytes) and cleans it up at the end of the test: unmounts,
// loop devices, then the files.
func csiTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "csi")
	must.NoError(t, err)
	t.Cleanup(func() {
		if err := UnmountUnder(dir); err != nil {
			t.Errorf("failed to unmount under %s: %v", dir, err)
		}
		for _, dev := range csiLoopsUnder(dir) {
			if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
				t.Errorf("failed to detach %s: %v: %s", dev, err, out)
			}
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("failed to remove %s: %v", dir, err)
		}
	})
	return dir
}

// csiLoopsUnder lists the loop devices backed by files under dir: those
// `losetup -j` finds for the images still there, and those whose image was
// deleted while attached (sysfs marks them "(deleted)").
func csiLoopsUnder(dir string) []string {
	seen := map[string]bool{}
	imgs, _ := filepath.Glob(filepath.Join(dir, "*", "volumes", "*.img"))
	for _, img := range imgs {
		out, _ := exec.Command("losetup", "--associated", img).Output()
		for _, line := range strings.Split(string(out), "\n") {
			if dev, _, ok := strings.Cut(line, ":"); ok && strings.HasPrefix(dev, "/dev/loop") {
				seen[dev] = true
			}
		}
	}
	backing, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, b := range backing {
		f, err := os.ReadFile(b)
		if err == nil && strings.HasPrefix(string(f), dir+"/") {
			seen["/dev/"+filepath.Base(filepath.Dir(filepath.Dir(b)))] = true
		}
	}
	var devs []string
	for d := range seen {
		devs = append(devs, d)
	}
	return devs
}

// csiFixture is one running csi-fixture.
type csiFixture struct {
	dir      string // the test's temporary directory
	endpoint string // unix:///.../csi.sock
	stateDir string
	calls    string // the --log-calls file
	logPath  string
	pid      int
	exited   chan error
	stopOnce sync.Once
}

// csiStartFixture starts the fixture on a socket in a fresh temporary
// directory and stops it by PID when the test ends.
func csiStartFixture(t *testing.T, args ...string) *csiFixture {
	t.Helper()
	return csiStartFixtureIn(t, csiTempDir(t), args...)
}

// csiStartFixtureIn starts the fixture with its socket, state and logs in
// dir, which may hold the state of an earlier run.
func csiStartFixtureIn(t *testing.T, dir string, args ...string) *csiFixture {
	t.Helper()
	f := &csiFixture{
		dir:      dir,
		endpoint: "unix://" + filepath.Join(dir, "csi.sock"),
		stateDir: filepath.Join(dir, "state"),
		calls:    filepath.Join(dir, "calls.log"),
		logPath:  filepath.Join(dir, "fixture.log"),
		exited:   make(chan error, 1),
	}
	logf, err := os.OpenFile(f.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	must.NoError(t, err)
	defer logf.Close()
	cmd := exec.Command(csiBin(t, "csi-fixture"), append([]string{
		"--endpoint", f.endpoint, "--state-dir", f.stateDir, "--node-id", "e2e-node", "--log-calls", f.calls,
	}, args...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	must.NoError(t, cmd.Start())
	f.pid = cmd.Process.Pid
	go func() { f.exited <- cmd.Wait() }()
	t.Cleanup(func() {
		f.stop(syscall.SIGTERM)
		if t.Failed() {
			t.Logf("fixture log (%s):\n%s", f.logPath, csiTail(f.logPath, 40))
		}
	})
	sock := strings.TrimPrefix(f.endpoint, "unix://")
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return f
		}
		select {
		case err := <-f.exited:
			t.Fatalf("csi-fixture exited before serving: %v\n%s", err, csiTail(f.logPath, 20))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("csi-fixture did not listen on %s within 10s\n%s", sock, csiTail(f.logPath, 20))
		}
	}
}

// stop signals the fixture by PID and waits for it, killing it after 5s.
func (f *csiFixture) stop(sig syscall.Signal) {
	f.stopOnce.Do(func() {
		_ = syscall.Kill(f.pid, sig)
		select {
		case <-f.exited:
		case <-time.After(5 * time.Second):
			_ = syscall.Kill(f.pid, syscall.SIGKILL)
			<-f.exited
		}
	})
}

// callCount counts the RPCs of one method in the fixture's call log.
func (f *csiFixture) callCount(t *testing.T, method string) int {
	t.Helper()
	b, err := os.ReadFile(f.calls)
	must.NoError(t, err)
	return strings.Count("\n"+string(b), "\n"+method+" ")
}

func csiTail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// csiRun runs a command with a deadline and returns its combined output.
func csiRun(timeout time.Duration, env []string, bin string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

var csiSanitySummary = regexp.MustCompile(`(\d+) Passed \| (\d+) Failed \| (\d+) Pending \| (\d+) Skipped`)

func TestCSISanity(t *testing.T) {
	cases := []struct {
		name       string
		fixture    []string // extra fixture flags
		params     string   // --csi.testvolumeparameters YAML
		sanity     []string // extra csi-sanity flags
		minPassed  int
		wantCalled []string
	}{
		{name: "dir", minPassed: 45,
			wantCalled: []string{"NodeStageVolume", "NodePublishVolume", "NodeGetVolumeStats", "NodeExpandVolume"}},
		{name: "ext4", params: "type: ext4\n", sanity: []string{"--csi.testvolumesize", "67108864"}, minPassed: 45,
			wantCalled: []string{"NodeStageVolume", "NodePublishVolume", "ControllerExpandVolume", "NodeExpandVolume"}},
		{name: "ext4-block", params: "type: ext4\n", sanity: []string{"--csi.testvolumesize", "67108864", "--csi.testvolumeaccesstype", "block"}, minPassed: 45,
			wantCalled: []string{"NodeStageVolume", "NodePublishVolume"}},
		// Served through FUSE by the fixture process (fuse.go).
		{name: "fuse", params: "type: fuse\n", minPassed: 45,
			wantCalled: []string{"NodeStageVolume", "NodePublishVolume", "NodeGetVolumeStats", "NodeUnstageVolume"}},
		{name: "controller-publish-dir", fixture: []string{"--controller-publish", "--max-volumes", "3", "--topology", "zone=e2e"},
			sanity: []string{"--csi.testnodevolumeattachlimit"}, minPassed: 55,
			wantCalled: []string{"ControllerPublishVolume", "ControllerUnpublishVolume", "NodeStageVolume"}},
		{name: "controller-publish-ext4", fixture: []string{"--controller-publish", "--max-volumes", "3"}, params: "type: ext4\n",
			sanity: []string{"--csi.testnodevolumeattachlimit", "--csi.testvolumesize", "67108864"}, minPassed: 55,
			wantCalled: []string{"ControllerPublishVolume", "ControllerUnpublishVolume", "NodeStageVolume"}},
	}
	sanity := csiBin(t, "csi-sanity")
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := csiStartFixture(t, tc.fixture...)
			args := []string{
				"--csi.endpoint", f.endpoint,
				"--csi.stagingdir", filepath.Join(f.dir, "staging"),
				"--csi.mountdir", filepath.Join(f.dir, "mount"),
				"-ginkgo.no-color",
			}
			if tc.params != "" {
				p := filepath.Join(f.dir, "params.yaml")
				must.NoError(t, os.WriteFile(p, []byte(tc.params), 0o644))
				args = append(args, "--csi.testvolumeparameters", p)
			}
			start := time.Now()
			out, err := csiRun(5*time.Minute, nil, sanity, append(args, tc.sanity...)...)
			m := csiSanitySummary.FindStringSubmatch(out)
			if err != nil || m == nil {
				t.Fatalf("csi-sanity failed: %v\n%s", err, out)
			}
			passed, _ := strconv.Atoi(m[1])
			failed, _ := strconv.Atoi(m[2])
			t.Logf("csi-sanity %s in %s: %s", tc.name, time.Since(start).Round(time.Millisecond), m[0])
			must.Zero(t, failed, must.Sprintf("csi-sanity output:\n%s", out))
			must.GreaterEq(t, tc.minPassed, passed, must.Sprintf("too few specs ran:\n%s", out))
			for _, method := range tc.wantCalled {
				must.Positive(t, f.callCount(t, method), must.Sprintf("no %s in %s", method, f.calls))
			}

			// csi-sanity deletes what it made; the fixture must have undone
			// every mount, loop device and volume by now.
			mounts, err := MountsUnder(f.dir)
			must.NoError(t, err)
			must.SliceEmpty(t, mounts)
			must.SliceEmpty(t, csiLoopsUnder(f.dir))
			left, _ := filepath.Glob(filepath.Join(f.stateDir, "volumes", "*"))
			must.SliceEmpty(t, left, must.Sprint("volumes left in the state dir"))
		})
	}
}

// TestCSIMocksAnswerPluginInfo starts gocsi's mock plugin and csi-test's
// mock driver, which the driver's tests use as stand-ins, and asks each for
// its name with csc.
func TestCSIMocksAnswerPluginInfo(t *testing.T) {
	csc := csiBin(t, "csc")
	for _, mock := range []struct{ bin, want string }{
		{"gocsi-mock", "mock.gocsi.rexray.com"},
		{"csi-mock-driver", "io.kubernetes.storage.mock"},
	} {
		t.Run(mock.bin, func(t *testing.T) {
			dir := csiTempDir(t)
			endpoint := "unix://" + filepath.Join(dir, "csi.sock")
			cmd := exec.Command(csiBin(t, mock.bin))
			cmd.Env = append(os.Environ(), "CSI_ENDPOINT="+endpoint)
			var log bytes.Buffer
			cmd.Stdout, cmd.Stderr = &log, &log
			must.NoError(t, cmd.Start())
			t.Cleanup(func() {
				_ = syscall.Kill(cmd.Process.Pid, syscall.SIGTERM)
				done := make(chan struct{})
				go func() { _ = cmd.Wait(); close(done) }()
				select {
				case <-done:
				case <-time.After(5 * time.Second):
					_ = syscall.Kill(cmd.Process.Pid, syscall.SIGKILL)
					<-done
				}
			})
			var out string
			var err error
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
				if out, err = csiRun(5*time.Second, nil, csc, "identity", "plugin-info", "--endpoint", endpoint); err == nil {
					break
				}
			}
			must.NoError(t, err, must.Sprintf("csc: %s\nmock log:\n%s", out, log.String()))
			t.Logf("%s plugin-info: %s", mock.bin, strings.TrimSpace(out))
			must.StrContains(t, out, `"`+mock.want+`"`)
		})
	}
}

// TestCSIFixtureTestKnobs checks --hang, --fail-once and --log-calls, which
// the driver's tests rely on for deadlines, retries and call counts.
func TestCSIFixtureTestKnobs(t *testing.T) {
	csc := csiBin(t, "csc")
	f := csiStartFixture(t, "--hang", "Probe", "--fail-once", "GetPluginInfo=Unavailable", "--name", "knobs.csi.e2e")

	start := time.Now()
	out, err := csiRun(30*time.Second, nil, csc, "identity", "probe", "--endpoint", f.endpoint, "--timeout", "1s")
	took := time.Since(start)
	// csc reports either its own deadline or the server's answer to the
	// cancellation, whichever wins the race.
	must.Error(t, err, must.Sprintf("a hung Probe answered: %s", out))
	must.GreaterEq(t, time.Second, took, must.Sprintf("Probe returned before the client's 1s deadline: %s", out))
	must.Less(t, 10*time.Second, took)
	must.StrContains(t, csiTail(f.logPath, 10), "hanging method=Probe")

	out, err = csiRun(10*time.Second, nil, csc, "identity", "plugin-info", "--endpoint", f.endpoint)
	must.Error(t, err)
	must.StrContains(t, out, "Unavailable")
	out, err = csiRun(10*time.Second, nil, csc, "identity", "plugin-info", "--endpoint", f.endpoint)
	must.NoError(t, err, must.Sprintf("second plugin-info: %s", out))
	must.StrContains(t, out, `"knobs.csi.e2e"`)

	must.Eq(t, 1, f.callCount(t, "Probe"))
	must.Eq(t, 2, f.callCount(t, "GetPluginInfo"))
}

// TestCSIFixtureLifecycle drives an ext4 volume through its whole life with
// gocsi's csc client, checking the real effects: data written through one
// target is read through a read-only one that refuses writes, survives
// unstaging, and the filesystem grows on expansion.
func TestCSIFixtureLifecycle(t *testing.T) {
	csc := csiBin(t, "csc")
	f := csiStartFixture(t)
	run := func(args ...string) string {
		t.Helper()
		out, err := csiRun(time.Minute, nil, csc, append(args, "--endpoint", f.endpoint)...)
		must.NoError(t, err, must.Sprintf("csc %s: %s", strings.Join(args, " "), out))
		return strings.TrimSpace(out)
	}
	capability := "SINGLE_NODE_WRITER,mount,ext4,noexec"
	stg, rw, ro := filepath.Join(f.dir, "stg"), filepath.Join(f.dir, "rw"), filepath.Join(f.dir, "ro")
	must.NoError(t, os.Mkdir(stg, 0o750))

	out := run("controller", "create-volume", "--params", "type=ext4", "--req-bytes", strconv.Itoa(32<<20), "--cap", capability, "data")
	id := strings.Trim(strings.Fields(out)[0], `"`)
	must.StrHasPrefix(t, "vol-", id)

	stageAndPublish := func() {
		run("node", "stage", "--staging-target-path", stg, "--cap", capability, id)
		run("node", "publish", "--staging-target-path", stg, "--target-path", rw, "--cap", capability, id)
		run("node", "publish", "--staging-target-path", stg, "--target-path", ro, "--read-only", "--cap", capability, id)
	}
	unpublishAndUnstage := func() {
		run("node", "unpublish", "--target-path", rw, id)
		run("node", "unpublish", "--target-path", ro, id)
		run("node", "unstage", "--staging-target-path", stg, id)
	}

	stageAndPublish()
	must.NoError(t, os.WriteFile(filepath.Join(rw, "hello"), []byte("csi"), 0o644))
	b, err := os.ReadFile(filepath.Join(ro, "hello"))
	must.NoError(t, err)
	must.Eq(t, "csi", string(b))
	err = os.WriteFile(filepath.Join(ro, "nope"), nil, 0o644)
	must.True(t, errors.Is(err, unix.EROFS), must.Sprintf("writing through the read-only target: %v", err))
	for _, p := range []string{stg, rw, ro} {
		must.StrContains(t, csiMountOptions(t, p), "noexec", must.Sprintf("mount_flags at %s", p))
	}
	must.StrHasPrefix(t, "ro,", csiMountOptions(t, ro))
	must.StrHasPrefix(t, "rw,", csiMountOptions(t, rw))
	stats := run("node", "stats", id+":"+rw)
	must.StrContains(t, stats, "BYTES")

	// Expansion: the image grows on the controller, the filesystem on the node.
	before := csiFSSize(t, rw)
	run("controller", "expand-volume", "--req-bytes", strconv.Itoa(96<<20), id)
	// No --cap: csc v1.17.0's node expand-volume reads it from the wrong
	// command and panics.
	run("node", "expand-volume", "--req-bytes", strconv.Itoa(96<<20), id, rw)
	after := csiFSSize(t, rw)
	must.Greater(t, before+48<<20, after, must.Sprintf("filesystem grew from %d to %d bytes", before, after))
	b, err = os.ReadFile(filepath.Join(ro, "hello"))
	must.NoError(t, err, must.Sprint("the read-only target after expansion"))
	must.Eq(t, "csi", string(b), must.Sprint("the data after expansion"))

	unpublishAndUnstage()
	for _, p := range []string{rw, ro} {
		_, err := os.Stat(p)
		must.True(t, errors.Is(err, os.ErrNotExist), must.Sprintf("target %s left behind: %v", p, err))
	}
	must.SliceEmpty(t, csiLoopsUnder(f.dir))

	stageAndPublish()
	b, err = os.ReadFile(filepath.Join(rw, "hello"))
	must.NoError(t, err, must.Sprint("data after unstage and stage again"))
	must.Eq(t, "csi", string(b))
	unpublishAndUnstage()

	run("controller", "delete-volume", id)
	mounts, err := MountsUnder(f.dir)
	must.NoError(t, err)
	must.SliceEmpty(t, mounts)
	must.SliceEmpty(t, csiLoopsUnder(f.dir))
	_, err = os.Stat(filepath.Join(f.stateDir, "volumes", id+".img"))
	must.True(t, errors.Is(err, os.ErrNotExist), must.Sprint("image left after DeleteVolume"))
	must.Eq(t, 2, f.callCount(t, "NodeStageVolume"))
}

// TestCSIFixtureRestart kills the fixture while a volume is published and
// checks that a new one, on the same state dir, still knows the volume:
// publishing again is a no-op, and unpublish, unstage and delete undo it.
func TestCSIFixtureRestart(t *testing.T) {
	csc := csiBin(t, "csc")
	dir := csiTempDir(t)
	f := csiStartFixtureIn(t, dir)
	run := func(args ...string) string {
		t.Helper()
		out, err := csiRun(time.Minute, nil, csc, append(args, "--endpoint", f.endpoint)...)
		must.NoError(t, err, must.Sprintf("csc %s: %s", strings.Join(args, " "), out))
		return strings.TrimSpace(out)
	}
	capability := "MULTI_NODE_MULTI_WRITER,mount," // csc wants the (empty) fs type
	stg, target := filepath.Join(dir, "stg"), filepath.Join(dir, "target")
	must.NoError(t, os.Mkdir(stg, 0o750))
	id := strings.Trim(strings.Fields(run("controller", "create-volume", "--cap", capability, "shared"))[0], `"`)
	run("node", "stage", "--staging-target-path", stg, "--cap", capability, id)
	run("node", "publish", "--staging-target-path", stg, "--target-path", target, "--cap", capability, id)
	must.NoError(t, os.WriteFile(filepath.Join(target, "kept"), []byte("yes"), 0o644))

	f.stop(syscall.SIGKILL)
	f = csiStartFixtureIn(t, dir)

	run("node", "stage", "--staging-target-path", stg, "--cap", capability, id)
	run("node", "publish", "--staging-target-path", stg, "--target-path", target, "--cap", capability, id)
	mounts, err := MountsUnder(dir)
	must.NoError(t, err)
	must.Eq(t, []string{target, stg}, mounts, must.Sprint("publishing again after the restart must not mount again"))
	b, err := os.ReadFile(filepath.Join(target, "kept"))
	must.NoError(t, err)
	must.Eq(t, "yes", string(b))

	run("node", "unpublish", "--target-path", target, id)
	run("node", "unstage", "--staging-target-path", stg, id)
	run("controller", "delete-volume", id)
	mounts, err = MountsUnder(dir)
	must.NoError(t, err)
	must.SliceEmpty(t, mounts)
	_, err = os.Stat(filepath.Join(f.stateDir, "volumes", id))
	must.True(t, errors.Is(err, os.ErrNotExist), must.Sprint("volume directory left after DeleteVolume"))
}

func csiFSSize(t *testing.T, path string) int64 {
	t.Helper()
	var fs unix.Statfs_t
	must.NoError(t, unix.Statfs(path, &fs))
	return int64(fs.Blocks) * fs.Bsize
}

// csiMountOptions returns the per-mount options of the mount at path
// (the topmost one) from /proc/self/mountinfo, or "" when none.
func csiMountOptions(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	must.NoError(t, err)
	opts := ""
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 5 && f[4] == path {
			opts = f[5]
		}
	}
	return opts
}
