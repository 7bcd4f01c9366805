//go:build linux && (amd64 || arm64)

package supervisor

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/shimtest"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// stageProbeEnv, set to 1 in its environment, makes this test binary the
// command a stage execs: stageProbe instead of the tests.
const stageProbeEnv = "NCSI_STAGE_PROBE"

func TestMain(m *testing.M) {
	// Started as a seccomp stage (TestGoStage_Root): the Go stage, as
	// the test binary runs it for the executor's tests and the shim when
	// its entry point cannot.
	if len(os.Args) > 1 && os.Args[1] == wire.StageSeccomp {
		RunReexec()
	}
	if os.Getenv(stageProbeEnv) == "1" {
		stageProbe()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// stageProbe prints, as "name=value" lines, the number of seccomp filters
// it runs under and what the kernel answers it for calls that the task's
// filter or the user namespace rules refuse, each made so that it fails
// harmlessly without them too, with another errno:
//
//	keyctl(9999)               EPERM (filter), else ENOTSUP
//	bpf(9999, NULL, 0)         EPERM (filter), else EINVAL (root)
//	io_uring_setup(0, NULL)    ENOSYS (filter), else EINVAL or EPERM (its sysctl)
//	setns(-1, 0)               EPERM (rules), else EBADF
//	clone3(NULL, 0)            ENOSYS (rules), else EINVAL
//	unshare(CLONE_NEWUSER)     EPERM (rules), else EINVAL (a Go process has threads)
//	unshare(CLONE_NEWNS)       allowed by the rules: EPERM without SYS_ADMIN, else ok
//	getpid                     ok
func stageProbe() {
	status, _ := os.ReadFile("/proc/self/status")
	filters := "?"
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "Seccomp_filters:"); ok {
			filters = strings.TrimSpace(v)
		}
	}
	fmt.Printf("filters=%s\n", filters)
	answer := func(_, _ uintptr, e unix.Errno) string {
		if e == 0 {
			return "ok"
		}
		return unix.ErrnoName(e)
	}
	calls := []struct {
		name    string
		nr      uintptr
		a, b, c uintptr
	}{
		{"keyctl", unix.SYS_KEYCTL, 9999, 0, 0},
		{"bpf", unix.SYS_BPF, 9999, 0, 0},
		{"io_uring_setup", unix.SYS_IO_URING_SETUP, 0, 0, 0},
		{"setns", unix.SYS_SETNS, ^uintptr(0), 0, 0},
		{"clone3", unix.SYS_CLONE3, 0, 0, 0},
		{"unshare_user", unix.SYS_UNSHARE, unix.CLONE_NEWUSER, 0, 0},
		{"unshare_mount", unix.SYS_UNSHARE, unix.CLONE_NEWNS, 0, 0},
		{"getpid", unix.SYS_GETPID, 0, 0, 0},
	}
	// unshare applies to the calling thread alone: keep the probe on one.
	runtime.LockOSThread()
	for _, c := range calls {
		fmt.Printf("%s=%s\n", c.name, answer(unix.RawSyscall(c.nr, c.a, c.b, c.c)))
	}
}

// probeBinary is this test binary, copied into a directory every user
// may search, for the stage to exec as stageProbe.
func probeBinary(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	must.NoError(t, err)
	b, err := os.ReadFile(self)
	must.NoError(t, err)
	dir, err := os.MkdirTemp("", "stage-probe-")
	must.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	must.NoError(t, os.Chmod(dir, 0o755))
	p := filepath.Join(dir, "probe")
	must.NoError(t, os.WriteFile(p, b, 0o755))
	return p
}

type stageRun struct {
	msg    string // what the stage wrote on its error pipe
	stdout string
	code   int
}

// goAhead is what a test sends the stage on its go-ahead socket: msg with
// the descriptors of stdin, stdout and stderr (the first fds of them when
// fds is not 0, and /dev/null again for any past three), or nothing at
// all (EOF) when nil.
type goAhead struct {
	msg []byte
	fds int
}

// goAheadFor is the go-ahead the supervisor sends.
func goAheadFor(dir, path string) *goAhead {
	return &goAhead{msg: []byte(dir + "\x00" + path + "\x00")}
}

// runEntryStage runs shim (under wrap, an emulator, when set) with argv,
// as the supervisor starts the seccomp stage: with file as its memory
// file, from a thread with no_new_privs, as cred (nil: this process's
// user, root with every capability), stdio /dev/null until go hands over
// the test's.
func runEntryStage(t *testing.T, wrap, shim string, argv []string, file []byte, cred *syscall.Credential, go_ *goAhead) stageRun {
	t.Helper()
	exe, err := os.Open(shim)
	must.NoError(t, err)
	defer exe.Close()
	r, w, err := os.Pipe()
	must.NoError(t, err)
	defer r.Close()
	fd, err := unix.MemfdCreate("stage-test", unix.MFD_CLOEXEC)
	must.NoError(t, err)
	mem := os.NewFile(uintptr(fd), "stage-test")
	defer mem.Close()
	_, err = mem.Write(file)
	must.NoError(t, err)
	socks, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	must.NoError(t, err)
	sock := os.NewFile(uintptr(socks[0]), "go-ahead")
	defer sock.Close()
	peer := os.NewFile(uintptr(socks[1]), "go-ahead-peer")
	outR, outW, err := os.Pipe()
	must.NoError(t, err)
	defer outR.Close()
	devNull, err := os.Open(os.DevNull)
	must.NoError(t, err)
	defer devNull.Close()

	cmd := &exec.Cmd{Path: shim, Args: argv, Env: []string{},
		ExtraFiles: []*os.File{exe, w, mem, peer}, SysProcAttr: &syscall.SysProcAttr{Credential: cred}}
	if wrap != "" {
		cmd.Path, cmd.Args = wrap, append([]string{wrap, shim}, argv[1:]...)
	}
	started := make(chan error, 1)
	go func() {
		// Never unlocked: no_new_privs stays with this thread, which the
		// runtime ends with the goroutine.
		runtime.LockOSThread()
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			started <- err
			return
		}
		started <- cmd.Start()
	}()
	must.NoError(t, <-started)
	_ = w.Close()
	_ = peer.Close()
	if go_ != nil {
		fds := []int{int(devNull.Fd()), int(outW.Fd()), int(os.Stderr.Fd())}
		switch {
		case go_.fds > len(fds):
			fds = append(fds, make([]int, go_.fds-len(fds))...)
			for i := 3; i < go_.fds; i++ {
				fds[i] = int(devNull.Fd())
			}
		case go_.fds != 0:
			fds = fds[:go_.fds]
		}
		// The stage may have ended already (a malformed file): then the
		// send fails, and what it wrote says why.
		_ = unix.Sendmsg(int(sock.Fd()), go_.msg, unix.UnixRights(fds...), nil, unix.MSG_NOSIGNAL)
	}
	_ = sock.Close()
	_ = outW.Close()
	var stdout bytes.Buffer
	copied := make(chan error, 1)
	go func() {
		_, err := io.Copy(&stdout, outR)
		copied <- err
	}()
	msg, err := io.ReadAll(r)
	must.NoError(t, err)
	_ = cmd.Wait()
	must.NoError(t, <-copied)
	return stageRun{msg: string(msg), stdout: stdout.String(), code: cmd.ProcessState.ExitCode()}
}

// stageFileBytes is what stageFile writes for env and the task's filter.
func stageFileBytes(t *testing.T, env []string, filter []unix.SockFilter) []byte {
	t.Helper()
	f, err := stageFile(env, filter)
	must.NoError(t, err)
	defer f.Close()
	b, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<20))
	must.NoError(t, err)
	return b
}

// The shim's entry point does the seccomp stage before the Go runtime
// starts: it attaches the task's filter, and the user namespace rules
// unless it holds SYS_ADMIN; waits for its go-ahead and takes the
// go-ahead's stdio, working directory and path; hands the command the
// task's environment and no descriptor but stdio; and says why a step
// failed with the errno after its marker (the Go stage writes a message
// instead: that marker proves the entry point ran). What is not the
// stage, or a stage it cannot serve, goes on to the Go runtime, which says
// what is wrong. The command the stage execs gets each refused call's errno
// from the filters attached (stageProbe), and what no filter names reaches
// the kernel. Run as root; the same cases but those of the filters run on
// arm64 too when qemu-aarch64-static is there (it does not run seccomp
// filters), and all of them on an arm64 kernel with make stage-arm64
// (e2e/arm64/run.sh).
func TestStageEntry_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("test needs root: it runs the stage as another user")
	}
	script := `echo "filters=$(grep Seccomp_filters /proc/self/status | tr -d ' \t' | cut -d: -f2)"
echo "foo=$FOO"
echo "arg0=$0"
echo "pwd=$(pwd)"
for fd in 3 4 5 6 7 8 9; do [ -e /proc/$$/fd/$fd ] && echo "open=$fd"; done
true`
	env := []string{"FOO=bar baz", "EMPTY="}
	stage := func(args ...string) []string {
		return append([]string{"cmd", wire.StageSeccomp}, args...)
	}
	errnoOf := func(e unix.Errno) string {
		b := make([]byte, 2)
		binary.LittleEndian.PutUint16(b, uint16(e))
		return string(b)
	}
	filter, err := seccompFilter(0)
	must.NoError(t, err)
	must.SliceNotEmpty(t, filter)

	type tcase struct {
		name     string
		argv     []string
		file     []byte
		cred     *syscall.Credential
		go_      *goAhead
		filtered bool // needs a kernel of the shim's architecture, which runs the filter (not qemu-user)
		check    func(t *testing.T, got stageRun)
	}
	sh := goAheadFor("", "/bin/sh")
	probePath := probeBinary(t)
	probe := goAheadFor("", probePath)
	probeEnv := []string{stageProbeEnv + "=1"}
	nobody := &syscall.Credential{Uid: 65534, Gid: 65534}
	// answers checks the probe's lines against want; a value "!X" is any
	// answer but X.
	answers := func(t *testing.T, got stageRun, want map[string]string) {
		t.Helper()
		must.Eq(t, wire.SeccompReady, got.msg)
		lines := outputLinesOf(got.stdout)
		for k, v := range want {
			if not, ok := strings.CutPrefix(v, "!"); ok {
				must.NotEq(t, not, lines[k], must.Sprintf("%s, in:\n%s", k, got.stdout))
				must.NotEq(t, "", lines[k], must.Sprintf("%s, in:\n%s", k, got.stdout))
				continue
			}
			must.Eq(t, v, lines[k], must.Sprintf("%s, in:\n%s", k, got.stdout))
		}
	}
	cases := []tcase{
		{"nobody: both filters, the environment, no descriptors", stage("sh", "-c", script), stageFileBytes(t, env, filter),
			&syscall.Credential{Uid: 65534, Gid: 65534}, sh, true, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady, got.msg)
				lines := outputLinesOf(got.stdout)
				must.Eq(t, "2", lines["filters"], must.Sprint("the stage attached the task's filter and the rules"))
				must.Eq(t, "bar baz", lines["foo"])
				must.Eq(t, "sh", lines["arg0"])
				must.StrNotContains(t, got.stdout, "open=", must.Sprint("a descriptor of the stage reached the command"))
			}},
		{"nobody, no task filter: the rules", stage("sh", "-c", script), stageFileBytes(t, env, nil),
			&syscall.Credential{Uid: 65534, Gid: 65534}, sh, true, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady, got.msg)
				must.Eq(t, "1", outputLinesOf(got.stdout)["filters"])
			}},
		{"root with SYS_ADMIN: the task's filter, no rules", stage("sh", "-c", script), stageFileBytes(t, env, filter), nil, sh, true,
			func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady, got.msg)
				lines := outputLinesOf(got.stdout)
				must.Eq(t, "1", lines["filters"])
				must.Eq(t, "bar baz", lines["foo"])
				must.StrNotContains(t, got.stdout, "open=")
			}},
		{"root with SYS_ADMIN, no task filter: none", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil, sh, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady, got.msg)
				must.Eq(t, "0", outputLinesOf(got.stdout)["filters"])
			}},
		// What the attached filters answer the command: each refused
		// call gets the filter's errno, and what a filter does not name
		// reaches the kernel.
		{"nobody: the command's refused calls get the filters' errnos", stage("probe"), stageFileBytes(t, probeEnv, filter),
			nobody, probe, true, func(t *testing.T, got stageRun) {
				answers(t, got, map[string]string{"filters": "2", "keyctl": "EPERM", "io_uring_setup": "ENOSYS",
					"setns": "EPERM", "clone3": "ENOSYS", "unshare_user": "EPERM", "unshare_mount": "EPERM", "getpid": "ok"})
			}},
		{"nobody, no task filter: the rules' errnos, the keyrings reach the kernel", stage("probe"), stageFileBytes(t, probeEnv, nil),
			nobody, probe, true, func(t *testing.T, got stageRun) {
				answers(t, got, map[string]string{"filters": "1", "keyctl": "ENOTSUP", "io_uring_setup": "!ENOSYS",
					"setns": "EPERM", "clone3": "ENOSYS", "unshare_user": "EPERM", "getpid": "ok"})
			}},
		{"root with SYS_ADMIN: the task's filter's errnos, no rules", stage("probe"), stageFileBytes(t, probeEnv, filter),
			nil, probe, true, func(t *testing.T, got stageRun) {
				answers(t, got, map[string]string{"filters": "1", "keyctl": "EPERM", "bpf": "EPERM", "io_uring_setup": "ENOSYS",
					"setns": "EBADF", "clone3": "EINVAL", "unshare_user": "EINVAL", "unshare_mount": "ok", "getpid": "ok"})
			}},
		{"root with SYS_ADMIN, no task filter: every call reaches the kernel", stage("probe"), stageFileBytes(t, probeEnv, nil),
			nil, probe, true, func(t *testing.T, got stageRun) {
				answers(t, got, map[string]string{"filters": "0", "keyctl": "ENOTSUP", "bpf": "EINVAL",
					"io_uring_setup": "!ENOSYS", "setns": "EBADF", "clone3": "EINVAL", "unshare_user": "EINVAL", "getpid": "ok"})
			}},
		// The entry point's marker, not the Go stage's message: the entry
		// point attached both filters itself and went on.
		{"nobody, both filters, chdir fails: the entry point's errno", stage("probe"), stageFileBytes(t, probeEnv, filter),
			nobody, goAheadFor("/nonexistent", probePath), true, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompChdirFailed+errnoOf(unix.ENOENT), got.msg)
				must.Eq(t, 127, got.code)
			}},
		{"the go-ahead's working directory", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			goAheadFor("/usr/bin", "/bin/sh"), false, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady, got.msg)
				must.Eq(t, "/usr/bin", outputLinesOf(got.stdout)["pwd"])
			}},
		{"chdir fails: the errno", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			goAheadFor("/nonexistent", "/bin/sh"), false, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompChdirFailed+errnoOf(unix.ENOENT), got.msg)
				must.Eq(t, 127, got.code)
				must.Eq(t, "", got.stdout)
			}},
		{"exec fails: the errno", stage("cmd"), stageFileBytes(t, env, nil), nil, goAheadFor("", "/nonexistent/cmd"), false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady+wire.SeccompExecFailed+errnoOf(unix.ENOENT), got.msg)
				must.Eq(t, 127, got.code)
			}},
		{"no go-ahead (EOF): exits, says nothing", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil, nil, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, "", got.msg)
				must.Eq(t, 127, got.code)
				must.Eq(t, "", got.stdout)
			}},
		{"go-ahead without a path", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil, goAheadFor("/", ""), false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompGoFailed+errnoOf(unix.EINVAL), got.msg)
				must.Eq(t, 127, got.code)
			}},
		{"go-ahead not NUL-terminated", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			&goAhead{msg: []byte("\x00/bin/sh")}, false, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompGoFailed+errnoOf(unix.EINVAL), got.msg)
			}},
		{"go-ahead with a third part", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			&goAhead{msg: []byte("\x00/bin/sh\x00x\x00")}, false, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompGoFailed+errnoOf(unix.EINVAL), got.msg)
			}},
		{"go-ahead with two descriptors", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			&goAhead{msg: sh.msg, fds: 2}, false, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompGoFailed+errnoOf(unix.EINVAL), got.msg)
				must.Eq(t, "", got.stdout)
			}},
		{"go-ahead with four descriptors", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			&goAhead{msg: sh.msg, fds: 4}, false, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompGoFailed+errnoOf(unix.EINVAL), got.msg)
				must.Eq(t, "", got.stdout)
			}},
		// Its first wire.SeccompGoMax bytes alone are a go-ahead ("////...",
		// "/bin/sh"): only the truncation tells it is not.
		{"go-ahead longer than its buffer (truncated)", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			&goAhead{msg: []byte(strings.Repeat("/", wire.SeccompGoMax-len("\x00/bin/sh\x00")) + "\x00/bin/sh\x00x")}, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompGoFailed+errnoOf(unix.EINVAL), got.msg)
			}},
		{"go-ahead of descriptors alone, no bytes", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			&goAhead{msg: []byte{}}, false, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompGoFailed+errnoOf(unix.EINVAL), got.msg)
			}},
		{"go-ahead with an empty path", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			&goAhead{msg: []byte("\x00\x00")}, false, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompGoFailed+errnoOf(unix.EINVAL), got.msg)
			}},
		{"go-ahead of a directory alone", stage("sh", "-c", script), stageFileBytes(t, env, nil), nil,
			&goAhead{msg: []byte("/usr/bin\x00")}, false, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompGoFailed+errnoOf(unix.EINVAL), got.msg)
			}},
		// The environment the exec gave the shell, not what the shell
		// exports of its own (dash PWD; busybox's also SHLVL and PATH).
		{"empty environment", stage("sh", "-c", `echo "n=$(tr '\0' '\n' </proc/$$/environ | grep -c .)"`), stageFileBytes(t, nil, nil), nil, sh, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady, got.msg)
				must.Eq(t, "0", outputLinesOf(got.stdout)["n"])
			}},
		{"not the stage: the Go runtime", []string{"cmd", "something", "true"}, nil, nil, nil, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, "", got.msg)
				must.Eq(t, 2, got.code)
			}},
		{"no command: the Go stage says so", stage(), stageFileBytes(t, env, nil), nil, nil, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, "the seccomp stage got no command", got.msg)
			}},
		{"malformed file: the Go stage says so", stage("true"), []byte{1, 2, 3}, nil, goAheadFor("", "/bin/true"), false,
			func(t *testing.T, got stageRun) {
				must.StrContains(t, got.msg, "the seccomp stage could not read the task's environment")
				must.Eq(t, 127, got.code)
			}},
		{"filter past its file: the Go stage says so", stage("true"), []byte{9, 0, 0, 0, 0, 0, 0, 0, 'A', '=', 0, 0, 0, 0, 0, 0}, nil,
			goAheadFor("", "/bin/true"), false, func(t *testing.T, got stageRun) {
				must.StrContains(t, got.msg, "the seccomp stage could not read the task's environment")
			}},
		{"second filter past its file: the Go stage says so", stage("true"), []byte{0, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 'A', '=', 0}, nil,
			goAheadFor("", "/bin/true"), false, func(t *testing.T, got stageRun) {
				must.StrContains(t, got.msg, "the seccomp stage could not read the task's environment")
			}},
	}
	arches := []struct{ goarch, wrap string }{{runtime.GOARCH, ""}}
	other := map[string]string{"amd64": "arm64", "arm64": "amd64"}[runtime.GOARCH]
	if q, err := exec.LookPath("qemu-" + map[string]string{"amd64": "x86_64", "arm64": "aarch64"}[other] + "-static"); err == nil {
		arches = append(arches, struct{ goarch, wrap string }{other, q})
	}
	for _, a := range arches {
		t.Run(a.goarch, func(t *testing.T) {
			shim := shimtest.Build(t, a.goarch)
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					if a.wrap != "" && c.filtered {
						t.Skip("qemu-user runs no seccomp filter")
					}
					c.check(t, runEntryStage(t, a.wrap, shim, c.argv, c.file, c.cred, c.go_))
				})
			}
		})
	}
}

// The Go stage runs its command only on its go-ahead: at EOF (its
// supervisor killed, or gone before the task's volumes came) it exits 127
// and runs nothing, with the go-ahead it runs the command with the
// go-ahead's stdio. The shim's entry point does the same (TestStageEntry_Root).
func TestGoStage_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("test needs root: it runs the stage as the supervisor does")
	}
	self, err := os.Executable()
	must.NoError(t, err)
	argv := []string{"sh", wire.StageSeccomp, "sh", "-c", "echo ran; exit 3"}
	file := stageFileBytes(t, []string{"PATH=/usr/bin:/bin"}, nil)

	got := runEntryStage(t, "", self, argv, file, nil, nil)
	must.Eq(t, "", got.msg)
	must.Eq(t, 127, got.code, must.Sprint("the stage did not exit as one without its go-ahead"))
	must.Eq(t, "", got.stdout)

	got = runEntryStage(t, "", self, argv, file, nil, goAheadFor("", "/bin/sh"))
	must.Eq(t, wire.SeccompReady, got.msg)
	must.Eq(t, 3, got.code)
	must.Eq(t, "ran\n", got.stdout)

	// A go-ahead it cannot take whole runs nothing either: the stage says
	// why and exits 127, though it got stdio and, but for the truncated
	// one, a path it could run.
	for _, c := range []struct {
		name string
		go_  *goAhead
	}{
		{"truncated", &goAhead{msg: []byte(strings.Repeat("/", wire.SeccompGoMax-len("\x00/bin/sh\x00")) + "\x00/bin/sh\x00x")}},
		{"not NUL-terminated", &goAhead{msg: []byte("\x00/bin/sh")}},
		{"a third part", &goAhead{msg: []byte("\x00/bin/sh\x00x\x00")}},
		{"two descriptors", &goAhead{msg: []byte("\x00/bin/sh\x00"), fds: 2}},
		{"four descriptors", &goAhead{msg: []byte("\x00/bin/sh\x00"), fds: 4}},
		{"descriptors alone", &goAhead{msg: []byte{}}},
		{"an empty path", &goAhead{msg: []byte("\x00\x00")}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := runEntryStage(t, "", self, argv, file, nil, c.go_)
			must.StrContains(t, got.msg, "the seccomp stage could not take its go-ahead")
			must.Eq(t, 127, got.code)
			must.Eq(t, "", got.stdout)
		})
	}
}

// outputLinesOf maps "key=value" lines.
func outputLinesOf(out string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}
