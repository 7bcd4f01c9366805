package executor

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

var (
	shimOnce sync.Once
	shimPath string
	shimErr  error
)

// shimBuildTags are the build tags of this test binary that the shim must
// share (see shimtags_nocontrollers_test.go).
var shimBuildTags = ""

// staticShim builds the supervisor shim as make dev does (static, no cgo)
// once per test binary: an image task's seccomp stage is the supervisor's
// binary run inside the image, which has no dynamic loader of the host's.
// The test binary itself is dynamically linked.
func staticShim(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("test needs the go command to build the static supervisor shim")
	}
	shimOnce.Do(func() {
		dir, err := os.MkdirTemp("", "executor-test-shim-")
		if err != nil {
			shimErr = err
			return
		}
		shimPath = filepath.Join(dir, "shim")
		_, self, _, _ := runtime.Caller(0)
		cmd := exec.Command(goBin, "build", "-tags", shimBuildTags, "-o", shimPath, "./shim")
		cmd.Dir = filepath.Dir(self)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			shimErr = err
			t.Logf("go build: %s", out)
		}
	})
	must.NoError(t, shimErr)
	return shimPath
}

// removeStaticShim removes what staticShim built (TestMain, once the
// tests are done).
func removeStaticShim() {
	if shimPath != "" {
		_ = os.RemoveAll(filepath.Dir(shimPath))
	}
}

// busyboxImage makes a test image's layers under dir, lowest first: a base
// with the host's static busybox as /bin/* and /lib a symlink to usr/lib
// (as merged-/usr images have it), /var/run a symlink to /run, an
// /etc/passwd, a device node the image carries (/imgnull, 1:3) and a file
// the next layer deletes; a top layer with a whiteout for it and a
// changed file.
func busyboxImage(t *testing.T, dir string) []string {
	t.Helper()
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("test needs a static /bin/busybox (Debian's busybox-static) to make an image")
	}
	base, top := filepath.Join(dir, "base"), filepath.Join(dir, "top")
	for _, d := range []string{"bin", "etc", "usr/lib", "run", "var", "tmp"} {
		must.NoError(t, os.MkdirAll(filepath.Join(base, d), 0o755))
	}
	must.NoError(t, os.Chmod(filepath.Join(base, "tmp"), 0o1777))
	bb, err := os.ReadFile("/bin/busybox")
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(filepath.Join(base, "bin/busybox"), bb, 0o755))
	out, err := exec.Command("/bin/busybox", "--list").Output()
	must.NoError(t, err)
	for _, applet := range strings.Fields(string(out)) {
		if applet != "busybox" {
			must.NoError(t, os.Symlink("busybox", filepath.Join(base, "bin", applet)))
		}
	}
	must.NoError(t, os.Symlink("usr/lib", filepath.Join(base, "lib")))
	must.NoError(t, os.Symlink("/run", filepath.Join(base, "var/run")))
	must.NoError(t, os.WriteFile(filepath.Join(base, "etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"), 0o644))
	must.NoError(t, os.WriteFile(filepath.Join(base, "etc/name"), []byte("base\n"), 0o644))
	must.NoError(t, os.WriteFile(filepath.Join(base, "gone"), []byte("x\n"), 0o644))
	must.NoError(t, unix.Mknod(filepath.Join(base, "imgnull"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must.NoError(t, os.MkdirAll(filepath.Join(top, "etc"), 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(top, "etc/name"), []byte("top\n"), 0o644))
	must.NoError(t, unix.Mknod(filepath.Join(top, "gone"), unix.S_IFCHR, 0))
	return []string{base, top}
}

// imageSpec is a test task whose root is busyboxImage, isolated as a task
// that is not privileged is (privileged: with the host's view), run by the
// static shim.
func imageSpec(t *testing.T, script string, privileged bool) *testTask {
	t.Helper()
	layers := busyboxImage(t, t.TempDir())
	tt := newTestSpec(t, "/bin/sh", "-c", script)
	tt.spec.Env = []string{"PATH=/bin", "SECRET_TOKEN=hunter2"}
	tt.spec.Dir = "/"
	tt.spec.Supervisor = staticShim(t)
	tt.spec.Image = &ImageRoot{Layers: layers, Ref: "test/busybox:1"}
	if privileged {
		tt.spec.Privileged = true
		return tt
	}
	tt.spec.Capabilities = DefaultCapabilities
	tt.spec.Isolation = &Isolation{PrivatePID: true, PrivateIPC: true}
	return tt
}

// imageProbe prints what a task sees of its image root.
const imageProbe = `
echo "root=$(ls / | tr '\n' ' ')"
echo "name=$(cat /etc/name)"
if [ -e /gone ]; then echo gone=visible; else echo gone=hidden; fi
if echo hi > /written 2>/dev/null; then echo top=writable; else echo top=read-only; fi
if echo hi > /etc/name 2>/dev/null; then echo etc=writable; else echo etc=read-only; fi
echo "rootopts=$(awk '$5 == "/" {print $6}' /proc/self/mountinfo | tail -1)"
echo "rootfs=$(awk '$5 == "/" {for (i = 7; i <= NF; i++) if ($i == "-") print $(i+1)}' /proc/self/mountinfo | tail -1)"
if head -c1 /imgnull >/dev/null 2>&1 && echo x > /imgnull 2>/dev/null; then echo imgdev=opened; else echo imgdev=refused; fi
echo "dev=$(ls /dev | wc -l)"
echo "pid1=$(cat /proc/1/comm 2>/dev/null)"
echo "nnp=$(grep NoNewPrivs /proc/self/status | tr -d ' \t' | cut -d: -f2)"
echo "capeff=$(grep CapEff /proc/self/status | tr -d ' \t' | cut -d: -f2)"
echo "ids=$(id -u):$(id -g)"
if touch /sys/ncsi-x 2>/dev/null; then echo sys=writable; else echo sys=read-only; fi
echo "keys=$(cat /proc/keys 2>/dev/null | wc -c)"
if [ -d /lib/modules ]; then echo modules=present; else echo modules=absent; fi
if touch /lib/modules/ncsi-x 2>/dev/null; then echo moduleswrite=writable; else echo moduleswrite=read-only; fi
if touch /tmp/x 2>/dev/null; then echo tmp=writable; else echo tmp=read-only; fi
echo "secret=$SECRET_TOKEN"
`

// A task that is not privileged, with an image as its root: the image's
// files as its layers make them (the top layer's file, a whiteout hiding
// the base's), its writes in its own writable layer in the state
// directory (never in a layer), and every isolation layer as with
// chroot_env: nosuid and nodev on the image (a device node the image
// carries opens nothing), the minimal /dev, its own /proc with keys
// masked, a read-only /sys, no_new_privs, the default capabilities, and
// the user the driver resolved.
func TestImageRoot_Isolated_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := imageSpec(t, imageProbe, false)
	tt.spec.User = "nobody"
	tt.spec.Credential = &Credential{UID: 65534, GID: 65534}
	// A working directory the image lacks is made, as Docker makes it.
	tt.spec.Dir = "/srv/work"
	tt.spec.Args[1] = "echo cwd=$(pwd)\n" + tt.spec.Args[1]
	// Nothing of the host: no /lib/modules in an isolated task.
	got := runLines(t, tt)
	for _, want := range []string{"bin", "etc", "usr", "lib", "var", "dev", "proc", "sys", "tmp", "imgnull"} {
		must.StrContains(t, " "+got["root"]+" ", " "+want+" ")
	}
	must.Eq(t, "/srv/work", got["cwd"])
	must.Eq(t, "top", got["name"])
	must.Eq(t, "hidden", got["gone"])
	// nobody may not write the root directory (root's, 0755), but the
	// layer is writable: see the root task below.
	must.Eq(t, "read-only", got["etc"])
	must.StrContains(t, got["rootopts"], "nosuid")
	must.StrContains(t, got["rootopts"], "nodev")
	must.Eq(t, "overlay", got["rootfs"])
	must.Eq(t, "refused", got["imgdev"], must.Sprint("a device node of the image opened in an isolated task"))
	must.Eq(t, "1", got["nnp"])
	must.Eq(t, "0000000000000000", got["capeff"])
	must.Eq(t, "65534:65534", got["ids"])
	must.Eq(t, "read-only", got["sys"])
	must.Eq(t, "0", got["keys"])
	must.Eq(t, "absent", got["modules"])
	must.Eq(t, "writable", got["tmp"])
	must.Eq(t, "hunter2", got["secret"])
	dev, err := strconv.Atoi(got["dev"])
	must.NoError(t, err)
	must.Between(t, 1, dev, 14)
}

// A root task that is not privileged writes its image root: into its own
// writable layer in its state directory, never into a layer, which every
// task of the image shares.
func TestImageRoot_Writable_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := imageSpec(t, imageProbe, false)
	got := runLines(t, tt)
	must.Eq(t, "writable", got["top"])
	must.Eq(t, "writable", got["etc"])
	must.Eq(t, "0:0", got["ids"])
	must.Eq(t, "refused", got["imgdev"], must.Sprint("nodev keeps even a root task from the image's device node"))
	b, err := os.ReadFile(filepath.Join(tt.spec.StateDir, "upper", "written"))
	must.NoError(t, err)
	must.Eq(t, "hi\n", string(b))
	for _, l := range tt.spec.Image.Layers {
		_, err := os.Stat(filepath.Join(l, "written"))
		must.True(t, os.IsNotExist(err), must.Sprintf("the task wrote into layer %s", l))
	}
	b, err = os.ReadFile(filepath.Join(tt.spec.Image.Layers[1], "etc/name"))
	must.NoError(t, err)
	must.Eq(t, "top\n", string(b), must.Sprint("the task changed a layer's file"))
}

// readonly_rootfs: the root is read-only and nothing of the task is
// written to disk; /tmp stays writable.
func TestImageRoot_ReadOnly_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := imageSpec(t, imageProbe, false)
	tt.spec.Image.ReadOnly = true
	got := runLines(t, tt)
	must.Eq(t, "read-only", got["top"])
	must.Eq(t, "read-only", got["etc"])
	must.StrContains(t, got["rootopts"], "ro")
	must.Eq(t, "writable", got["tmp"])
	_, err := os.Stat(filepath.Join(tt.spec.StateDir, "upper"))
	must.True(t, os.IsNotExist(err), must.Sprint("a read-only root has no writable layer on disk"))
}

// A privileged task with an image root gets what Docker's --privileged
// gives: the host's /dev, /proc (the host's PID 1) and /sys, every
// capability, the image's device nodes and setuid bits, and the host's
// /lib/modules read-only, at the image's /lib/modules (here /lib is a
// symlink to usr/lib in the image: it lands in usr/lib/modules, never on
// the host's).
func TestImageRoot_Privileged_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := imageSpec(t, imageProbe, true)
	got := runLines(t, tt)
	must.Eq(t, "top", got["name"])
	must.Eq(t, "overlay", got["rootfs"])
	must.StrNotContains(t, got["rootopts"], "nosuid")
	must.Eq(t, "opened", got["imgdev"])
	host, err := os.ReadDir("/dev")
	must.NoError(t, err)
	dev, err := strconv.Atoi(got["dev"])
	must.NoError(t, err)
	must.Eq(t, len(host), dev, must.Sprint("a privileged task sees the host's /dev"))
	comm, err := os.ReadFile("/proc/1/comm")
	must.NoError(t, err)
	must.Eq(t, strings.TrimSpace(string(comm)), got["pid1"])
	must.Eq(t, "0", got["nnp"])
	must.NotEq(t, "0000000000000000", got["capeff"])
	fi, err := os.Stat("/lib/modules")
	if err != nil || !fi.IsDir() {
		t.Log("this host has no /lib/modules to check")
		return
	}
	must.Eq(t, "present", got["modules"])
	must.Eq(t, "read-only", got["moduleswrite"])
	_, err = os.Stat(filepath.Join(tt.spec.StateDir, "upper/usr/lib/modules"))
	must.NoError(t, err, must.Sprint("the modules' mount point is in the image's /usr/lib"))
}

// An isolated image task's seccomp stage is the supervisor's binary run in
// the image: a dynamically linked one (here the test binary) is refused
// with the reason, before anything runs.
func TestImageRoot_DynamicSupervisor_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := imageSpec(t, "true", false)
	tt.spec.Supervisor = ""
	p, err := Start(hclog.NewNullLogger(), tt.spec, nil)
	if err == nil {
		_ = p.Kill()
		_ = p.Destroy()
		t.Fatal("an image task started from a dynamically linked supervisor")
	}
	must.StrContains(t, err.Error(), "dynamically linked")
}

// The task's mounts land in the image: a bind at a target through the
// image's own symlink (/var/run -> /run) lands at /run in the task's root,
// never at the host's /run; Nomad's directories are where they are.
func TestImageRoot_Mounts_Root(t *testing.T) {
	requireTaskRoot(t)
	vol, alloc := t.TempDir(), t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(vol, "v"), []byte("vol\n"), 0o644))
	must.NoError(t, os.WriteFile(filepath.Join(alloc, "a"), []byte("alloc\n"), 0o644))
	hostMarker := "/run/ncsi-image-" + strconv.Itoa(os.Getpid())
	tt := imageSpec(t, `
echo "v=$(cat /run/`+filepath.Base(hostMarker)+`/v)"
echo "a=$(cat /alloc/a)"
`, false)
	tt.spec.LateMounts = []Mount{{Target: "/alloc"}, {Target: "/var/run/" + filepath.Base(hostMarker)}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: alloc, Target: "/alloc"}, {Source: vol, Target: "/var/run/" + filepath.Base(hostMarker)}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy(); _ = os.Remove(hostMarker) })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	got := outputLines(readFile(t, tt.stdout))
	t.Log(got)
	must.Eq(t, "vol", got["v"])
	must.Eq(t, "alloc", got["a"])
	_, err = os.Lstat(hostMarker)
	must.True(t, os.IsNotExist(err), must.Sprint("a mount target through the image's absolute symlink was made on the host"))
}

// nomad alloc exec in an image task runs in the image, as the credential
// the driver resolved (never looked up again in the root, which a task can
// write: here the task rewrote the image's /etc/passwd to make nobody uid
// 0), with no_new_privs.
func TestImageRoot_Exec_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := imageSpec(t, `echo "root:x:0:0::/:/bin/sh
nobody:x:0:0::/:/bin/sh" > /etc/passwd; touch /tmp/ready; exec sleep 100`, false)
	// The task must be able to write /etc/passwd to make the attempt: as
	// root, while exec's profile stays nobody's.
	tt.spec.Credential = &Credential{}
	p := startTest(t, tt)
	p.state.Profile.User = "nobody"
	p.state.Profile.Credential = &Credential{UID: 65534, GID: 65534}
	waitFor(t, "the task to rewrite /etc/passwd", func() bool {
		var out bytes.Buffer
		code, err := p.Exec(context.Background(), ExecOptions{Command: []string{"/bin/cat", "/tmp/ready"}, Stdout: &out})
		return err == nil && code == 0
	})
	var stdout, stderr bytes.Buffer
	code, err := p.Exec(context.Background(), ExecOptions{
		Command: []string{"/bin/sh", "-c", `echo "ids=$(id -u):$(id -g) name=$(cat /etc/name) nnp=$(grep NoNewPrivs /proc/self/status | tr -d ' \t' | cut -d: -f2)"`},
		Stdout:  &stdout, Stderr: &stderr})
	must.NoError(t, err)
	must.Eq(t, 0, code, must.Sprintf("stderr: %s", stderr.String()))
	t.Log(stdout.String())
	must.StrContains(t, stdout.String(), "ids=65534:65534 ")
	must.StrContains(t, stdout.String(), "name=top")
	must.StrContains(t, stdout.String(), "nnp=1")
}

// A spare supervisor whose root was prepared ahead for chroot_env takes an
// image task: the prepared root does not serve it (the log says why), and
// the task runs in its image, not in the prepared chroot_env root.
func TestImageRoot_Spare_Root(t *testing.T) {
	requireTaskRoot(t)
	shim := staticShim(t)
	s := &Spares{}
	s.SetDir(t.TempDir(), &Isolation{ChrootEnv: DefaultChrootEnv, PrivatePID: true, PrivateIPC: true})
	t.Cleanup(s.Close)
	s.Fill(shim, hclog.NewNullLogger())
	spare := waitSpare(t, s, shim)

	tt := imageSpec(t, `echo "name=$(cat /etc/name)"; if [ -e /usr/bin/perl ]; then echo host=visible; else echo host=absent; fi`, false)
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, spare, p.State().SupervisorPID, must.Sprint("the spare supervisor serves the image task"))
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	got := outputLines(readFile(t, tt.stdout))
	must.Eq(t, "top", got["name"])
	must.Eq(t, "absent", got["host"])
	log := readFile(t, filepath.Join(tt.spec.StateDir, "supervisor.log"))
	must.StrContains(t, log, "the task's root is an image")
	must.StrContains(t, log, "root_prepared_ahead=false")
}

// A spec's image is checked before anything starts: layers must be
// absolute paths of directories, and there must be one.
func TestValidateSpec_Image(t *testing.T) {
	dir := t.TempDir()
	layer := filepath.Join(dir, "layer")
	must.NoError(t, os.Mkdir(layer, 0o755))
	file := filepath.Join(dir, "file")
	must.NoError(t, os.WriteFile(file, nil, 0o644))
	for _, tc := range []struct {
		layers []string
		err    string
	}{
		{[]string{layer}, ""},
		{nil, `image "test/x:1" has no layers`},
		{[]string{"layer"}, `layer "layer" must be an absolute path`},
		{[]string{filepath.Join(dir, "missing")}, "no such file or directory"},
		{[]string{file}, "is not a directory"},
	} {
		spec := &Spec{TaskID: "t", StateDir: dir, Command: "/bin/sh", Image: &ImageRoot{Layers: tc.layers, Ref: "test/x:1"}}
		err := validateSpec(spec)
		if tc.err == "" {
			must.NoError(t, err)
		} else {
			must.ErrorContains(t, err, tc.err)
		}
	}
}

// An image's symlink through /proc/self/root (/data -> /proc/self/root/srv)
// is resolved inside the task's root when the mount target is made, and
// nothing is done by the destination's path after that: the launching
// thread's /proc/self/root is the supervisor's root, the host's, in the
// host's mount namespace, so a path-based call made there (setting the
// volume's propagation) acted on the host's mount at /srv/sub and made it
// private. Here the host's mounts stay shared, nothing lands on the host,
// and the task sees its volume.
func TestImageRoot_ProcSelfRootSymlinkTarget_Root(t *testing.T) {
	requireTaskRoot(t)
	_, host, _ := propagationFixture(t)
	sub := filepath.Join(host, "sub")
	sharedSelfBind(t, sub)
	vol := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(vol, "v"), []byte("vol\n"), 0o644))
	tt := imageSpec(t, `echo "v=$(cat /data/sub/v)"`, false)
	must.NoError(t, os.Symlink("/proc/self/root"+host, filepath.Join(tt.spec.Image.Layers[0], "data")))
	tt.spec.LateMounts = []Mount{{Target: "/data/sub"}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: "/data/sub", NoSuid: true, NoDev: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, "vol", exitLines(t, tt, p)["v"])
	table, err := mounter.New().List()
	must.NoError(t, err)
	seen := 0
	for _, mp := range table {
		if mounter.PathWithin(mp.Path, host) {
			seen++
			must.Eq(t, "shared", mp.Propagation(), must.Sprintf("the task's start changed the propagation of the host's mount at %s", mp.Path))
		}
	}
	must.Positive(t, seen)
	_, err = os.Stat(filepath.Join(sub, "v"))
	must.True(t, os.IsNotExist(err), must.Sprintf("the volume landed on the host (%v)", err))
}
