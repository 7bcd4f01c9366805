package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

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
		// ahead is the group a spare made for its task ahead, until the
		// task claims it (see startTask); removed on the way out when
		// it did not.
		ahead *cgroups.Ahead
		// token is the task's go token (wire.GoTokenFD).
		token *os.File
	)
	defer func() {
		if err := ahead.Destroy(); err != nil {
			logger.Warn("failed to remove the cgroup made ahead", "error", err)
		}
	}()
	// The task is stopped by signalling it, never the supervisor: every
	// signal is caught and dropped (not SIG_IGN, which the task would
	// inherit). In a PID namespace of the task's, the supervisor is its
	// init, and a signal the task may send it must not end it. Set up
	// first, so that a spare does it while it waits (about 0.8 ms on
	// these machines, a handler for every signal), not once its task came.
	// A spare is stopped with SIGKILL, and ends by itself when the driver
	// closes its control socket.
	// Each kind is logged once: a root task (with kill) can send its
	// init signals as fast as it likes, and a line for each would grow
	// the supervisor's log, in the driver's root_dir, without bound.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs)
	go func() {
		logged := map[os.Signal]bool{}
		for s := range sigs {
			// The runtime's preemption signal and the children's exits are
			// the supervisor's daily life, not news.
			if s != unix.SIGURG && s != unix.SIGCHLD && !logged[s] {
				logged[s] = true
				logger.Debug("ignoring signal (logged once per kind)", "signal", s.String())
			}
		}
	}()

	// A supervisor started for its task finds its go token at GoTokenFD,
	// taken before the supervisor opens anything: without one that number
	// is free, and a file opened below would take it.
	var inherited *os.File
	if len(args) == 1 {
		inherited = inheritedToken()
	}

	// The host's root, for what the supervisor reads of its task in the
	// host's /proc (the launching thread's own /proc is the task's by then,
	// in the task's PID namespace) and for the host's cgroup file systems.
	if err := openHostRoot(); err != nil {
		logger.Error("failed to open the host's root", "error", err)
		return 2
	}
	// The supervisor's binary, which starts a task that is not privileged
	// (wire.StageSeccomp); opened now, while /proc/self is the host's.
	// Through a read-only clone of its mount (mounter.OpenSealed): the
	// stage runs as the task and is its /proc/<pid>/exe, and so is any
	// command the task names /proc/self/exe (or whose script's interpreter
	// is), which the stage's exec resolves to this very file. Opened on
	// the host's mount, that link would hand a root task the host's binary
	// to chmod (setuid, or mode 0 so that no task starts), to give file
	// capabilities or to overwrite once no supervisor runs it; on the
	// clone every such change fails with EROFS.
	exe, err := mounter.OpenSealed(mounter.New(), "/proc/self/exe")
	if err != nil {
		logger.Error("failed to open the supervisor's binary", "error", err)
		return 2
	}
	selfExe = exe
	switch {
	case len(args) == 0 || (len(args) >= 2 && args[0] == wire.SpareRootFlag):
		ctl = os.NewFile(wire.ControlFD, "control-socket")
		unix.CloseOnExec(wire.ControlFD)
		if len(args) >= 2 {
			var iso *wire.Isolation
			if len(args) >= 3 {
				iso = new(wire.Isolation)
				if err := json.Unmarshal([]byte(args[2]), iso); err != nil {
					logger.Error("spare supervisor got a bad isolation", "error", err)
					return 2
				}
			}
			pre = prebuild(args[1], iso)
			if len(args) == 4 {
				var sg wire.SpareGroup
				if err := json.Unmarshal([]byte(args[3]), &sg); err != nil {
					logger.Error("spare supervisor got a bad cgroup to make ahead", "error", err)
					return 2
				}
				// While the launching thread builds the root.
				var err error
				if ahead, err = cgroups.CreateAhead(sg.Parent, sg.Name, sg.Limits); err != nil {
					logger.Debug("no cgroup made ahead", "error", err)
				}
			}
		}
		warmUp()
		dir, tok, err := awaitTask(ctl)
		if err != nil {
			logger.Error("spare supervisor got no task", "error", err)
			return 2
		}
		if dir == "" {
			// The driver went away or did not need this spare.
			return 0
		}
		stateDir, token = dir, tok
	case len(args) == 1:
		stateDir = args[0]
		token = inherited
	default:
		logger.Error("supervisor needs the state directory as its only argument", "args", args)
		return 2
	}

	report := os.NewFile(wire.ReportFD, "report-pipe")
	if report == nil {
		logger.Error("supervisor started without its report pipe")
		return 2
	}
	unix.CloseOnExec(wire.ReportFD)
	sendReport := func(r wire.ReadyReport) {
		b, _ := json.Marshal(r)
		if _, err := report.Write(append(b, '\n')); err != nil {
			logger.Warn("failed to report to the driver", "error", err)
		}
		// Never written again: a dead driver cannot hurt us through it.
		_ = report.Close()
	}

	var spec wire.Spec
	if err := wire.ReadJSON(filepath.Join(stateDir, wire.SpecFile), &spec); err != nil {
		if pre != nil {
			pre.discard()
		}
		sendReport(wire.ReadyReport{Error: fmt.Sprintf("failed to read the task spec: %v", err)})
		return 1
	}
	logger = logger.With("task_id", spec.TaskID)

	switch {
	case len(spec.LateMounts) > 0 && ctl == nil:
		ctl = os.NewFile(wire.ControlFD, "control-socket")
		unix.CloseOnExec(wire.ControlFD)
	case len(spec.LateMounts) == 0 && ctl != nil:
		_ = ctl.Close()
		ctl = nil
	}
	// The report goes out from the launching thread as soon as the task
	// runs (see launchTask).
	started := func(cmd *exec.Cmd, group *cgroups.Group) {
		pid, err := hostPID(cmd.Process.Pid)
		if err != nil {
			logger.Error("failed to find the task's host pid", "pid", cmd.Process.Pid, "error", err)
			killStarted(cmd)
			sendReport(wire.ReadyReport{Error: err.Error()})
			return
		}
		start, err := hostProcStartTime(pid)
		if err != nil {
			// The task already exited (and is a zombie we have not reaped,
			// so this is unexpected): report it anyway, Wait will tell.
			logger.Warn("failed to read the task's start time", "pid", pid, "error", err)
		}
		sendReport(wire.ReadyReport{TaskPID: pid, TaskStart: start, Cgroup: group.State()})
	}
	taken := ahead
	ahead = nil
	cmd, group, left, err := startTask(logger, &spec, ctl, func() error { return claimGo(token) }, started, pre, taken)
	if ctl != nil {
		_ = ctl.Close()
	}
	if err != nil {
		logger.Error("failed to start task", "error", err)
		sendReport(wire.ReadyReport{Error: err.Error()})
		return 1
	}
	if pre != nil && !pre.used {
		logger.Info("the root prepared ahead did not serve", "reason", pre.why)
	}
	logger.Info("task started", "pid", cmd.Process.Pid, "root_prepared_ahead", pre != nil && pre.used)
	if err := <-left; err != nil {
		logger.Warn("the launching thread failed to leave the task's cgroup; waiting for it to end", "error", err)
		waitThreadsLeft(group)
	}

	status := waitTask(logger, cmd, group)
	// In place, into the file the start reserved: a full file system
	// (another task may have filled it) must not lose the exit status.
	if err := wire.WriteExit(filepath.Join(stateDir, wire.ExitFile), status); err != nil {
		logger.Error("failed to record the exit status", "error", err)
		return 1
	}
	logger.Info("task exited", "exit_code", status.ExitCode, "signal", status.Signal, "oom_killed", status.OOMKilled,
		"pids_limited", status.PidsLimited)
	return 0
}

// startTask makes the task's cgroup and starts the task (see launchTask),
// with its late mounts from ctl, calling started as soon as it runs, and
// claim right before it may run (see launchTask). It returns once the
// command runs. On error nothing is left: no process and no cgroup.
//
// The supervisor, not Start, makes the cgroup, so that everything the task
// owns is made and removed by the one process that outlives the driver.
func startTask(logger hclog.Logger, spec *wire.Spec, ctl *os.File, claim func() error, started func(*exec.Cmd, *cgroups.Group), pre *prebuilt, ahead *cgroups.Ahead) (*exec.Cmd, *cgroups.Group, <-chan error, error) {
	if pre != nil {
		// Until launchTask takes it, an error leaves the thread to go.
		defer func() {
			if pre != nil {
				pre.discard()
			}
		}()
	}
	// The task's output is opened only once it is about to run: Nomad's
	// log collector stops reading a FIFO for good once its last writer
	// closes it, so a supervisor that dies waiting for its mounts (its
	// driver died) must not have opened it, or the start Nomad retries
	// writes its output into a pipe nobody reads.
	var opened []*os.File
	defer func() {
		for _, f := range opened {
			_ = f.Close()
		}
	}()
	stdio := func() ([]*os.File, error) {
		if opened != nil {
			return opened, nil
		}
		type result struct {
			files []*os.File
			err   error
		}
		ch := make(chan result, 1)
		// On a thread of its own: the caller may have entered the task's
		// root, where the log paths are not.
		go func() {
			var r result
			r.files, r.err = openStdio(spec)
			ch <- r
		}()
		r := <-ch
		if r.err != nil {
			return nil, r.err
		}
		opened = r.files
		return opened, nil
	}

	group, err := claimGroup(logger, spec, ahead)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("failed to create the task's cgroup: %w", err)
	}
	taken := pre
	pre = nil
	cmd, left, err := launchTask(spec, group, stdio, ctl, claim,
		func(cmd *exec.Cmd) { started(cmd, group) }, taken)
	if err != nil {
		err = pidsRefusedStart(spec, group, err)
		// Nothing forked is left (launchTask killed and reaped a seccomp
		// stage it forked), so there is nothing to kill (and a kill could
		// hit this process while its launching thread is still in the
		// group and on its way out).
		if derr := group.Destroy(); derr != nil {
			err = errors.Join(err, derr)
		}
		return nil, nil, nil, err
	}
	return cmd, group, left, nil
}

// claimGroup is the task's cgroup: the one made ahead when it fits the
// task, else one made now (the one made ahead is then removed).
func claimGroup(logger hclog.Logger, spec *wire.Spec, ahead *cgroups.Ahead) (*cgroups.Group, error) {
	if ahead != nil {
		g, err := ahead.Claim(spec.CgroupParent, spec.GroupName(), spec.Limits)
		if err == nil {
			logger.Debug("the task took the cgroup made ahead")
			return g, nil
		}
		if errors.Is(err, cgroups.ErrUnfit) {
			logger.Debug("the cgroup made ahead does not serve", "reason", err)
		} else {
			logger.Warn("failed to claim the cgroup made ahead; making one", "error", err)
		}
		if err := ahead.Destroy(); err != nil {
			logger.Warn("failed to remove the cgroup made ahead", "error", err)
		}
	}
	return cgroups.Create(spec.CgroupParent, spec.GroupName(), spec.Limits)
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
	var spec wire.Spec
	_ = json.Unmarshal([]byte(`{"mounts":[{}],"late_mounts":[{}],"limits":{}}`), &spec)
	var lm wire.LateMessage
	_ = json.Unmarshal([]byte(`{"mounts":[{}]}`), &lm)
	_, _ = json.Marshal(wire.ReadyReport{})
	_, _ = lastCap()
}

// hostRoot is a handle on the host's root directory, opened when the
// supervisor starts, for a launching thread that entered the task's root
// before its task came (see prebuilt).
var hostRoot = -1

// selfExe is the supervisor's binary (read-only, on a read-only clone of
// its mount, close-on-exec), for the seccomp stage.
var selfExe *os.File

func openHostRoot() error {
	fd, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	hostRoot = fd
	return nil
}

// hostRootPath is a path that stands for the host's root directory on any
// thread of the supervisor whose root has /proc.
func hostRootPath() string { return fmt.Sprintf("/proc/self/fd/%d", hostRoot) }

// reapUntil reaps children until pid exits, and returns its status.
func reapUntil(pid int) (unix.WaitStatus, error) {
	for {
		var ws unix.WaitStatus
		got, err := unix.Wait4(-1, &ws, 0, nil)
		switch {
		case errors.Is(err, unix.EINTR):
		case err != nil:
			return ws, err
		case got == pid:
			return ws, nil
		}
	}
}

// hostPID turns the pid of a child, as this process sees it, into its pid
// on the host, through a pidfd read in the host's /proc (through hostRoot): in a
// PID namespace of its own the supervisor sees its task as 2 or so, while
// the driver needs the host's number.
func hostPID(pid int) (int, error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return 0, fmt.Errorf("failed to open a pidfd for the task (pid %d): %w", pid, err)
	}
	defer unix.Close(fd)
	info, err := readAt(hostRoot, fmt.Sprintf("proc/self/fdinfo/%d", fd))
	if err != nil {
		return 0, fmt.Errorf("failed to read the task's pidfd: %w", err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(line, "Pid:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil || n <= 0 {
				return 0, fmt.Errorf("failed to read the task's host pid from %q", line)
			}
			return n, nil
		}
	}
	return 0, errors.New("failed to read the task's host pid: the kernel's pidfd has no Pid field (Linux 5.3 or later is needed)")
}

// readAt reads a file relative to the directory dir.
func readAt(dir int, name string) (string, error) {
	fd, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	b, err := io.ReadAll(f)
	return string(b), err
}

// openLogPath opens a log path as an O_PATH handle. Nomad's FIFOs are
// <alloc>/alloc/logs/<file>, and a task can rename and replace what is in
// /alloc, its logs/ directory included: the last two elements are resolved
// below their parent without following any symlink (openat2
// RESOLVE_NO_SYMLINKS), the directories above them being Nomad's own.
func openLogPath(path string) (int, error) {
	dir := filepath.Dir(filepath.Dir(path))
	rel := filepath.Join(filepath.Base(filepath.Dir(path)), filepath.Base(path))
	dirFD, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	defer unix.Close(dirFD)
	fd, err := unix.Openat2(dirFD, rel, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if errors.Is(err, unix.ELOOP) {
		return -1, fmt.Errorf("%w: a symlink on the way is never followed", err)
	}
	return fd, err
}

// logReaderWait bounds how long openLog waits for a reader on a log FIFO.
const logReaderWait = 10 * time.Second

// openLog opens one of Nomad's log FIFOs (or a file) for writing. A FIFO
// nobody reads is an error rather than a hang.
//
// The FIFOs live in the allocation's directory, which the task can write:
// a symlink there is never followed, and anything but a FIFO or a regular
// file (a device node the task made) is refused, since the supervisor
// writes as root on the host, outside the task's device filter.
func openLog(path string) (*os.File, error) {
	pathFD, err := openLogPath(path)
	if err != nil {
		return nil, fmt.Errorf("failed to open log %q: %w", path, err)
	}
	defer unix.Close(pathFD)
	var st unix.Stat_t
	if err := unix.Fstat(pathFD, &st); err != nil {
		return nil, fmt.Errorf("failed to open log %q: %w", path, err)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFIFO, unix.S_IFREG:
	case unix.S_IFLNK:
		return nil, fmt.Errorf("failed to open log %q: it is a symlink, want Nomad's FIFO", path)
	default:
		return nil, fmt.Errorf("failed to open log %q: it is not a FIFO (mode %#o)", path, st.Mode)
	}
	// Reopened through the handle: the very file checked above.
	reopen := fmt.Sprintf("/proc/self/fd/%d", pathFD)
	// Nomad's logmon opens the read side of its FIFOs in the background, so
	// right after it started there may be no reader yet: wait for one, for
	// a while, rather than block for ever or fail at once.
	deadline := time.Now().Add(logReaderWait)
	var fd int
	for {
		var err error
		fd, err = unix.Open(reopen, unix.O_WRONLY|unix.O_APPEND|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
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

// pidsRefusedStart names the task's process limit in err, a failed start,
// when the limit is why:
//   - a limit of 1, and the first fork into the task's group failed with
//     EAGAIN: on cgroup v1 the launching thread joins the group and counts
//     against pids.max while it forks, so 1 leaves no room for the task's
//     first process (on v2 the task is cloned into its group, and 1 is room
//     for it). A larger limit cannot refuse the first fork, whose EAGAIN
//     then has another cause (the user's RLIMIT_NPROC, the host's pid_max);
//   - a larger limit, and the group's pids.max refused a fork or a thread on
//     the way: a seccomp stage run in Go (a supervisor without the shim's
//     entry point) needs threads of its own, and dies of the refusal saying
//     nothing the start could pass on.
func pidsRefusedStart(spec *wire.Spec, group *cgroups.Group, err error) error {
	switch limit := spec.Limits.PidsMax; {
	case limit == 1 && errors.Is(err, unix.EAGAIN):
		return fmt.Errorf("the task's process limit (pids_limit 1) leaves no room to start it: on cgroup v1 the supervisor's launching thread counts against it while it starts the task; set pids_limit to 2 or more (0 for none): %w", err)
	case limit > 1:
		if n, perr := group.PidsLimited(); perr == nil && n > 0 {
			return fmt.Errorf("%w (the task's process limit, pids_limit %d, refused %d forks or threads while it started: raise pids_limit, or set it to 0 for none)", err, limit, n)
		}
	}
	return err
}

// waitTask waits for the task's main process, then kills what is left of
// its group, and says how it ended. It reaps every child meanwhile: in a
// PID namespace of the task's, the supervisor is its init, and the task's
// orphans become its children.
func waitTask(logger hclog.Logger, cmd *exec.Cmd, group *cgroups.Group) *wire.ExitStatus {
	status := &wire.ExitStatus{}
	ws, err := reapUntil(cmd.Process.Pid)
	status.ExitedAt = time.Now().UTC()
	if err != nil {
		status.ExitCode = -1
		status.Err = fmt.Sprintf("failed to wait for the task: %v", err)
	} else {
		switch {
		case ws.Signaled():
			status.Signal = int(ws.Signal())
			status.ExitCode = 128 + status.Signal
		default:
			status.ExitCode = ws.ExitStatus()
		}
	}
	// What the kill below leaves behind is reaped too, until the
	// supervisor exits.
	go func() {
		for {
			var ws unix.WaitStatus
			if _, err := unix.Wait4(-1, &ws, 0, nil); err != nil && !errors.Is(err, unix.EINTR) {
				return
			}
		}
	}()
	oom, err := group.OOMKilled()
	if err != nil {
		logger.Warn("failed to check for an OOM kill", "error", err)
	}
	status.OOMKilled = oom
	if status.PidsLimited, err = group.PidsLimited(); err != nil {
		logger.Warn("failed to check the task's process limit", "error", err)
	}
	if err := group.Kill(); err != nil {
		logger.Error("failed to kill the rest of the task's cgroup", "error", err)
		if status.Err == "" {
			status.Err = fmt.Sprintf("failed to kill the rest of the task: %v", err)
		}
	}
	return status
}

// cloneNull is a read-only clone of /dev/null's mount, which openNull
// opens: the task reaches the descriptors through /proc/self/fd, and on
// the host's own mount a root task could chmod, chown or touch the host's
// /dev/null through them (mode 000 would break every program on the
// node). One clone serves every /dev/null of a start. The caller closes
// it once the opens are done: the descriptors keep the mount.
func cloneNull() (*os.File, error) {
	m := mounter.New()
	tree, err := m.CloneTree(os.DevNull, false)
	if err != nil {
		return nil, err
	}
	if err := m.LockTree(tree, true, true, false); err != nil {
		_ = tree.Close()
		return nil, err
	}
	return tree, nil
}

// openNull opens /dev/null with flags (O_RDONLY, O_WRONLY) through null,
// its clone from cloneNull. The device is still read and written.
func openNull(null *os.File, flags int) (*os.File, error) {
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", null.Fd()), flags|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to open %s through its read-only clone: %w", os.DevNull, err)
	}
	return os.NewFile(uintptr(fd), os.DevNull), nil
}

// openStdio opens the task's stdin (/dev/null), stdout and stderr: Nomad's
// log FIFOs, or /dev/null for a task with `logs { disabled = true }`, for
// which no logmon reads a FIFO.
func openStdio(spec *wire.Spec) ([]*os.File, error) {
	null, err := cloneNull()
	if err != nil {
		return nil, err
	}
	defer null.Close()
	stdin, err := openNull(null, unix.O_RDONLY)
	if err != nil {
		return nil, err
	}
	files := []*os.File{stdin}
	for _, path := range []string{spec.StdoutPath, spec.StderrPath} {
		var f *os.File
		if path == "" || path == os.DevNull {
			f, err = openNull(null, unix.O_WRONLY)
		} else {
			f, err = openLog(path)
		}
		if err != nil {
			for _, f := range files {
				_ = f.Close()
			}
			return nil, err
		}
		files = append(files, f)
	}
	return files, nil
}
