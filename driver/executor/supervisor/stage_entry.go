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
// least the command's path and argv[0] after it) it does what
// runSeccompStage does, with system calls alone and no Go runtime: the Go
// runtime's start and the package initialisation of the supervisor's
// dependencies cost every task that is not privileged a few milliseconds,
// on the way to its start. In order:
//
//  1. prctl(PR_SET_DUMPABLE, 0) and close_range(3, ~0, CLOSE_RANGE_CLOEXEC),
//     as hardenStage;
//  2. maps the memory file at wire.SeccompEnvFD (private, copy on write)
//     and points an environment array at its entries;
//  3. unless capget says the stage holds CAP_SYS_ADMIN in its effective
//     set, attaches the file's filter (PR_SET_SECCOMP); no_new_privs is
//     set already, by the launching thread;
//  4. writes wire.SeccompReady and execs the command with the task's
//     environment. When the exec fails it writes wire.SeccompExecFailed
//     and the errno, and exits 127.
//
// Anything else (another argv[1], too few arguments) and any failure before
// the filter is attached (an older kernel without close_range, a malformed
// file) goes on to the Go runtime's own entry point with the process as the
// kernel made it (the stack pointer untouched): main runs, and
// RunReexec starts the supervisor or runs the stage in Go, which repeats
// the steps (each can be repeated) and says what failed.
//
// It is never called from Go.
func stageEntry()

// Read by stageEntry, statically initialised (no Go code has run when it
// reads them).
var (
	// stageArg is argv[1] of the seccomp stage, NUL-terminated.
	stageArg = wire.StageSeccomp + "\x00"
	// stageReady and stageExecFailed are what the stage writes on its
	// error pipe.
	stageReady      = wire.SeccompReady
	stageExecFailed = wire.SeccompExecFailed
	// stageScratch is stageEntry's memory for the capget header and data
	// (32 bytes), the filter's struct sock_fprog (16) and the failed
	// exec's message (3).
	stageScratch [8]uint64
)
