package executor

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
)

// isolatedSpec is a test task kept from the host as a task that is not
// privileged is.
func isolatedSpec(t *testing.T, script string) *testTask {
	t.Helper()
	tt := newTestSpec(t, "/bin/sh", "-c", script)
	tt.spec.Dir = "/"
	tt.spec.Capabilities = DefaultCapabilities
	tt.spec.Isolation = &Isolation{ChrootEnv: DefaultChrootEnv, PrivatePID: true, PrivateIPC: true}
	return tt
}

// runLines runs tt to its end, requires exit code 0, and returns (and
// logs) the "key=value" lines of its output.
func runLines(t *testing.T, tt *testTask) map[string]string {
	t.Helper()
	return exitLines(t, tt, startTest(t, tt))
}

// exitLines is runLines for tt's task started as p.
func exitLines(t *testing.T, tt *testTask, p *Process) map[string]string {
	t.Helper()
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	got := outputLines(readFile(t, tt.stdout))
	t.Log(got)
	return got
}

// startWithLateMount starts tt's task with vol as its one late mount at
// target, as a task's CSI volume comes.
func startWithLateMount(tt *testTask, vol, target string) (*Process, error) {
	tt.spec.LateMounts = []Mount{{Target: target}}
	return Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: target}}, nil
	})
}

// runWithVolume is runLines for tt's task with vol at /vol
// (startWithLateMount).
func runWithVolume(t *testing.T, tt *testTask, vol string) map[string]string {
	t.Helper()
	p, err := startWithLateMount(tt, vol, "/vol")
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	return exitLines(t, tt, p)
}

// outputLines maps "key=value" lines of a task's output.
func outputLines(out string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

func TestIsolation_Root_Root(t *testing.T) {
	requireTaskRoot(t)
	marker := fmt.Sprintf("/etc/ncsi-escape-%d", os.Getpid())
	t.Cleanup(func() { _ = os.Remove(marker) })
	tt := isolatedSpec(t, `
echo "pid=$$"
echo "root=$(ls / | tr '\n' ' ')"
if touch `+marker+` 2>/dev/null; then echo etc=writable; else echo etc=read-only; fi
if touch /usr/ncsi-x 2>/dev/null; then echo usr=writable; else echo usr=read-only; fi
echo "procs=$(ls /proc | grep -c '^[0-9]')"
if [ -e /proc/1 ]; then echo pid1=visible; else echo pid1=hidden; fi
if cat /proc/1/mountinfo >/dev/null 2>&1; then echo pid1mounts=readable; else echo pid1mounts=hidden; fi
echo "cgroupfs=$(ls /sys/fs/cgroup 2>/dev/null | wc -l)"
if touch /sys/ncsi-x 2>/dev/null; then echo sys=writable; else echo sys=read-only; fi
echo "dev=$(ls /dev | tr '\n' ' ')"
if echo x > /proc/sys/kernel/core_pattern 2>/dev/null; then echo sysctl=writable; else echo sysctl=read-only; fi
if [ ! -e /proc/sysrq-trigger ]; then echo sysrq=read-only; elif (: > /proc/sysrq-trigger) 2>/dev/null; then echo sysrq=writable; else echo sysrq=read-only; fi
echo "keys=$(cat /proc/keys 2>/dev/null | wc -c)"
echo "nnp=$(grep NoNewPrivs /proc/self/status | tr -d ' \t' | cut -d: -f2)"
if touch /tmp/x 2>/dev/null; then echo tmp=writable; else echo tmp=read-only; fi
if touch /ncsi-top 2>/dev/null; then echo top=writable; else echo top=read-only; fi
if head -c1 /dev/zero >/dev/null && echo hi > /dev/null; then echo devnull=ok; fi
`)
	p := startTest(t, tt)
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	out := readFile(t, tt.stdout)
	got := outputLines(out)
	t.Log(out)

	// The supervisor is init; its threads take the next few numbers.
	pid, err := strconv.Atoi(got["pid"])
	must.NoError(t, err)
	must.Less(t, 64, pid, must.Sprint("the task runs in a PID namespace of its own"))
	for _, entry := range strings.Fields(got["root"]) {
		switch entry {
		case "bin", "etc", "lib", "lib32", "lib64", "sbin", "usr", "run", "dev", "proc", "sys", "tmp", "libx32":
		default:
			t.Errorf("unexpected entry %q in the task's root: %s", entry, got["root"])
		}
	}
	for _, key := range []string{"etc", "usr", "sys", "sysctl", "sysrq", "top"} {
		must.Eq(t, "read-only", got[key], must.Sprintf("%s", key))
	}
	_, err = os.Stat(marker)
	must.True(t, os.IsNotExist(err), must.Sprint("the task wrote the host's /etc"))
	must.Eq(t, "hidden", got["pid1"])
	must.Eq(t, "hidden", got["pid1mounts"])
	must.Eq(t, "0", got["cgroupfs"])
	must.Eq(t, "0", got["keys"], must.Sprint("/proc/keys is masked"))
	must.Eq(t, "1", got["nnp"])
	must.Eq(t, "writable", got["tmp"])
	must.Eq(t, "ok", got["devnull"])
	// Only the task's own processes: the shell, the subshell and ls.
	procs, err := strconv.Atoi(got["procs"])
	must.NoError(t, err)
	must.Between(t, 1, procs, 4)
	for _, want := range []string{"null", "zero", "full", "random", "urandom", "tty", "pts", "shm", "mqueue", "fd", "ptmx"} {
		must.StrContains(t, " "+got["dev"]+" ", " "+want+" ")
	}
	for _, entry := range strings.Fields(got["dev"]) {
		must.SliceContains(t, []string{"null", "zero", "full", "random", "urandom", "tty", "pts", "shm", "mqueue", "fd", "ptmx", "stdin", "stdout", "stderr"}, entry)
	}
}

// The device filter alone keeps a root task from a block device: the task
// may make the node (it has CAP_MKNOD) in a volume, which is not nodev, but
// not open it; the minimal /dev still works.
func TestIsolation_Devices_Root(t *testing.T) {
	requireTaskRoot(t)
	var st unix.Stat_t
	if err := unix.Stat("/dev/loop0", &st); err != nil {
		t.Skip("test needs /dev/loop0 to name a real block device")
	}
	vol := t.TempDir()
	tt := isolatedSpec(t, fmt.Sprintf(`
if mknod /vol/blk b %d %d 2>/dev/null; then echo mknod=ok; else echo mknod=failed; fi
if [ -b /vol/blk ] && dd if=/vol/blk of=/dev/null bs=512 count=1 2>/dev/null; then echo read=ok; else echo read=failed; fi
if head -c1 /dev/urandom >/dev/null 2>&1; then echo urandom=ok; else echo urandom=failed; fi
`, unix.Major(st.Rdev), unix.Minor(st.Rdev)))
	tt.spec.Limits.Devices = cgroups.DefaultDevices
	got := runWithVolume(t, tt, vol)
	must.Eq(t, "failed", got["read"], must.Sprint("a block device node the task made can be read"))
	must.Eq(t, "ok", got["urandom"])
}

// A descriptor the driver inherited without close-on-exec (from the Nomad
// agent, say) never reaches a task: a directory descriptor would lead out
// of any root.
func TestIsolation_InheritedDescriptors_Root(t *testing.T) {
	requireTaskRoot(t)
	secret := t.TempDir()
	fd, err := unix.Open(secret, unix.O_RDONLY|unix.O_DIRECTORY, 0) // no O_CLOEXEC
	must.NoError(t, err)
	t.Cleanup(func() { _ = unix.Close(fd) })
	withEachStage(t, func(t *testing.T, supervisor string) {
		tt := isolatedSpec(t, `echo "fds=$(ls /proc/self/fd | tr '\n' ' ')"`)
		tt.spec.Supervisor = supervisor
		got := runLines(t, tt)
		// 0-2, and the descriptor ls opens on /proc/self/fd itself.
		must.Eq(t, "0 1 2 3", strings.TrimSpace(got["fds"]), must.Sprintf("descriptor %d leaked into the task", fd))
	})
}

// seccompScript prints, for each call the seccomp filter refuses and one it
// allows, "name=ok" or "name=<errno>", making the calls with perl's
// syscall(): keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING, 0),
// io_uring_setup(1, params), userfaultfd(0), perf_event_open with a
// zeroed attribute, bpf(BPF_PROG_LOAD) with a zeroed attribute, getpid,
// unshare(CLONE_NEWUSER), unshare(CLONE_NEWIPC), clone3, a raw
// clone(CLONE_NEWUSER|SIGCHLD) (a child it makes exits at once) and setns
// into its own user namespace (EINVAL from the kernel, EPERM from the
// filter); then unshare(1) -U, the filters the process is under
// (/proc/self/status) and the environment variables it got.
func seccompScript() string {
	return fmt.Sprintf(`perl -e '
$| = 1;
sub r { my ($n, $v) = @_; print "$n=", ($v < 0 ? ($!+0) : "ok"), "\n"; }
my $p = "\0" x 128;
r("keyctl", syscall(%d, 0, -4, 0));
r("io_uring", syscall(%d, 1, $p));
r("userfaultfd", syscall(%d, 0));
r("perf", syscall(%d, $p, 0, -1, -1, 0));
r("bpf", syscall(%d, 5, $p, 128));
r("getpid", syscall(%d));
my $c = syscall(%d, %d, 0, 0, 0, 0);
exit 0 if $c == 0;
r("clone_user", $c);
open(my $ns, "<", "/proc/self/ns/user") or die "open: $!";
r("setns", syscall(%d, fileno($ns), 0));
r("clone3", syscall(%d, $p, 88));
r("unshare_ipc", syscall(%d, %d));
r("unshare_user", syscall(%d, %d));
'
if unshare -U true 2>/dev/null; then echo unshare_cmd=ok; else echo unshare_cmd=refused; fi
echo "filters=$(grep Seccomp_filters /proc/self/status | tr -d ' \t' | cut -d: -f2)"
echo "secret=$SECRET_TOKEN"
echo "godebug=$GODEBUG"
`, unix.SYS_KEYCTL, unix.SYS_IO_URING_SETUP, unix.SYS_USERFAULTFD, unix.SYS_PERF_EVENT_OPEN, unix.SYS_BPF, unix.SYS_GETPID,
		unix.SYS_CLONE, unix.CLONE_NEWUSER|int(unix.SIGCHLD), unix.SYS_SETNS, unix.SYS_CLONE3,
		unix.SYS_UNSHARE, unix.CLONE_NEWIPC, unix.SYS_UNSHARE, unix.CLONE_NEWUSER)
}

// A task that is not privileged runs under the seccomp filter: the host's
// keyrings, io_uring, userfaultfd, perf events, bpf and user namespaces
// (unshare, and clone3) are refused with the errno the filter gives
// (ENOSYS for io_uring and clone3, EPERM else); a call it does not name
// works, and so does unshare(1) in a privileged task. keyctl, io_uring,
// perf_event_open, clone, unshare and setns are answered otherwise without
// the filter (the privileged run below shows it); bpf
// and userfaultfd are refused by this host's kernel too (without the
// capabilities, with unprivileged_bpf_disabled and
// unprivileged_userfaultfd off), so for those TestSeccompProgram is the
// proof. A privileged task is not filtered: its keyctl is
// answered (the user keyring, KEY_SPEC_USER_KEYRING, exists for every user).
func TestIsolation_Seccomp_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/usr/bin/perl"); err != nil {
		t.Skip("test makes its calls with /usr/bin/perl, which this host lacks")
	}
	withEachStage(t, func(t *testing.T, supervisor string) {
		tt := isolatedSpec(t, seccompScript())
		tt.spec.Supervisor = supervisor
		// The task's environment reaches the command, not the stage: a stage
		// that took GODEBUG=inittrace=1 would print its Go runtime's
		// initialisation on the task's stderr.
		tt.spec.Env = append(tt.spec.Env, "GODEBUG=inittrace=1")
		got := runLines(t, tt)
		must.Eq(t, "hunter2", got["secret"], must.Sprint("the task's environment reaches the command"))
		must.Eq(t, "inittrace=1", got["godebug"])
		must.StrNotContains(t, readFile(t, tt.stderr), "init ", must.Sprint("the stage ran with the task's GODEBUG"))
		// The launching thread's filter and the stage's.
		must.Eq(t, "2", got["filters"])
		eperm, enosys := strconv.Itoa(int(unix.EPERM)), strconv.Itoa(int(unix.ENOSYS))
		must.Eq(t, eperm, got["keyctl"], must.Sprint("keyctl is refused"))
		must.Eq(t, enosys, got["io_uring"], must.Sprint("io_uring_setup is refused"))
		must.Eq(t, eperm, got["userfaultfd"], must.Sprint("userfaultfd is refused"))
		must.Eq(t, eperm, got["perf"], must.Sprint("perf_event_open is refused"))
		must.Eq(t, eperm, got["bpf"], must.Sprint("bpf is refused"))
		must.Eq(t, "ok", got["getpid"])
		must.Eq(t, eperm, got["unshare_user"], must.Sprint("a user namespace is refused"))
		must.Eq(t, enosys, got["clone3"], must.Sprint("clone3 is refused"))
		must.Eq(t, "refused", got["unshare_cmd"], must.Sprint("unshare -U works in the task"))
		must.Eq(t, eperm, got["clone_user"], must.Sprint("clone(CLONE_NEWUSER) is refused"))
		must.Eq(t, eperm, got["setns"], must.Sprint("setns is refused"))

		// A task given PERFMON may open perf events: the kernel answers it (an
		// error for the zeroed attribute here, but not the filter's EPERM).
		perf := isolatedSpec(t, seccompScript())
		perf.spec.Supervisor = supervisor
		perf.spec.Capabilities = append(append([]string(nil), DefaultCapabilities...), "PERFMON")
		got = runLines(t, perf)
		must.NotEq(t, eperm, got["perf"], must.Sprint("a task holding PERFMON is refused perf_event_open"))
		must.Eq(t, eperm, got["keyctl"], must.Sprint("keyctl is refused whatever the capabilities"))

		priv := newTestSpec(t, "/bin/sh", "-c", seccompScript())
		priv.spec.Supervisor = supervisor
		got = runLines(t, priv)
		must.Eq(t, "ok", got["keyctl"], must.Sprint("a privileged task is not filtered"))
		must.Eq(t, "ok", got["getpid"])
		must.Eq(t, "ok", got["unshare_user"], must.Sprint("a privileged task makes user namespaces"))
		must.Eq(t, "ok", got["unshare_cmd"])
		must.Eq(t, "ok", got["clone_user"])
		must.Eq(t, strconv.Itoa(int(unix.EINVAL)), got["setns"], must.Sprint("the kernel's own answer to setns into one's own user namespace"))
		must.Eq(t, "0", got["filters"])
	})
}

// A command run in a task that is not privileged (nomad alloc exec) runs
// under the same seccomp filter as the task.
func TestProcess_Exec_Seccomp_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/usr/bin/perl"); err != nil {
		t.Skip("test makes its calls with /usr/bin/perl, which this host lacks")
	}
	tt := isolatedSpec(t, "exec sleep 100")
	p := startTest(t, tt)
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	code, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c", seccompScript()}, Stdout: &stdout, Stderr: &stderr})
	must.NoError(t, err)
	must.Eq(t, 0, code, must.Sprintf("stderr: %s", stderr.String()))
	got := outputLines(stdout.String())
	t.Log(got)
	must.Eq(t, strconv.Itoa(int(unix.EPERM)), got["keyctl"])
	must.Eq(t, strconv.Itoa(int(unix.ENOSYS)), got["io_uring"])
	must.Eq(t, strconv.Itoa(int(unix.EPERM)), got["unshare_user"])
	must.Eq(t, strconv.Itoa(int(unix.ENOSYS)), got["clone3"])
	must.Eq(t, strconv.Itoa(int(unix.EPERM)), got["clone_user"])
	must.Eq(t, strconv.Itoa(int(unix.EPERM)), got["setns"])
	must.Eq(t, "1", got["filters"])
	must.Eq(t, "hunter2", got["secret"])
	must.Eq(t, "ok", got["getpid"])
}

// A command the seccomp stage cannot execute (here a file with the
// execute bit that is no program) fails the start with the reason, as a
// failed exec fails it without the stage.
func TestIsolation_SeccompStageExecError_Root(t *testing.T) {
	requireTaskRoot(t)
	vol := t.TempDir()
	must.NoError(t, os.WriteFile(vol+"/notaprogram", []byte("\x00\x01\x02 not an executable\n"), 0o755))
	withEachStage(t, func(t *testing.T, supervisor string) {
		tt := isolatedSpec(t, "")
		tt.spec.Supervisor = supervisor
		tt.spec.Command, tt.spec.Args = "/vol/notaprogram", nil
		p, err := startWithLateMount(tt, vol, "/vol")
		if err == nil {
			_ = p.Kill()
			_ = p.Destroy()
			t.Fatal("a command that is no program started")
		}
		must.StrContains(t, err.Error(), `failed to execute "/vol/notaprogram"`)
		must.StrContains(t, err.Error(), "exec format error")
	})
}

// The seccomp stage is forked before the task's volumes come and waits:
// a working directory and a command inside a volume are those of the
// volume once attached, not of the root's directory beneath it, and the
// command's stdio is the task's, not the stage's /dev/null. As the task
// runs, the stage's process is the command, with no descriptor of the
// stage's left.
func TestIsolation_DirAndCommandInAVolume_Root(t *testing.T) {
	requireTaskRoot(t)
	vol := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(vol, "run"), []byte(`#!/bin/sh
echo "pwd=$(pwd)"
echo "marker=$(cat marker)"
echo "self=$0"
echo "fds=$(ls /proc/self/fd | tr '\n' ' ')"
echo "err=stderr" >&2
`), 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(vol, "marker"), []byte("in-the-volume\n"), 0o644))
	must.NoError(t, os.Mkdir(filepath.Join(vol, "sub"), 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(vol, "sub", "marker"), []byte("in-a-subdirectory\n"), 0o644))
	withEachStage(t, func(t *testing.T, supervisor string) {
		for _, dir := range []string{"/vol", "/vol/sub"} {
			tt := isolatedSpec(t, "")
			tt.spec.Supervisor = supervisor
			tt.spec.Command, tt.spec.Args = "/vol/run", nil
			tt.spec.Dir = dir
			got := runWithVolume(t, tt, vol)
			must.Eq(t, dir, got["pwd"])
			must.Eq(t, map[string]string{"/vol": "in-the-volume", "/vol/sub": "in-a-subdirectory"}[dir], got["marker"])
			must.Eq(t, "/vol/run", got["self"])
			// 0, 1, 2 and the directory ls reads: nothing of the stage's.
			must.Eq(t, 4, len(strings.Fields(got["fds"])), must.Sprintf("descriptors: %s", got["fds"]))
			must.Eq(t, "err=stderr\n", readFile(t, tt.stderr))
		}
	})
}

// A task with late mounts (every task with CSI volumes) runs under the same
// seccomp filter and gets the same environment as one without: the filter
// and the stage's file are made before the late mounts come, and must
// still reach the task that is forked after them.
func TestIsolation_SeccompWithLateMounts_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/usr/bin/perl"); err != nil {
		t.Skip("test makes its calls with /usr/bin/perl, which this host lacks")
	}
	vol := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(vol, "marker"), []byte("late\n"), 0o644))
	withEachStage(t, func(t *testing.T, supervisor string) {
		tt := isolatedSpec(t, `echo "vol=$(cat /vol/marker)"; `+seccompScript())
		tt.spec.Supervisor = supervisor
		got := runWithVolume(t, tt, vol)
		must.Eq(t, "late", got["vol"], must.Sprint("the late mount reached the task"))
		must.Eq(t, "hunter2", got["secret"], must.Sprint("the task's environment reaches the command"))
		must.Eq(t, "2", got["filters"], must.Sprint("the task's filter and the user namespace rules, both the stage's"))
		eperm, enosys := strconv.Itoa(int(unix.EPERM)), strconv.Itoa(int(unix.ENOSYS))
		must.Eq(t, eperm, got["keyctl"], must.Sprint("keyctl is refused to a task with volumes"))
		must.Eq(t, enosys, got["io_uring"], must.Sprint("io_uring_setup is refused to a task with volumes"))
		must.Eq(t, eperm, got["perf"], must.Sprint("perf_event_open is refused to a task with volumes"))
		must.Eq(t, eperm, got["unshare_user"], must.Sprint("a user namespace is refused to a task with volumes"))
		must.Eq(t, eperm, got["setns"])
	})
}
