package wire

import "github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"

// Subcommands (os.Args[1]) that make a program run as a supervisor or as
// the exec stage: see supervisor.RunReexec.
const (
	StageSupervisor = "__nomad-driver-csi-supervisor"
	StageExec       = "__nomad-driver-csi-exec"
	// StageSeccomp is the first program of a task that is not privileged:
	// the supervisor's own binary, run as the task (in its namespaces,
	// cgroup and credentials), which attaches the task's seccomp filters,
	// waits for its go-ahead (SeccompGoFD) and execs the task's command:
	// argv = [command, StageSeccomp, command, args...]. It is forked
	// before the task's volumes come, so that their arrival is followed
	// by the command's exec alone.
	StageSeccomp = "__nomad-driver-csi-seccomp"
)

// File descriptors of the seccomp stage (ExtraFiles 0 to 3). The stage
// itself runs with an empty environment: the task's (which may name
// LD_PRELOAD, or GODEBUG) is only handed to the command.
const (
	SeccompExeFD = 3 // the supervisor's binary, which the stage was run from
	// SeccompErrorFD is written SeccompReady just before the exec, and
	// after it why the exec failed; EOF at exec (CLOEXEC). EOF with nothing
	// written means the stage ended before it got to the exec.
	SeccompErrorFD = 4
	// SeccompEnvFD is a sealed memory file, read from offset 0: two
	// classic BPF programs, each a little-endian uint64 n and n
	// instructions (struct sock_filter, 8 bytes each): the task's filter,
	// which the stage always attaches, and the user namespace rules, which
	// it adds unless it holds CAP_SYS_ADMIN; then the task's environment as
	// NUL-terminated entries to the end of the file.
	SeccompEnvFD = 5
	// SeccompGoFD is a SOCK_SEQPACKET socket on which the stage, its
	// filters attached, waits for one message: the working directory and
	// the command's path, each NUL-terminated (an empty directory: stay),
	// with exactly three descriptors (SCM_RIGHTS), the command's stdin,
	// stdout and stderr. EOF instead: the stage exits 127 and writes
	// nothing.
	SeccompGoFD = 6
)

// SeccompGoMax bounds the go-ahead's message: a directory and a path of
// up to PATH_MAX bytes each.
const SeccompGoMax = 8192

// SeccompReady is the byte the seccomp stage writes just before its exec.
const SeccompReady = "\x00"

// SeccompChdirFailed, written instead of SeccompReady, says the stage could
// not change to the working directory; the errno follows as two bytes,
// little-endian.
const SeccompChdirFailed = "\x02"

// SeccompGoFailed, written instead of SeccompReady, says the stage could
// not take its go-ahead (a failed receive, or a message not as
// SeccompGoFD says: EINVAL); the errno follows as two bytes,
// little-endian.
const SeccompGoFailed = "\x03"

// SeccompExecFailed, after SeccompReady, says the stage's exec failed; the
// errno follows as two bytes, little-endian. The stage that runs before
// the Go runtime (a shim built with its entry point, see
// supervisor.StageEntrySymbol) says it so; the Go stage writes the
// message itself.
const SeccompExecFailed = "\x01"

// File descriptors of the exec stage (ExtraFiles 0 to 3, and 4 with a
// terminal).
const (
	StageConfigFD = 3 // read: one StageConfig as JSON
	StageErrorFD  = 4 // write: an error message, or EOF at exec (CLOEXEC)
	StageTaskFD   = 5 // a pidfd of the task, whose mount namespace the stage enters
	// StageExeFD is the driver's binary on a read-only clone of its mount
	// (mounter.OpenSealed), which the stage is exec'd from
	// (/proc/self/fd/6): never the host's file, which a command the stage
	// runs as /proc/self/exe would otherwise be.
	StageExeFD = 6
	// StageTtyFD, given when StageConfig.Tty is set, is a SOCK_SEQPACKET
	// socket on which the stage sends one byte with exactly one descriptor
	// (SCM_RIGHTS): the multiplexer of the terminal it took from the
	// task's devpts (its /dev/pts/ptmx) and made the command's stdin,
	// stdout, stderr and controlling terminal. It is sent before the exec
	// (and before the stage's error pipe says anything).
	StageTtyFD = 7
)

// StageNoTerminal begins the exec stage's error when the task's devpts
// gives it no terminal (ENOSPC): the driver then reads, on the host, which
// bound was reached (the devpts's max= or the node's kernel.pty.max) and
// says so instead.
const StageNoTerminal = "no terminal left in the task's /dev/pts"

// Files in Spec.StateDir.
const (
	SpecFile = "spec.json"
	// ExitFile is reserved by the start and written in place by the
	// supervisor (exit.go); an older supervisor renames a new file over
	// it, which reads alike.
	ExitFile          = "exit.json"
	SupervisorLogFile = "supervisor.log"
	// SupervisorFile names the supervisor (SupervisorRecord) from the
	// moment it runs, so that a start cut short can still be ended.
	SupervisorFile = "supervisor.json"
)

// ReportFD is where the supervisor writes its one ReadyReport
// (ExtraFiles 0 of the supervisor).
const ReportFD = 3

// ReadyReport is the supervisor's one line to Start: the task is running,
// or why it could not be started.
type ReadyReport struct {
	TaskPID   int           `json:"task_pid,omitempty"`
	TaskStart uint64        `json:"task_start,omitempty"`
	Cgroup    cgroups.State `json:"cgroup"`
	Error     string        `json:"error,omitempty"`
}

// ControlFD is the supervisor's end of the socket over which
// Start hands it the late mounts (ExtraFiles 1 of the supervisor, present
// only when the spec has late mounts).
const ControlFD = 4

// GoTokenFD is where a supervisor started for its task finds its go token
// (ExtraFiles 2 of the supervisor); a spare gets the token with its
// SpareHello, as SCM_RIGHTS. The token is the read end of a pipe that holds
// one byte (GoToken) and whose write end Start closed before handing it
// over, so a read of it never blocks. Start keeps a read end of its own.
// The supervisor takes the byte as the very last step before the task's
// command may run (the seccomp stage's go-ahead, or the fork of a
// privileged command), and lets the command run only when it got it; Start
// takes it when its wait for the report ends without one. Exactly one of
// them gets it: a start Start gave up on never runs its command. When the
// supervisor got it, Start waits once more for the report, and kills the
// supervisor and the task's cgroup when none comes.
const GoTokenFD = 5

// GoToken is the byte of the go token.
const GoToken = 'g'

// LateMessage is what Start sends the supervisor once the late mounts are
// ready: the mounts, in Spec.LateMounts' order and with its targets, and
// their trees (mounter.CloneTree of each Source) attached as SCM_RIGHTS in
// the same order. With Error set there is nothing else and the task must
// not start.
type LateMessage struct {
	Mounts []Mount `json:"mounts,omitempty"`
	Error  string  `json:"error,omitempty"`
}

// LateMessageMax bounds a LateMessage on the socket.
const LateMessageMax = 64 << 10

// StageConfig is what the exec stage is told over its config pipe. The
// stage starts in the task's PID and IPC namespaces but the host's mount
// namespace: it joins the task's cgroup there, then the task's mount
// namespace.
type StageConfig struct {
	Spec   Spec           `json:"spec"`
	Cgroup *cgroups.State `json:"cgroup,omitempty"`
	// Isolated gives the command no_new_privs, as the task has.
	Isolated bool `json:"isolated,omitempty"`
	// Tty gives the command a terminal of the task's own devpts (see
	// StageTtyFD).
	Tty bool `json:"tty,omitempty"`
}

// SpareRootFlag, with a directory after it, makes a spare supervisor
// prepare a task's root there ahead of its task.
const SpareRootFlag = "--spare-root"

// SpareGroup, as JSON after a spare's isolation, makes a spare supervisor
// make its task's cgroup ahead (cgroups.CreateAhead): Name under Parent,
// with Limits, until a task claims it. On cgroup v2 none is made.
type SpareGroup struct {
	Parent string         `json:"parent"`
	Name   string         `json:"name"`
	Limits cgroups.Limits `json:"limits"`
}

// SpareGroupPrefix begins the name of every group made ahead, which no
// task's group has (a task's is named after Nomad's task ID, which begins
// with the allocation's UUID).
const SpareGroupPrefix = "ncsi-spare-"

// SpareHello is the first message a spare supervisor gets, with the task's
// go token (see GoTokenFD) attached as SCM_RIGHTS, its one descriptor: a
// spare refuses a message with none or more.
type SpareHello struct {
	StateDir string `json:"state_dir"`
}

// SupervisorRecord names a supervisor for good: its PID and its start time.
type SupervisorRecord struct {
	PID   int    `json:"pid"`
	Start uint64 `json:"start"`
}
