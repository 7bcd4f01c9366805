//go:build linux && (amd64 || arm64)

// The shim's entry point and what it reads: used by the linker (-E) and
// the assembly alone.
//
//lint:file-ignore U1000 stageEntry is an entry point, and these variables are read by its assembly

package supervisor

import "github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"

// StageEntrySymbol is the linker's name of stageEntry. The shim is built
// with it as its entry point (go build -ldflags "-E ..."; see the
// GNUmakefile), so that a task's seccomp stage runs before the Go runtime
// starts; any other program with this package (the driver, tests) starts
// as Go programs do and runs the stage in Go (runSeccompStage).
const StageEntrySymbol = "github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor.stageEntry"

// stageEntry is the first code the shim runs (stage_entry_$GOARCH.s). When
// the shim is the seccomp stage (argv[1] is wire.StageSeccomp, with at
// least the command's argv[0] after it) it does what runSeccompStage does,
// with system calls alone and no Go runtime: the Go runtime's start and
// the package initialisation of the supervisor's dependencies cost every
// task that is not privileged a few milliseconds. In order:
//
//  1. prctl(PR_SET_DUMPABLE, 0) and close_range(3, ~0, CLOSE_RANGE_CLOEXEC),
//     as hardenStage;
//  2. maps the memory file at wire.SeccompEnvFD (private, copy on write),
//     finds its two filters and points an environment array at its
//     entries;
//  3. attaches the task's filter (PR_SET_SECCOMP) and, unless capget says
//     the stage holds CAP_SYS_ADMIN in its effective set, the user
//     namespace rules; no_new_privs is set already, by the launching
//     thread;
//  4. waits for its go-ahead on wire.SeccompGoFD (EOF: exits 127), puts
//     its three descriptors on stdin, stdout and stderr, and changes to
//     its working directory, unless empty;
//  5. writes wire.SeccompReady and execs the go-ahead's path with the
//     argv after argv[1] and the task's environment. When the exec fails
//     it writes wire.SeccompExecFailed and the errno, and exits 127.
//
// Anything else (another argv[1], too few arguments) and any failure before
// the wait (an older kernel without close_range, a malformed file) goes on
// to the Go runtime's own entry point with the process as the kernel made
// it (the stack pointer untouched): main runs, and RunReexec starts the
// supervisor or runs the stage in Go, which repeats the steps (a filter
// attached twice denies what it denied once) and says what failed. A
// failure from the wait on is told with its marker (wire.SeccompGoFailed,
// wire.SeccompChdirFailed) and the errno, and ends the stage: the go-ahead
// cannot be taken twice.
//
// It is never called from Go.
func stageEntry()

// Read by stageEntry, statically initialised (no Go code has run when it
// reads them).
var (
	// stageArg is argv[1] of the seccomp stage, NUL-terminated.
	stageArg = wire.StageSeccomp + "\x00"
	// stageReady and the failure markers are what the stage writes on its
	// error pipe.
	stageReady       = wire.SeccompReady
	stageExecFailed  = wire.SeccompExecFailed
	stageChdirFailed = wire.SeccompChdirFailed
	stageGoFailed    = wire.SeccompGoFailed
	// stageScratch is stageEntry's memory for the capget header and data
	// (32 bytes), the two filters' struct sock_fprog (16 each), a failure's
	// message (3, at 64), and the go-ahead's struct msghdr (56, at 72),
	// struct iovec (16, at 128) and control buffer (32, at 144): the
	// offsets are in the assembly.
	stageScratch [22]uint64
	// stageGoAhead receives the go-ahead's message.
	stageGoAhead [wire.SeccompGoMax]byte
)
