package executor

import (
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// The kernel's bounds on what execve copies to the new program's stack
// (fs/exec.c): each string, its NUL included, at most maxArgStrlen
// (MAX_ARG_STRLEN, 32 pages); all of them and a pointer for each at most a
// quarter of the stack's soft limit, capped at three quarters of _STK_LIM
// and never under ARG_MAX (32 pages).
const (
	maxArgStrlen = 32 * 4096
	minArgMax    = 32 * 4096
	maxArgMax    = 8 << 20 / 4 * 3
	// execPathRoom is kept for the file name execve copies too: the
	// resolved path of the command, at most PATH_MAX.
	execPathRoom = 4096
)

// argMax is how many bytes of strings and pointers the kernel lets execve
// hand a program started from this process (a task's supervisor and its
// seccomp stage inherit its stack limit).
func argMax() int {
	var rl unix.Rlimit
	limit := maxArgMax
	if err := unix.Getrlimit(unix.RLIMIT_STACK, &rl); err == nil && rl.Cur != unix.RLIM_INFINITY && rl.Cur/4 < uint64(limit) {
		limit = int(rl.Cur / 4)
	}
	return max(limit, minArgMax)
}

// CheckArgv says, naming the field, when the kernel would refuse to run
// spec's command with its arguments and environment ("argument list too
// long"): a string longer than it copies, or all of them past argMax; or
// one that holds a NUL byte, as the working directory may not. It is
// checked before anything is set up for the task.
func CheckArgv(spec *Spec) error {
	const hint = "pass larger data in a file (a template under local/)"
	// A NUL ends a string for the kernel: execve refuses the command or
	// an argument that holds one (EINVAL, from the seccomp stage), and a
	// variable would reach the task cut short at it.
	const nul = "holds a NUL byte, which the kernel cannot pass (it ends a string there): remove it"
	if strings.IndexByte(spec.Command, 0) >= 0 {
		return fmt.Errorf("command %s", nul)
	}
	for i, a := range spec.Args {
		if strings.IndexByte(a, 0) >= 0 {
			return fmt.Errorf("args[%d] %s", i, nul)
		}
	}
	for _, e := range spec.Env {
		if strings.IndexByte(e, 0) >= 0 {
			k, _, _ := strings.Cut(e, "=")
			return fmt.Errorf("env %q %s", k, nul)
		}
	}
	if strings.IndexByte(spec.Dir, 0) >= 0 {
		// chdir(2) takes no such path either; the start would fail at
		// it, after the task's volumes were set up.
		return fmt.Errorf("work_dir %s", nul)
	}
	if n := len(spec.Command) + 1; n > maxArgStrlen {
		return fmt.Errorf("command is %d bytes: the kernel passes at most %d bytes in one argument", n-1, maxArgStrlen-1)
	}
	total := execPathRoom + len(spec.Command) + 1
	for i, a := range spec.Args {
		if len(a)+1 > maxArgStrlen {
			return fmt.Errorf("args[%d] is %d bytes: the kernel passes at most %d bytes in one argument; %s", i, len(a), maxArgStrlen-1, hint)
		}
		total += len(a) + 1
	}
	for _, e := range spec.Env {
		if len(e)+1 > maxArgStrlen {
			k, _, _ := strings.Cut(e, "=")
			return fmt.Errorf("env %q is %d bytes: the kernel passes at most %d bytes in one variable (KEY=value); %s", k, len(e), maxArgStrlen-1, hint)
		}
		total += len(e) + 1
	}
	total += (1 + len(spec.Args) + len(spec.Env)) * 8
	if limit := argMax(); total > limit {
		return fmt.Errorf("args and env take %d bytes (%d arguments, %d variables, with a pointer each): the kernel passes at most %d to a command (a quarter of the stack limit, ulimit -s, at most %d); %s",
			total, len(spec.Args), len(spec.Env), limit, maxArgMax, hint)
	}
	return nil
}
