package executor

import (
	"io"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
)

// Profile is who a process of the task runs as and with what powers: the
// task's own process and every `nomad alloc exec` in it. It is kept in
// State, which the driver stores with Nomad, never in a file below the
// task's reach.
type Profile struct {
	User string `json:"user,omitempty"`
	// Credential is the user the driver resolved (an image task's, from
	// the image's /etc/passwd and /etc/group when the task started):
	// never looked up again in the task's root, which the task can write.
	Credential          *Credential `json:"credential,omitempty" codec:"credential,omitempty"`
	Privileged          bool        `json:"privileged,omitempty"`
	Capabilities        []string    `json:"capabilities,omitempty"`
	AmbientCapabilities []string    `json:"ambient_capabilities,omitempty"`
	// Isolated is set when the task has an Isolation: its execs get
	// no_new_privs and join its PID and IPC namespaces.
	Isolated    bool `json:"isolated,omitempty"`
	OOMScoreAdj int  `json:"oom_score_adj,omitempty"`
	// NetNS is set when the task runs in a network namespace of its own
	// (Spec.NetNS): its execs join it.
	NetNS bool `json:"net_ns,omitempty"`
}

// State is what Recover needs to take a running task back. It is stored in
// Nomad's TaskState for the task.
type State struct {
	SupervisorPID int `json:"supervisor_pid"`
	// SupervisorStart is the supervisor's start time in clock ticks since
	// boot (field 22 of /proc/PID/stat): it tells a live supervisor from a
	// reused PID.
	SupervisorStart uint64        `json:"supervisor_start"`
	TaskPID         int           `json:"task_pid"`
	TaskStart       uint64        `json:"task_start"`
	StateDir        string        `json:"state_dir"`
	Cgroup          cgroups.State `json:"cgroup"`
	StartedAt       time.Time     `json:"started_at"`
	// Profile is what `nomad alloc exec` runs with. A State written before
	// it was kept has none: Exec then refuses rather than guess.
	Profile *Profile `json:"profile,omitempty"`
}

// TerminalSize is a TTY size for Exec.
type TerminalSize struct {
	Height, Width int
}

// ExecOptions is a command to run inside a running task (nomad alloc exec).
type ExecOptions struct {
	Command []string
	Tty     bool
	Stdin   io.Reader
	Stdout  io.Writer
	Stderr  io.Writer
	Resize  <-chan TerminalSize
}
