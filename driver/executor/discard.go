package executor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// recordSupervisor writes the supervisor record of a task's state
// directory. pid is the caller's unreaped child, so its start time names
// it; a supervisor that already exited is recorded as gone (start 0).
func recordSupervisor(stateDir string, pid int) error {
	start, _ := wire.ProcStartTime(pid)
	return wire.WriteJSON(filepath.Join(stateDir, wire.SupervisorFile), wire.SupervisorRecord{PID: pid, Start: start}, 0o600, false)
}

// discardWait bounds how long Discard waits for a killed supervisor.
var discardWait = 10 * time.Second

// Discard ends a task Nomad has no handle for and never recovers or
// destroys (a start the driver died in before it handed the task over, an
// earlier start of a task Nomad starts anew, a dangling task) from what is
// in its stateDir: the supervisor first, so that it starts nothing more,
// then every process in the task's cgroup; the cgroup and stateDir are
// removed. It logs what it ended, not why: the caller says that. It needs only the files Start writes before the
// supervisor runs (spec.json, supervisor.json), and is idempotent: a
// directory that is gone, one where nothing was started, or one whose spec
// or supervisor record a crash of the host cut (nothing of it runs since
// the boot), is removed without error.
func Discard(logger hclog.Logger, stateDir string) error {
	var spec Spec
	err := wire.ReadJSON(filepath.Join(stateDir, wire.SpecFile), &spec)
	if errors.Is(err, fs.ErrNotExist) {
		// Start writes the spec before it starts anything.
		return removeStateDir(stateDir)
	}
	var cut *json.SyntaxError
	if errors.As(err, &cut) && writtenBeforeBoot(filepath.Join(stateDir, wire.SpecFile)) {
		// Start renames a whole spec into place, unsynced: one cut short
		// (empty, part of it, zeros) and written before the host last
		// booted is what a crash of the host left, and nothing started
		// from it outlived the host, its cgroup neither (a supervisor
		// record from before the boot names another process, if any). A
		// cut spec of this boot is not guessed at.
		logger.Info("discarded a task whose spec a crash of the host cut", "state_dir", stateDir)
		return removeStateDir(stateDir)
	}
	if err != nil {
		return fmt.Errorf("failed to discard task in %q: %w", stateDir, err)
	}
	logger = logger.Named("executor").With("task_id", spec.TaskID)
	var rec wire.SupervisorRecord
	recPath := filepath.Join(stateDir, wire.SupervisorFile)
	if err := wire.ReadJSON(recPath, &rec); err == nil {
		if err := killSupervisor(rec); err != nil {
			return fmt.Errorf("failed to discard task %q: %w", spec.TaskID, err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) && !(errors.As(err, &cut) && writtenBeforeBoot(recPath)) {
		// A record cut before the host booted (it is not synced either)
		// names a supervisor that died with the host.
		return fmt.Errorf("failed to discard task %q: %w", spec.TaskID, err)
	}
	if err := endTaskGroup(&spec); err != nil {
		return fmt.Errorf("failed to discard task %q: %w", spec.TaskID, err)
	}
	logger.Info("ended the processes of a task Nomad has no handle for and removed its state directory", "state_dir", stateDir)
	return removeStateDir(stateDir)
}

// endTaskGroup kills what is in the cgroup spec's task was given, if it
// has one, and removes it, once its supervisor is gone: nothing adds to
// the group any more, and a task in the host's PID namespace (or a seccomp
// stage that still waits for its go-ahead) outlives its supervisor.
func endTaskGroup(spec *Spec) error {
	group, err := cgroups.Find(spec.CgroupParent, spec.GroupName(), spec.Limits)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return err
	}
	if err := group.Kill(); err != nil {
		return err
	}
	return group.Destroy()
}

// killSupervisor kills the supervisor rec names, if it still runs, and
// waits for it to exit. A supervisor that is init of the task's PID
// namespace takes the task with it.
func killSupervisor(rec wire.SupervisorRecord) error {
	fd := openVerifiedPidfd(rec.PID, rec.Start)
	if fd < 0 {
		return nil
	}
	defer unix.Close(fd)
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("failed to kill supervisor pid %d: %w", rec.PID, err)
	}
	deadline := time.Now().Add(discardWait)
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return fmt.Errorf("supervisor pid %d did not exit within %s of SIGKILL", rec.PID, discardWait)
		}
		n, err := unix.Poll(fds, int(left.Milliseconds())+1)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("failed to wait for supervisor pid %d: %w", rec.PID, err)
		}
		if n > 0 {
			return nil
		}
	}
}

// StartedTaskID is the task ID of the spec a start wrote in stateDir; ""
// when it wrote none (nothing was started from the directory).
func StartedTaskID(stateDir string) (string, error) {
	var spec Spec
	err := wire.ReadJSON(filepath.Join(stateDir, wire.SpecFile), &spec)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return spec.TaskID, nil
}

// ReadSpec reads the spec a start wrote in stateDir.
func ReadSpec(stateDir string) (Spec, error) {
	var spec Spec
	err := wire.ReadJSON(filepath.Join(stateDir, wire.SpecFile), &spec)
	return spec, err
}

// writtenBeforeBoot tells whether the file at path was last changed before
// the host booted (btime in /proc/stat); false when either is unknown.
func writtenBeforeBoot(path string) bool {
	fi, err := os.Stat(path)
	if err != nil {
		return false
	}
	boot, err := bootTime()
	return err == nil && fi.ModTime().Before(boot)
}

// bootTime is when the host booted, to the second; a variable for tests.
var bootTime = func() (time.Time, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return time.Time{}, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "btime "); ok {
			sec, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err != nil {
				return time.Time{}, fmt.Errorf("failed to read the boot time: %w", err)
			}
			return time.Unix(sec, 0), nil
		}
	}
	return time.Time{}, errors.New("failed to read the boot time: no btime in /proc/stat")
}

func removeStateDir(dir string) error {
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("failed to remove state dir %q: %w", dir, err)
	}
	return nil
}
