package supervisor

import (
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// runFilter interprets the few classic BPF instructions seccompProgram
// uses against one call's architecture and number.
func runFilter(t *testing.T, prog []unix.SockFilter, arch, nr uint32) uint32 {
	t.Helper()
	return runFilterArg(t, prog, arch, nr, 0)
}

// runFilterArg is runFilter for a call whose first argument is arg0.
func runFilterArg(t *testing.T, prog []unix.SockFilter, arch, nr, arg0 uint32) uint32 {
	t.Helper()
	var acc uint32
	for pc := 0; pc < len(prog); pc++ {
		in := prog[pc]
		switch in.Code {
		case unix.BPF_LD | unix.BPF_W | unix.BPF_ABS:
			switch in.K {
			case seccompDataNr:
				acc = nr
			case seccompDataArch:
				acc = arch
			case seccompDataArg0:
				acc = arg0
			default:
				t.Fatalf("pc %d: load of offset %d", pc, in.K)
			}
		case unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K:
			if acc == in.K {
				pc += int(in.Jt)
			} else {
				pc += int(in.Jf)
			}
		case unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K:
			if acc&in.K != 0 {
				pc += int(in.Jt)
			} else {
				pc += int(in.Jf)
			}
		case unix.BPF_RET | unix.BPF_K:
			return in.K
		default:
			t.Fatalf("pc %d: instruction %#x", pc, in.Code)
		}
	}
	t.Fatalf("the filter ran off its end for arch %#x nr %d", arch, nr)
	return 0
}

// Every refused call is refused on every ABI the kernel runs for this
// architecture, with its errno; the calls next to them and the ones a task
// needs are allowed; a call of an unknown architecture gets ENOSYS.
func TestSeccompProgram(t *testing.T) {
	if seccompNative == 0 {
		t.Skipf("no filter for %s", runtime.GOARCH)
	}
	list := seccompList(0)
	prog, err := seccompProgram(list)
	must.NoError(t, err)
	errno := func(e unix.Errno) uint32 { return unix.SECCOMP_RET_ERRNO | uint32(e) }
	refused := map[[2]uint32]bool{}
	for _, d := range list {
		must.NonZero(t, d.native, must.Sprint(d.name))
		must.NonZero(t, d.compat, must.Sprint(d.name))
		abis := [][2]uint32{{seccompNative, d.native}, {seccompCompat, d.compat}}
		if seccompX32 != 0 {
			abis = append(abis, [2]uint32{seccompNative, d.native | seccompX32})
		}
		for _, c := range abis {
			refused[c] = true
			must.Eq(t, errno(d.errno), runFilter(t, prog, c[0], c[1]), must.Sprintf("%s on arch %#x nr %d", d.name, c[0], c[1]))
		}
	}
	for _, nr := range []uintptr{unix.SYS_READ, unix.SYS_WRITE, unix.SYS_EXECVE, unix.SYS_CLONE, unix.SYS_GETPID, unix.SYS_OPENAT, unix.SYS_MMAP} {
		must.Eq(t, unix.SECCOMP_RET_ALLOW, runFilter(t, prog, seccompNative, uint32(nr)), must.Sprintf("native nr %d", nr))
	}
	for _, arch := range []uint32{seccompNative, seccompCompat} {
		for nr := uint32(0); nr < 500; nr++ {
			if refused[[2]uint32{arch, nr}] {
				continue
			}
			must.Eq(t, unix.SECCOMP_RET_ALLOW, runFilter(t, prog, arch, nr), must.Sprintf("arch %#x nr %d", arch, nr))
		}
	}
	must.Eq(t, errno(unix.ENOSYS), runFilter(t, prog, 0x12345678, uint32(unix.SYS_READ)))
	must.Eq(t, errno(unix.ENOSYS), runFilter(t, prog, seccompNative^seccompCompat, uint32(unix.SYS_KEYCTL)))
}

// A task the operator gave the capability a call is for may make it: the
// filter leaves out bpf for BPF or SYS_ADMIN, perf_event_open for PERFMON
// or SYS_ADMIN, userfaultfd for SYS_PTRACE, and never the keyrings or
// io_uring.
func TestSeccompList_capabilities(t *testing.T) {
	names := func(held capSet) []string {
		var out []string
		for _, d := range seccompList(held) {
			out = append(out, d.name)
		}
		return out
	}
	all := []string{"keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
		"io_uring_setup", "io_uring_enter", "io_uring_register"}
	always := []string{"keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register"}
	cases := []struct {
		name string
		held capSet
		want []string
	}{
		{"none", 0, all},
		{"defaults", 1<<unix.CAP_CHOWN | 1<<unix.CAP_NET_BIND_SERVICE | 1<<unix.CAP_SETUID, all},
		{"bpf", 1 << unix.CAP_BPF, []string{"keyctl", "add_key", "request_key", "perf_event_open", "userfaultfd",
			"io_uring_setup", "io_uring_enter", "io_uring_register"}},
		{"perfmon", 1 << unix.CAP_PERFMON, []string{"keyctl", "add_key", "request_key", "bpf", "userfaultfd",
			"io_uring_setup", "io_uring_enter", "io_uring_register"}},
		{"sys_ptrace", 1 << unix.CAP_SYS_PTRACE, []string{"keyctl", "add_key", "request_key", "bpf", "perf_event_open",
			"io_uring_setup", "io_uring_enter", "io_uring_register"}},
		{"sys_admin", 1 << unix.CAP_SYS_ADMIN, []string{"keyctl", "add_key", "request_key", "userfaultfd",
			"io_uring_setup", "io_uring_enter", "io_uring_register"}},
		{"all three", 1<<unix.CAP_SYS_ADMIN | 1<<unix.CAP_SYS_PTRACE, always},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			must.Eq(t, c.want, names(c.held))
		})
	}
}

// The user namespace rules: clone and unshare with CLONE_NEWUSER are
// refused on every ABI, with other flags (threads, a mount namespace
// without a user one) allowed; clone3 gets ENOSYS; a task holding
// SYS_ADMIN gets no rules. Together with the other list, each rule still
// answers as alone.
func TestSeccompProgram_userNamespaces(t *testing.T) {
	if seccompNative == 0 {
		t.Skipf("no filter for %s", runtime.GOARCH)
	}
	must.SliceEmpty(t, usernsList(1<<unix.CAP_SYS_ADMIN))
	list := usernsList(0)
	must.SliceLen(t, 4, list)
	// The compat numbers, from the kernel's tables (i386:
	// arch/x86/entry/syscalls/syscall_32.tbl, ARM: arch/arm/tools/syscall.tbl),
	// written out here rather than read from the list under test.
	compat := map[string][2]uint32{"clone": {120, 120}, "unshare": {310, 337}, "clone3": {435, 435}, "setns": {346, 375}}
	for _, d := range append(seccompList(0), list...) {
		if c, ok := compat[d.name]; ok {
			want := c[0]
			if runtime.GOARCH == "arm64" {
				want = c[1]
			}
			must.Eq(t, want, d.compat, must.Sprint(d.name))
		}
	}
	errno := func(e unix.Errno) uint32 { return unix.SECCOMP_RET_ERRNO | uint32(e) }
	thread := uint32(unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND | unix.CLONE_THREAD)
	for _, full := range []bool{false, true} {
		l := list
		if full {
			l = append(seccompList(0), list...)
		}
		prog, err := seccompProgram(l)
		must.NoError(t, err)
		for _, d := range list {
			abis := [][2]uint32{{seccompNative, d.native}, {seccompCompat, d.compat}}
			if seccompX32 != 0 {
				abis = append(abis, [2]uint32{seccompNative, d.native | seccompX32})
			}
			for _, c := range abis {
				what := must.Sprintf("%s on arch %#x nr %d (with the other list: %v)", d.name, c[0], c[1], full)
				if d.argMask == 0 {
					must.Eq(t, errno(d.errno), runFilterArg(t, prog, c[0], c[1], thread), what)
					continue
				}
				must.Eq(t, errno(unix.EPERM), runFilterArg(t, prog, c[0], c[1], unix.CLONE_NEWUSER), what)
				must.Eq(t, errno(unix.EPERM), runFilterArg(t, prog, c[0], c[1], unix.CLONE_NEWUSER|unix.CLONE_NEWNS|uint32(unix.SIGCHLD)), what)
				must.Eq(t, unix.SECCOMP_RET_ALLOW, runFilterArg(t, prog, c[0], c[1], thread), what)
				must.Eq(t, unix.SECCOMP_RET_ALLOW, runFilterArg(t, prog, c[0], c[1], unix.CLONE_NEWNS), what)
			}
		}
		if full {
			must.Eq(t, errno(unix.EPERM), runFilter(t, prog, seccompNative, uint32(unix.SYS_KEYCTL)))
		}
		must.Eq(t, unix.SECCOMP_RET_ALLOW, runFilter(t, prog, seccompNative, uint32(unix.SYS_GETPID)))
	}
}

// The supervisor reads the seccomp stage's answer: the ready byte alone
// (then EOF at exec) is a start; a message after it, or the exec-failed
// marker and an errno, is the exec's error; the chdir-failed or
// go-ahead-failed marker and an errno, the step's error; a
// message without it is the stage's own failure; nothing at all is a stage
// that ended before its exec; and a stage that says nothing and keeps the
// pipe open is given up on after stageTimeout.
func TestStageAnswer(t *testing.T) {
	old := stageTimeout
	stageTimeout = 200 * time.Millisecond
	t.Cleanup(func() { stageTimeout = old })
	cases := []struct {
		name, write string
		keepOpen    bool
		want        string // "" for no error
	}{
		{"started", wire.SeccompReady, false, ""},
		{"exec failed", wire.SeccompReady + `failed to execute "/x": exec format error`, false, `failed to execute "/x": exec format error`},
		// The shim's stage before the Go runtime (stageEntry) says the errno.
		{"exec failed, errno", wire.SeccompReady + wire.SeccompExecFailed + "\x08\x00", false, `failed to execute "/x": exec format error`},
		{"exec failed, errno past 255", wire.SeccompReady + wire.SeccompExecFailed + "\x0c\x01", false, `failed to execute "/x": errno 268`},
		{"chdir failed, errno", wire.SeccompChdirFailed + "\x0d\x00", false, `failed to change to working directory "/d": permission denied`},
		{"go-ahead failed, errno", wire.SeccompGoFailed + "\x16\x00", false, "the seccomp stage could not take its go-ahead: invalid argument"},
		{"stage failed", "the seccomp stage got no command", false, "the seccomp stage got no command"},
		{"ended", "", false, "the seccomp stage ended before it started the command"},
		{"hung", "", true, "the seccomp stage did not start the command within 200ms"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, w, err := os.Pipe()
			must.NoError(t, err)
			defer r.Close()
			// The stage's end: a second descriptor of the write end, as the
			// child holds it.
			stage, err := unix.Dup(int(w.Fd()))
			must.NoError(t, err)
			_, err = unix.Write(stage, []byte(c.write))
			must.NoError(t, err)
			if !c.keepOpen {
				must.NoError(t, unix.Close(stage))
			} else {
				defer unix.Close(stage)
			}
			must.NoError(t, w.Close())
			err = stageAnswer(r, "/d", "/x")
			if c.want == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, c.want)
		})
	}
}
