package executor

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
)

// Files in Spec.StateDir.
const (
	specFile          = "spec.json"
	exitFile          = "exit.json"
	supervisorLogFile = "supervisor.log"
)

// supervisorReportFD is where the supervisor writes its one readyReport
// (ExtraFiles 0 of the supervisor).
const supervisorReportFD = 3

// readyReport is the supervisor's one line to Start: the task is running,
// or why it could not be started.
type readyReport struct {
	TaskPID   int           `json:"task_pid,omitempty"`
	TaskStart uint64        `json:"task_start,omitempty"`
	Cgroup    cgroups.State `json:"cgroup"`
	Error     string        `json:"error,omitempty"`
}

// runSupervisor is the supervisor stage: args are [StateDir], or nothing
// for a spare supervisor, which gets its state directory over the control
// socket (see Spares). It returns the supervisor's exit code.
func runSupervisor(args []string) int {
	logger := hclog.New(&hclog.LoggerOptions{
		Name:   "csi.supervisor",
		Level:  hclog.Debug,
		Output: os.Stderr,
	})
	var (
		stateDir string
		ctl      *os.File
		pre      *prebuilt
	)
	switch {
	case len(args) == 0 || (len(args) == 2 && args[0] == spareRootFlag):
		ctl = os.NewFile(supervisorControlFD, "control-socket")
		unix.CloseOnExec(supervisorControlFD)
		if len(args) == 2 {
			pre = prebuild(args[1])
		}
		warmUp()
		dir, err := awaitTask(ctl)
		if err != nil {
			logger.Error("spare supervisor got no task", "error", err)
			return 2
		}
		if dir == "" {
			// The driver went away or did not need this spare.
			return 0
		}
		stateDir = dir
	case len(args) == 1:
		stateDir = args[0]
	default:
		logger.Error("supervisor needs the state directory as its only argument", "args", args)
		return 2
	}

	// The task is stopped by signalling it, never the supervisor; these
	// are caught and dropped (not SIG_IGN, which the task would inherit).
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, unix.SIGINT, unix.SIGTERM, unix.SIGHUP, unix.SIGPIPE)
	go func() {
		for s := range sigs {
			logger.Debug("ignoring signal", "signal", s.String())
		}
	}()

	report := os.NewFile(supervisorReportFD, "report-pipe")
	if report == nil {
		logger.Error("supervisor started without its report pipe")
		return 2
	}
	unix.CloseOnExec(supervisorReportFD)
	sendReport := func(r readyReport) {
		b, _ := json.Marshal(r)
		if _, err := report.Write(append(b, '\n')); err != nil {
			logger.Warn("failed to report to the driver", "error", err)
		}
		// Never written again: a dead driver cannot hurt us through it.
		_ = report.Close()
	}

	var spec Spec
	if err := readJSON(filepath.Join(stateDir, specFile), &spec); err != nil {
		if pre != nil {
			pre.discard()
		}
		sendReport(readyReport{Error: fmt.Sprintf("failed to read the task spec: %v", err)})
		return 1
	}
	logger = logger.With("task_id", spec.TaskID)

	switch {
	case len(spec.LateMounts) > 0 && ctl == nil:
		ctl = os.NewFile(supervisorControlFD, "control-socket")
		unix.CloseOnExec(supervisorControlFD)
	case len(spec.LateMounts) == 0 && ctl != nil:
		_ = ctl.Close()
		ctl = nil
	}
	// The report goes out from the launching thread as soon as the task
	// runs (see launchTask).
	started := func(cmd *exec.Cmd, group *cgroups.Group) {
		start, err := procStartTime(cmd.Process.Pid)
		if err != nil {
			// The task already exited (and is a zombie we have not reaped,
			// so this is unexpected): report it anyway, Wait will tell.
			logger.Warn("failed to read the task's start time", "pid", cmd.Process.Pid, "error", err)
		}
		sendReport(readyReport{TaskPID: cmd.Process.Pid, TaskStart: start, Cgroup: group.State()})
	}
	cmd, group, left, err := startTask(&spec, ctl, started, pre)
	if ctl != nil {
		_ = ctl.Close()
	}
	if err != nil {
		logger.Error("failed to start task", "error", err)
		sendReport(readyReport{Error: err.Error()})
		return 1
	}
	logger.Info("task started", "pid", cmd.Process.Pid, "root_prepared_ahead", pre != nil && pre.used)
	if err := <-left; err != nil {
		logger.Warn("the launching thread failed to leave the task's cgroup; waiting for it to end", "error", err)
		waitThreadsLeft(group)
	}

	status := waitTask(logger, cmd, group)
	if err := writeJSONAtomic(filepath.Join(stateDir, exitFile), status, 0o600); err != nil {
		logger.Error("failed to record the exit status", "error", err)
		return 1
	}
	logger.Info("task exited", "exit_code", status.ExitCode, "signal", status.Signal, "oom_killed", status.OOMKilled)
	return 0
}

// startTask makes the task's cgroup and starts the task (see launchTask),
// with its late mounts from ctl, calling started as soon as it runs. It
// returns once the command runs. On error
// nothing is left: no process and no cgroup.
//
// The supervisor, not Start, makes the cgroup, so that everything the task
// owns is made and removed by the one process that outlives the driver.
func startTask(spec *Spec, ctl *os.File, started func(*exec.Cmd, *cgroups.Group), pre *prebuilt) (*exec.Cmd, *cgroups.Group, <-chan error, error) {
	if pre != nil {
		// Until launchTask takes it, an error leaves the thread to go.
		defer func() {
			if pre != nil {
				pre.discard()
			}
		}()
	}
	stdin, err := os.Open(os.DevNull)
	if err != nil {
		return nil, nil, nil, err
	}
	defer stdin.Close()
	stdout, err := openLog(spec.StdoutPath)
	if err != nil {
		return nil, nil, nil, err
	}
	defer stdout.Close()
	stderr, err := openLog(spec.StderrPath)
	if err != nil {
		return nil, nil, nil, err
	}
	defer stderr.Close()

	group, err := cgroups.Create(spec.CgroupParent, spec.cgroupName(), spec.Limits)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("failed to create the task's cgroup: %w", err)
	}
	taken := pre
	pre = nil
	cmd, left, err := launchTask(spec, group, []*os.File{stdin, stdout, stderr}, ctl,
		func(cmd *exec.Cmd) { started(cmd, group) }, taken)
	if err != nil {
		// Nothing was forked, so there is nothing to kill (and a kill could
		// hit this process while its launching thread is still in the
		// group and on its way out).
		if derr := group.Destroy(); derr != nil {
			err = errors.Join(err, derr)
		}
		return nil, nil, nil, err
	}
	return cmd, group, left, nil
}

// waitThreadsLeft waits, for a while, until no thread of this process is in
// the group, so that killing the group's processes cannot hit this one.
func waitThreadsLeft(group *cgroups.Group) {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		pids, err := group.Pids()
		if err != nil || !slices.Contains(pids, os.Getpid()) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// warmUp does, while a spare waits, the work of a first start that does
// not depend on the task: the JSON codecs of what it reads and writes are
// built on first use. A task's start then spends less CPU beside its
// volume calls.
func warmUp() {
	var spec Spec
	_ = json.Unmarshal([]byte(`{"mounts":[{}],"late_mounts":[{}],"limits":{}}`), &spec)
	var lm lateMessage
	_ = json.Unmarshal([]byte(`{"mounts":[{}]}`), &lm)
	_, _ = json.Marshal(readyReport{})
	_, _ = lastCap()
}

// logReaderWait bounds how long openLog waits for a reader on a log FIFO.
const logReaderWait = 10 * time.Second

// openLog opens one of Nomad's log FIFOs (or a file) for writing. A FIFO
// nobody reads is an error rather than a hang.
func openLog(path string) (*os.File, error) {
	if path == "" {
		return os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	}
	// Nomad's logmon opens the read side of its FIFOs in the background, so
	// right after it started there may be no reader yet: wait for one, for
	// a while, rather than block for ever or fail at once.
	deadline := time.Now().Add(logReaderWait)
	var fd int
	for {
		var err error
		fd, err = unix.Open(path, unix.O_WRONLY|unix.O_APPEND|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.ENXIO) {
			return nil, fmt.Errorf("failed to open log %q: %w", path, err)
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("failed to open log %q: no reader on the fifo after %s", path, logReaderWait)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := unix.SetNonblock(fd, false); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("failed to open log %q: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// waitTask waits for the task's main process, then kills what is left of
// its group, and says how it ended.
func waitTask(logger hclog.Logger, cmd *exec.Cmd, group *cgroups.Group) *ExitStatus {
	status := &ExitStatus{}
	state, err := cmd.Process.Wait()
	status.ExitedAt = time.Now().UTC()
	if err != nil {
		status.ExitCode = -1
		status.Err = fmt.Sprintf("failed to wait for the task: %v", err)
	} else if ws, ok := state.Sys().(syscall.WaitStatus); ok {
		switch {
		case ws.Signaled():
			status.Signal = int(ws.Signal())
			status.ExitCode = 128 + status.Signal
		default:
			status.ExitCode = ws.ExitStatus()
		}
	}
	oom, err := group.OOMKilled()
	if err != nil {
		logger.Warn("failed to check for an OOM kill", "error", err)
	}
	status.OOMKilled = oom
	if err := group.Kill(); err != nil {
		logger.Error("failed to kill the rest of the task's cgroup", "error", err)
		if status.Err == "" {
			status.Err = fmt.Sprintf("failed to kill the rest of the task: %v", err)
		}
	}
	return status
}
