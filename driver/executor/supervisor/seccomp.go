package supervisor

import (
	"fmt"
	"runtime"
	"slices"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A non-privileged task runs under a seccomp filter that refuses a few
// system calls no capability guards and the task's namespaces do not
// contain:
//
//   - keyctl, add_key, request_key: the kernel's keyrings are per user ID
//     and not per mount or PID namespace, so a task running as root could
//     read, link or replace the keys the host's root keeps in its user
//     keyring (and a task of another user those of that user);
//   - io_uring_setup, io_uring_enter, io_uring_register: a large kernel
//     surface with a long record of privilege escalations, which several
//     container runtimes' default profiles refuse too;
//   - bpf, perf_event_open, userfaultfd: kernel surface used by exploits and
//     (perf) a window on the host's other processes; the sysctls that guard
//     them unprivileged are the host's choice, not the job's. A task the
//     operator gave the capability each is for (allow_caps and cap_add:
//     BPF or SYS_ADMIN, PERFMON or SYS_ADMIN, SYS_PTRACE) may make it, as
//     the kernel would let it.
//
// The filter is attached to the launching thread just before the task is
// forked, after no_new_privs, so the task inherits it and can never lift
// it; the thread is never reused. Calls made through another ABI of the
// same machine (i386 and x32 on amd64, 32-bit ARM on arm64) are checked
// too, by their own numbers: a filter that checked only the native numbers
// could be passed by a 32-bit call.
//
// io_uring is refused with ENOSYS, which programs that can use it take as
// "not here" and fall back from; the rest with EPERM.

// seccompDenied is one refused call: its number on each ABI the filter
// checks (0: no such call on that ABI) and the errno it gets.
type seccompDenied struct {
	name   string
	native uint32
	compat uint32 // i386 on amd64, 32-bit ARM on arm64
	errno  unix.Errno
	// argMask, when set, refuses the call only when its first argument
	// (the flags of clone and unshare) has one of these bits.
	argMask uint32
}

// seccompNative is the audit architecture of this build, seccompCompat
// the 32-bit one its kernel may also run, seccompX32 the x32 bit (amd64
// only, 0 elsewhere).
var seccompNative, seccompCompat, seccompX32 = func() (uint32, uint32, uint32) {
	switch runtime.GOARCH {
	case "amd64":
		return unix.AUDIT_ARCH_X86_64, unix.AUDIT_ARCH_I386, 0x40000000
	case "arm64":
		return unix.AUDIT_ARCH_AARCH64, unix.AUDIT_ARCH_ARM, 0
	}
	return 0, 0, 0
}()

// compatNr is a call's number on the 32-bit ABI of this build's
// architecture: i386 on amd64, ARM on arm64. The numbers are the kernel's
// (arch/x86/entry/syscalls/syscall_32.tbl, arch/arm/tools/syscall.tbl);
// x/sys/unix has only the native ones.
func compatNr(i386, arm uint32) uint32 {
	if runtime.GOARCH == "arm64" {
		return arm
	}
	return i386
}

// seccompList is the calls refused to a task holding the capabilities
// held.
func seccompList(held capSet) []seccompDenied {
	calls := []struct {
		seccompDenied
		// allowedBy are the capabilities that let a task make the call.
		allowedBy []int
	}{
		{seccompDenied{name: "keyctl", native: unix.SYS_KEYCTL, compat: compatNr(288, 311), errno: unix.EPERM}, nil},
		{seccompDenied{name: "add_key", native: unix.SYS_ADD_KEY, compat: compatNr(286, 309), errno: unix.EPERM}, nil},
		{seccompDenied{name: "request_key", native: unix.SYS_REQUEST_KEY, compat: compatNr(287, 310), errno: unix.EPERM}, nil},
		{seccompDenied{name: "bpf", native: unix.SYS_BPF, compat: compatNr(357, 386), errno: unix.EPERM},
			[]int{unix.CAP_BPF, unix.CAP_SYS_ADMIN}},
		{seccompDenied{name: "perf_event_open", native: unix.SYS_PERF_EVENT_OPEN, compat: compatNr(336, 364), errno: unix.EPERM},
			[]int{unix.CAP_PERFMON, unix.CAP_SYS_ADMIN}},
		{seccompDenied{name: "userfaultfd", native: unix.SYS_USERFAULTFD, compat: compatNr(374, 388), errno: unix.EPERM},
			[]int{unix.CAP_SYS_PTRACE}},
		{seccompDenied{name: "io_uring_setup", native: unix.SYS_IO_URING_SETUP, compat: compatNr(425, 425), errno: unix.ENOSYS}, nil},
		{seccompDenied{name: "io_uring_enter", native: unix.SYS_IO_URING_ENTER, compat: compatNr(426, 426), errno: unix.ENOSYS}, nil},
		{seccompDenied{name: "io_uring_register", native: unix.SYS_IO_URING_REGISTER, compat: compatNr(427, 427), errno: unix.ENOSYS}, nil},
	}
	out := make([]seccompDenied, 0, len(calls))
	for _, c := range calls {
		if !slices.ContainsFunc(c.allowedBy, held.has) {
			out = append(out, c.seccompDenied)
		}
	}
	return out
}

// usernsList is the calls that make or join a user namespace, refused to
// a task without SYS_ADMIN: clone and unshare with CLONE_NEWUSER (EPERM),
// clone3 (ENOSYS: its flags are in memory, which a filter cannot read; C
// libraries take ENOSYS as "use clone" and do), and setns (EPERM): a task
// that sees another process's user namespace it owns (pid_mode = "host",
// a namespace some program of the same user made) would join it and hold
// every capability there. setns is refused whatever its type: nstype 0
// means any, and without SYS_ADMIN the kernel refuses every other type to
// such a task anyway. A user namespace gives its maker every capability
// over the mounts, cgroups and network namespaces it makes there: the
// kernel interface most container escapes go through, and a way to mount
// the unified cgroup hierarchy of a hybrid host.
//
// These rules cannot sit on the launching thread: Go forks the task with
// clone3 when it places it in a cgroup v2 by descriptor, so they are
// installed by the task's own process, the seccomp stage, just before it
// execs the task's command (runSeccompStage, or stageEntry in the shim).
// The supervisor hands the stage the program of the whole list (stageFile),
// which the stage attaches unless it holds SYS_ADMIN itself.
func usernsList(held capSet) []seccompDenied {
	if held.has(unix.CAP_SYS_ADMIN) {
		return nil
	}
	return []seccompDenied{
		{name: "clone", native: unix.SYS_CLONE, compat: compatNr(120, 120), errno: unix.EPERM, argMask: unix.CLONE_NEWUSER},
		{name: "unshare", native: unix.SYS_UNSHARE, compat: compatNr(310, 337), errno: unix.EPERM, argMask: unix.CLONE_NEWUSER},
		{name: "clone3", native: unix.SYS_CLONE3, compat: compatNr(435, 435), errno: unix.ENOSYS},
		{name: "setns", native: unix.SYS_SETNS, compat: compatNr(346, 375), errno: unix.EPERM},
	}
}

// Offsets in struct seccomp_data: the call's number, its architecture,
// and the low 32 bits of its first argument (little-endian: amd64, arm64).
const (
	seccompDataNr   = 0
	seccompDataArch = 4
	seccompDataArg0 = 16
)

func bpfStmt(code uint16, k uint32) unix.SockFilter {
	return unix.SockFilter{Code: code, K: k}
}

func bpfJump(code uint16, k uint32, jt, jf uint8) unix.SockFilter {
	return unix.SockFilter{Code: code, Jt: jt, Jf: jf, K: k}
}

// seccompProgram builds the filter: by architecture, then one comparison
// per refused number, each answering its errno; everything else is
// allowed. A call of an architecture the filter does not know is refused
// with ENOSYS (none can occur on amd64 or arm64 but the three handled).
func seccompProgram(list []seccompDenied) ([]unix.SockFilter, error) {
	if seccompNative == 0 {
		return nil, fmt.Errorf("no seccomp filter for %s", runtime.GOARCH)
	}
	const (
		ld   = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
		jeq  = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
		jset = unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K
		ret  = unix.BPF_RET | unix.BPF_K
	)
	allow := bpfStmt(ret, unix.SECCOMP_RET_ALLOW)
	deny := func(e unix.Errno) unix.SockFilter {
		return bpfStmt(ret, unix.SECCOMP_RET_ERRNO|(uint32(e)&unix.SECCOMP_RET_DATA))
	}
	// One block per ABI: compare nr with each number, then allow.
	block := func(nr func(seccompDenied) uint32) []unix.SockFilter {
		var b []unix.SockFilter
		for _, d := range list {
			n := nr(d)
			if n == 0 {
				continue
			}
			if d.argMask == 0 {
				b = append(b, bpfJump(jeq, n, 0, 1), deny(d.errno))
				continue
			}
			// The number matched: the flags decide, and the filter ends.
			b = append(b, bpfJump(jeq, n, 0, 4), bpfStmt(ld, seccompDataArg0),
				bpfJump(jset, d.argMask, 0, 1), deny(d.errno), allow)
		}
		return append(b, allow)
	}
	native := block(func(d seccompDenied) uint32 { return d.native })
	if seccompX32 != 0 {
		// x32 calls are the native numbers with the x32 bit set, under
		// the native architecture.
		x32 := block(func(d seccompDenied) uint32 { return d.native | seccompX32 })
		native = append(native[:len(native)-1], x32...)
	}
	compat := block(func(d seccompDenied) uint32 { return d.compat })
	if len(native) > 250 || len(compat) > 250 {
		return nil, fmt.Errorf("seccomp filter too long for its jumps")
	}

	prog := []unix.SockFilter{
		bpfStmt(ld, seccompDataArch),
		// native: fall through into the native block after loading nr.
		bpfJump(jeq, seccompNative, 0, uint8(1+len(native))),
		bpfStmt(ld, seccompDataNr),
	}
	prog = append(prog, native...)
	prog = append(prog,
		// compat: load nr and go through its block; any other arch: ENOSYS.
		bpfJump(jeq, seccompCompat, 0, uint8(1+len(compat))),
		bpfStmt(ld, seccompDataNr),
	)
	prog = append(prog, compat...)
	prog = append(prog, deny(unix.ENOSYS))
	return prog, nil
}

// seccompFilter is the filter for a task holding the capabilities held,
// for attachProgram on the thread the task is forked from, which must have
// no_new_privs set (or CAP_SYS_ADMIN). Everything the thread forks or
// execs afterwards keeps it.
// With nothing to deny there is no filter.
func seccompFilter(held capSet) ([]unix.SockFilter, error) {
	list := seccompList(held)
	if len(list) == 0 {
		return nil, nil
	}
	return seccompProgram(list)
}

// installFilter attaches the program of list to the calling thread.
func installFilter(list []seccompDenied) error {
	if len(list) == 0 {
		return nil
	}
	prog, err := seccompProgram(list)
	if err != nil {
		return err
	}
	return attachProgram(prog)
}

// checkProgramLen refuses a program longer than the kernel takes.
func checkProgramLen(prog []unix.SockFilter) error {
	if len(prog) > unix.BPF_MAXINSNS {
		return fmt.Errorf("seccomp filter of %d instructions is longer than the kernel takes", len(prog))
	}
	return nil
}

// attachProgram attaches prog (none when empty) to the calling thread.
func attachProgram(prog []unix.SockFilter) error {
	if len(prog) == 0 {
		return nil
	}
	if err := checkProgramLen(prog); err != nil {
		return err
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if err := unix.Prctl(unix.PR_SET_SECCOMP, unix.SECCOMP_MODE_FILTER, uintptr(unsafe.Pointer(&fprog)), 0, 0); err != nil {
		return fmt.Errorf("failed to install the task's seccomp filter: %w", err)
	}
	runtime.KeepAlive(prog)
	return nil
}
