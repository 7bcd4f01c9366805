//go:build linux && (amd64 || arm64)

package supervisor

import (
	"bytes"
	"encoding/binary"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/shimtest"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

type stageRun struct {
	msg    string // what the stage wrote on its error pipe
	stdout string
	code   int
}

// runEntryStage runs shim (under wrap, an emulator, when set) with argv,
// as the supervisor starts the seccomp stage: with file as its memory
// file, from a thread with no_new_privs, as cred (nil: this process's
// user, root with every capability).
func runEntryStage(t *testing.T, wrap, shim string, argv []string, file []byte, cred *syscall.Credential) stageRun {
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

	var stdout bytes.Buffer
	cmd := &exec.Cmd{Path: shim, Args: argv, Env: []string{}, Stdout: &stdout, Stderr: os.Stderr,
		ExtraFiles: []*os.File{exe, w, mem}, SysProcAttr: &syscall.SysProcAttr{Credential: cred}}
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
	msg, err := io.ReadAll(r)
	must.NoError(t, err)
	_ = cmd.Wait()
	return stageRun{msg: string(msg), stdout: stdout.String(), code: cmd.ProcessState.ExitCode()}
}

// stageFileBytes is what stageFile writes for env.
func stageFileBytes(t *testing.T, env []string) []byte {
	t.Helper()
	f, err := stageFile(env)
	must.NoError(t, err)
	defer f.Close()
	b, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<20))
	must.NoError(t, err)
	return b
}

// The shim's entry point does the seccomp stage before the Go runtime
// starts: it attaches the user namespace rules unless it holds SYS_ADMIN,
// hands the command the task's environment and no descriptor but stdio,
// and says why an exec failed with the errno after the exec-failed marker
// (the Go stage writes a message instead: that marker proves the entry
// point ran). What is not the stage, or a stage it cannot serve, goes on
// to the Go runtime, which says what is wrong. Run as root; the same cases
// but the filter's run on arm64 too when qemu-aarch64-static is there (it
// does not run seccomp filters).
func TestStageEntry_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("test needs root: it runs the stage as another user")
	}
	script := `echo "filters=$(grep Seccomp_filters /proc/self/status | tr -d ' \t' | cut -d: -f2)"
echo "foo=$FOO"
echo "arg0=$0"
for fd in 3 4 5; do [ -e /proc/$$/fd/$fd ] && echo "open=$fd"; done
true`
	env := []string{"FOO=bar baz", "EMPTY="}
	stage := func(path string, args ...string) []string {
		return append([]string{"cmd", wire.StageSeccomp, path}, args...)
	}
	enoent := make([]byte, 2)
	binary.LittleEndian.PutUint16(enoent, uint16(unix.ENOENT))

	type tcase struct {
		name     string
		argv     []string
		file     []byte
		cred     *syscall.Credential
		filtered bool // needs a kernel that runs the filter (not qemu-user)
		check    func(t *testing.T, got stageRun)
	}
	cases := []tcase{
		{"nobody: the rules, the environment, no descriptors", stage("/bin/sh", "sh", "-c", script), stageFileBytes(t, env),
			&syscall.Credential{Uid: 65534, Gid: 65534}, true, func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady, got.msg)
				lines := outputLinesOf(got.stdout)
				must.Eq(t, "1", lines["filters"], must.Sprint("the stage attached the rules"))
				must.Eq(t, "bar baz", lines["foo"])
				must.Eq(t, "sh", lines["arg0"])
				must.StrNotContains(t, got.stdout, "open=", must.Sprint("a descriptor of the stage reached the command"))
			}},
		{"root with SYS_ADMIN: no rules", stage("/bin/sh", "sh", "-c", script), stageFileBytes(t, env), nil, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady, got.msg)
				lines := outputLinesOf(got.stdout)
				must.Eq(t, "0", lines["filters"])
				must.Eq(t, "bar baz", lines["foo"])
				must.StrNotContains(t, got.stdout, "open=")
			}},
		{"exec fails: the errno", stage("/nonexistent/cmd", "cmd"), stageFileBytes(t, env), nil, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady+wire.SeccompExecFailed+string(enoent), got.msg)
				must.Eq(t, 127, got.code)
			}},
		{"empty environment", stage("/bin/sh", "sh", "-c", `echo "n=$(env | grep -vc '^PWD=')"`), stageFileBytes(t, nil), nil, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, wire.SeccompReady, got.msg)
				must.Eq(t, "0", outputLinesOf(got.stdout)["n"])
			}},
		{"not the stage: the Go runtime", []string{"cmd", "something", "/bin/true", "true"}, nil, nil, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, "", got.msg)
				must.Eq(t, 2, got.code)
			}},
		{"no command: the Go stage says so", stage("/bin/true"), stageFileBytes(t, env), nil, false,
			func(t *testing.T, got stageRun) {
				must.Eq(t, "the seccomp stage got no command", got.msg)
			}},
		{"malformed file: the Go stage says so", stage("/bin/true", "true"), []byte{1, 2, 3}, nil, false,
			func(t *testing.T, got stageRun) {
				must.StrContains(t, got.msg, "the seccomp stage could not read the task's environment")
				must.Eq(t, 127, got.code)
			}},
		{"filter past its file: the Go stage says so", stage("/bin/true", "true"), []byte{9, 0, 0, 0, 0, 0, 0, 0, 'A', '=', 0}, nil, false,
			func(t *testing.T, got stageRun) {
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
					c.check(t, runEntryStage(t, a.wrap, shim, c.argv, c.file, c.cred))
				})
			}
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
