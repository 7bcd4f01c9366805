package executor

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// ErrGone is returned by Recover when the supervisor is gone and recorded no
// exit status: the task's fate is unknown (and whatever was left of it in
// its cgroup has been killed).
var ErrGone = errors.New("task supervisor is gone without recording an exit status")

// Timeouts, variables so that tests can shorten them.
var (
	// startTimeout bounds how long Start waits for the supervisor's report
	// (mounts, cgroup, user look-up and exec).
	startTimeout = 2 * time.Minute
	// killWaitTimeout bounds how long Shutdown waits after killing.
	killWaitTimeout = 30 * time.Second
)

// Process is a task started by Start or taken back by Recover. Its methods
// are safe for concurrent use.
type Process struct {
	logger hclog.Logger
	state  State

	// group is nil when the cgroup could not be loaded on Recover.
	group *cgroups.Group
	// supFD and taskFD are pidfds of the supervisor and of the task's
	// main process, -1 when unknown or gone. A recovered supervisor's is
	// how its end is seen; a started one is this process's child, whose
	// end its spare's reaper sees, and its pidfd only resumes it (Kill).
	supFD, taskFD int

	done   chan struct{}
	status *ExitStatus

	mu        sync.Mutex
	destroyed bool
	// onExit run once the task has exited, after done is closed (see
	// OnExit); exitRan is set then.
	onExit  []func()
	exitRan bool
}

// Start starts the task described by spec under a new supervisor and
// returns once its command was exec'd. Before Start, the caller must
// create spec.StateDir (0700) and make every bidirectional mount source a
// shared mount point of its own on the host.
//
// When spec has LateMounts, Start calls late once the supervisor runs
// (which sets the task up meanwhile) for the mounts themselves, in the same
// order and with the same targets, and hands them over; the task is forked
// after that. An error from late stops the supervisor, and Start returns
// that error as it is.
//
// On error, no process and no cgroup are left (files in StateDir may be).
// A supervisor that does not report within startTimeout and has not let
// the command run yet never does (Start takes the go token: see
// wire.GoTokenFD). One that has let it run (it took the token) gets one
// more startTimeout to report; when it still has not, it and everything
// in the task's cgroup are killed, and the error says so.
func Start(logger hclog.Logger, spec *Spec, late func() ([]Mount, error)) (*Process, error) {
	return start(logger, spec, late, nil)
}

// start is Start, with a spare supervisor when sp is set.
func start(logger hclog.Logger, spec *Spec, late func() ([]Mount, error), sp *spare) (*Process, error) {
	logger = logger.Named("executor").With("task_id", spec.TaskID)
	fail := func(err error) (*Process, error) {
		if sp != nil {
			sp.stop()
		}
		return nil, err
	}
	if err := validateSpec(spec); err != nil {
		return fail(fmt.Errorf("failed to start task: %w", err))
	}
	if len(spec.LateMounts) > 0 && late == nil {
		return fail(errors.New("failed to start task: it has late mounts but no way to get them"))
	}
	// Not synced: the spec matters only while the host is up, and a task
	// does not outlive a crash of the host.
	if err := wire.WriteJSON(filepath.Join(spec.StateDir, wire.SpecFile), spec, 0o600, false); err != nil {
		return fail(fmt.Errorf("failed to start task: %w", err))
	}
	// The exit status's file is made now, while there is room: the
	// supervisor writes the status into it in place (wire.WriteExit).
	if err := wire.ReserveExit(filepath.Join(spec.StateDir, wire.ExitFile)); err != nil {
		return fail(fmt.Errorf("failed to start task: %w", err))
	}
	// The go token: the supervisor lets the command run only once it took
	// it, and a start that gives up takes it first (see takeGoToken).
	token, err := newGoToken()
	if err != nil {
		return fail(fmt.Errorf("failed to start task: %w", err))
	}
	defer token.Close()
	logPath := filepath.Join(spec.StateDir, wire.SupervisorLogFile)
	if sp != nil {
		err := recordSupervisor(spec.StateDir, sp.cmd.Process.Pid)
		if err == nil {
			err = sp.hand(spec.StateDir, token)
		}
		if err != nil {
			logger.Debug("spare supervisor unusable, starting one", "error", err)
			sp.stop()
			sp = nil
		}
	}
	spared := sp != nil
	if sp != nil {
		if len(spec.LateMounts) == 0 {
			_ = sp.ctl.Close()
			sp.ctl = nil
		}
		logger.Debug("spare supervisor took the task", "supervisor_pid", sp.cmd.Process.Pid)
	} else {
		logFile, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			return nil, fmt.Errorf("failed to start task: failed to open %q: %w", logPath, err)
		}
		sp, err = startSupervisor(spec.Supervisor, []string{spec.StateDir}, logFile, len(spec.LateMounts) > 0, privatePID(spec.Isolation), "", nil, token, logger)
		_ = logFile.Close()
		if err != nil {
			return nil, fmt.Errorf("failed to start task: %w", err)
		}
		logger.Debug("supervisor started", "supervisor_pid", sp.cmd.Process.Pid)
	}
	// Before the supervisor gets its mounts or starts anything: a driver
	// that dies from here on leaves a record Discard can end it by. (A
	// spare's record is written before it is handed the task.)
	if !spared {
		if err := recordSupervisor(spec.StateDir, sp.cmd.Process.Pid); err != nil {
			sp.stop()
			return nil, fmt.Errorf("failed to start task: %w", err)
		}
	}
	profile := profileOf(spec)
	cmd, reportR, ctl, reaped := sp.cmd, sp.reportR, sp.ctl, sp.reaped
	defer reportR.Close()
	if ctl != nil {
		defer ctl.Close()
	}

	// The supervisor's pid is not reused before its reaper (sp.reap, run
	// once it has exited) reaps it, so the start time read now, while
	// the task's volumes are set up, is the supervisor's; reaped already,
	// the read fails and the report below says the start failed.
	supStart, supStartErr := wire.ProcStartTime(cmd.Process.Pid)

	var lateErr error
	if ctl != nil {
		mounts, err := late()
		if err == nil && len(mounts) != len(spec.LateMounts) {
			err = fmt.Errorf("got %d late mounts, want %d", len(mounts), len(spec.LateMounts))
		}
		lateErr = err
		// A supervisor that already failed has closed its end: its report
		// says why.
		if err := sendTrees(ctl, mounter.New(), mounts, lateErr); err != nil {
			logger.Debug("failed to hand the late mounts over", "error", err)
		}
		_ = ctl.Close()
	}

	rep, err := readReport(reportR, startTimeout)
	if err != nil && !takeGoToken(token) && errors.Is(err, os.ErrDeadlineExceeded) {
		// The supervisor took the token: it got past its last step
		// before the command runs and is close to reporting, unless the
		// host is badly overloaded. It gets one more startTimeout; a
		// supervisor still silent after that is killed with its task
		// below, for a task without a pid, whose supervisor never
		// reported, could be neither signalled nor watched.
		logger.Warn("supervisor let the task's command run but did not report in time; waiting once more", "timeout", startTimeout)
		rep, err = readReport(reportR, startTimeout)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("the supervisor let the command run but never reported (waited twice %s), so the task was killed: %w", startTimeout, err)
		}
	}
	if err != nil {
		// Either the start took the go token, and the command never ran
		// and never will, or the supervisor took it and failed or never
		// reported: the supervisor and everything in the task's cgroup
		// are killed.
		_ = cmd.Process.Kill()
		<-reaped
		// A supervisor that died (or was killed here) before its report
		// cleaned nothing up: the task's cgroup, and what is in it, go
		// now, for Nomad gets no handle and never destroys the task.
		if gerr := endTaskGroup(spec); gerr != nil {
			logger.Warn("failed to remove the cgroup of a start whose supervisor died", "error", gerr)
		}
		if lateErr != nil {
			return nil, lateErr
		}
		return nil, fmt.Errorf("failed to start task: %w%s", err, logTail(logPath))
	}
	if rep.Error != "" {
		<-reaped
		if lateErr != nil {
			return nil, lateErr
		}
		return nil, fmt.Errorf("failed to start task: %s", rep.Error)
	}

	p := &Process{
		logger: logger,
		supFD:  -1,
		taskFD: -1,
		done:   make(chan struct{}),
		state: State{
			SupervisorPID: cmd.Process.Pid,
			TaskPID:       rep.TaskPID,
			TaskStart:     rep.TaskStart,
			StateDir:      spec.StateDir,
			Cgroup:        rep.Cgroup,
			StartedAt:     time.Now().UTC(),
			Profile:       &profile,
		},
	}
	p.state.SupervisorStart = supStart
	if supStartErr != nil {
		logger.Warn("failed to read the supervisor's start time", "error", supStartErr)
	}
	p.taskFD = openVerifiedPidfd(rep.TaskPID, rep.TaskStart)
	if supStartErr == nil {
		p.supFD = openVerifiedPidfd(cmd.Process.Pid, supStart)
	}
	if p.group, err = cgroups.Reported(rep.Cgroup); err != nil {
		logger.Warn("failed to load the task's cgroup", "error", err)
	}
	logger.Info("task started", "pid", rep.TaskPID, "supervisor_pid", cmd.Process.Pid)
	// Once the supervisor is reaped, its reaping records the task's end:
	// nothing else waits for it.
	sp.afterReap(p.finish)
	return p, nil
}

// Recover takes back a task from its State after the driver restarted. A
// supervisor that already finished leaves a Process whose Wait returns the
// recorded status at once. When the supervisor is gone without a record,
// Recover kills what is left in the task's cgroup and returns ErrGone.
func Recover(logger hclog.Logger, st State) (*Process, error) {
	logger = logger.Named("executor")
	p := &Process{
		logger: logger,
		state:  st,
		supFD:  openVerifiedPidfd(st.SupervisorPID, st.SupervisorStart),
		taskFD: -1,
		done:   make(chan struct{}),
	}
	group, gerr := cgroups.Load(st.Cgroup)
	if gerr == nil {
		p.group = group
	}

	if p.supFD < 0 {
		status, err := readExitStatus(st.StateDir)
		if err != nil {
			// Nomad forgets the task on this error and never destroys it:
			// the cgroup goes now, with whatever was left in it.
			if group != nil {
				if kerr := group.Kill(); kerr != nil {
					logger.Warn("failed to kill the rest of a lost task", "error", kerr)
				} else if derr := group.Destroy(); derr != nil {
					logger.Warn("failed to remove the cgroup of a lost task", "error", derr)
				}
			}
			return nil, fmt.Errorf("failed to recover task with supervisor pid %d: %w (%v)", st.SupervisorPID, ErrGone, err)
		}
		p.status = status
		close(p.done)
		p.exitRan = true
		return p, nil
	}

	if gerr != nil {
		logger.Warn("failed to load the task's cgroup", "error", gerr)
	}
	p.taskFD = openVerifiedPidfd(st.TaskPID, st.TaskStart)
	onExited(p.supFD, p.finish, func(err error) {
		p.logger.Error("failed to wait for the supervisor; taking it as exited", "error", err)
	})
	return p, nil
}

// openVerifiedPidfd opens a pidfd for pid and checks, after opening it, that
// pid is still the process that started at start; -1 otherwise.
func openVerifiedPidfd(pid int, start uint64) int {
	if pid <= 0 {
		return -1
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1
	}
	got, err := wire.ProcStartTime(pid)
	if err != nil || got != start {
		_ = unix.Close(fd)
		return -1
	}
	return fd
}

// supervisorEnv is the supervisor's environment: only what a Go program
// may want, never the task's (which is in the spec file). A supervisor
// runs with GOMAXPROCS=1 unless the driver's environment says otherwise:
// it makes a few system calls at a time, for the task's whole life, and
// each processor of the Go runtime costs it memory (its allocation caches)
// beside hundreds of others on a busy node.
func supervisorEnv() []string {
	var env []string
	procs := false
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "PATH=") || strings.HasPrefix(kv, "GO") || strings.HasPrefix(kv, "TMPDIR=") {
			env = append(env, kv)
			procs = procs || strings.HasPrefix(kv, "GOMAXPROCS=")
		}
	}
	if !procs {
		env = append(env, "GOMAXPROCS=1")
	}
	return env
}

// readReport reads the supervisor's one report line, for at most timeout.
func readReport(r *os.File, timeout time.Duration) (*wire.ReadyReport, error) {
	// The pipe is in the runtime's poller, so the read can have a deadline.
	if err := r.SetReadDeadline(time.Now().Add(timeout)); err != nil {
		return nil, fmt.Errorf("failed to wait for the supervisor's report: %w", err)
	}
	line, err := bufio.NewReader(r).ReadBytes('\n')
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return nil, noReportError{timeout}
	}
	if len(line) == 0 {
		return nil, fmt.Errorf("supervisor exited before reporting: %w", err)
	}
	var rep wire.ReadyReport
	if err := json.Unmarshal(line, &rep); err != nil {
		return nil, fmt.Errorf("failed to decode the supervisor's report %q: %w", line, err)
	}
	return &rep, nil
}

// noReportError is readReport's error when its time is up; it is
// os.ErrDeadlineExceeded.
type noReportError struct{ timeout time.Duration }

func (e noReportError) Error() string {
	return fmt.Sprintf("supervisor did not report within %s", e.timeout)
}

func (noReportError) Unwrap() error { return os.ErrDeadlineExceeded }

// newGoToken makes a task's go token (see wire.GoTokenFD): the read end of
// a pipe that holds wire.GoToken and whose write end is closed.
func newGoToken() (*os.File, error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil {
		return nil, fmt.Errorf("failed to make the go token: %w", err)
	}
	_, err := unix.Write(fds[1], []byte{wire.GoToken})
	_ = unix.Close(fds[1])
	if err != nil {
		_ = unix.Close(fds[0])
		return nil, fmt.Errorf("failed to make the go token: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "go-token"), nil
}

// takeGoToken takes the go token for a start that gives up, and says
// whether it got it: then the supervisor never lets the command run. When
// it did not, the supervisor took it first, and the command may run. The
// read never blocks (the pipe's write end is closed); an error that is not
// EINTR reads as the supervisor having it, which never claims a start
// failed when its command may run.
func takeGoToken(token *os.File) bool {
	var b [1]byte
	for {
		n, err := unix.Read(int(token.Fd()), b[:])
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err == nil && n == 1
	}
}

// logTail returns the end of the supervisor log, for an error message.
func logTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 {
		return ""
	}
	const max = 2048
	if len(b) > max {
		b = b[len(b)-max:]
	}
	return fmt.Sprintf(" (supervisor log: %s)", strings.TrimSpace(string(b)))
}

func readExitStatus(stateDir string) (*ExitStatus, error) {
	return wire.ReadExit(filepath.Join(stateDir, wire.ExitFile))
}

// finish records the task's status once its supervisor has exited (and,
// when it is this process's child, was reaped), and runs what OnExit gave.
func (p *Process) finish() {
	status, err := readExitStatus(p.state.StateDir)
	if err != nil {
		p.logger.Error("supervisor exited without recording the task's exit status", "error", err)
		status = &ExitStatus{
			ExitCode: -1,
			Err:      fmt.Sprintf("task supervisor (pid %d) exited without recording the task's exit status: %v", p.state.SupervisorPID, err),
			ExitedAt: time.Now().UTC(),
		}
		if kerr := p.killGroup(); kerr != nil {
			p.logger.Error("failed to kill the rest of the task", "error", kerr)
		}
	}
	p.status = status
	close(p.done)
	p.mu.Lock()
	hooks := p.onExit
	p.onExit, p.exitRan = nil, true
	p.mu.Unlock()
	for _, f := range hooks {
		f()
	}
}

// OnExit has f run once the task has exited (Wait then returns at once),
// on the goroutine that saw it exit; when it has already, f runs now. f
// must not block: it is how a caller follows the task without a goroutine
// of its own waiting for it.
func (p *Process) OnExit(f func()) {
	p.mu.Lock()
	if !p.exitRan {
		p.onExit = append(p.onExit, f)
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	f()
}

// State returns what Recover needs.
func (p *Process) State() State { return p.state }

// Pid returns the host PID of the task's main process.
func (p *Process) Pid() int { return p.state.TaskPID }

// Wait returns how the task ended, once it has. Every caller gets the same
// status; ctx ends only this wait.
func (p *Process) Wait(ctx context.Context) (*ExitStatus, error) {
	select {
	case <-p.done:
		s := *p.status
		return &s, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (p *Process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Signal sends sig to the task's main process. A task that already exited
// is not an error.
func (p *Process) Signal(sig syscall.Signal) error {
	if p.exited() {
		return nil
	}
	err := p.sendSignal(&p.taskFD, sig)
	if err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("failed to send %s to task pid %d: %w", sig, p.state.TaskPID, err)
	}
	return nil
}

// Shutdown sends sig to the task, waits up to grace for it to exit, then
// kills the whole task. It returns once the task has exited.
func (p *Process) Shutdown(sig syscall.Signal, grace time.Duration) error {
	if err := p.Signal(sig); err != nil {
		return err
	}
	timer := time.NewTimer(grace)
	defer timer.Stop()
	select {
	case <-p.done:
		return nil
	case <-timer.C:
	}
	p.logger.Debug("task did not exit in time, killing it", "signal", sig.String(), "grace", grace)
	if err := p.Kill(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), killWaitTimeout)
	defer cancel()
	if _, err := p.Wait(ctx); err != nil {
		return fmt.Errorf("task pid %d did not exit after SIGKILL: %w", p.state.TaskPID, err)
	}
	return nil
}

// Kill sends SIGKILL to every process of the task's cgroup, then resumes
// the supervisor: a task in the host's PID namespace can stop it (SIGSTOP
// to its $PPID), and a stopped supervisor would never reap the task, record
// its end or exit. The task is dead by then and cannot stop it again.
func (p *Process) Kill() error {
	if err := p.sendSignal(&p.taskFD, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
		p.logger.Warn("failed to kill the task's main process", "pid", p.state.TaskPID, "error", err)
	}
	err := p.killGroup()
	if cerr := p.sendSignal(&p.supFD, unix.SIGCONT); cerr != nil && !errors.Is(cerr, unix.ESRCH) {
		p.logger.Warn("failed to resume the task's supervisor", "pid", p.state.SupervisorPID, "error", cerr)
	}
	return err
}

// sendSignal signals a process through its pidfd *fd (p.supFD, the
// supervisor's, or p.taskFD, the task's main process's), read under p.mu,
// which Destroy closes it under: a reused PID is never hit. One already
// gone, or whose pidfd was never opened, is ESRCH.
func (p *Process) sendSignal(fd *int, sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if *fd < 0 {
		return unix.ESRCH
	}
	return unix.PidfdSendSignal(*fd, sig, nil, 0)
}

func (p *Process) killGroup() error {
	if p.group == nil {
		return nil
	}
	if err := p.group.Kill(); err != nil {
		return fmt.Errorf("failed to kill task pid %d: %w", p.state.TaskPID, err)
	}
	return nil
}

// Stats samples the task's cgroup.
func (p *Process) Stats() (*cgroups.Stats, error) {
	if p.group == nil {
		return nil, fmt.Errorf("failed to read stats of task pid %d: its cgroup is not loaded", p.state.TaskPID)
	}
	return p.group.Stats()
}

// Destroy removes the task's cgroup and state directory, once the task has
// exited. It is idempotent.
func (p *Process) Destroy() error {
	if !p.exited() {
		return fmt.Errorf("failed to destroy task pid %d: it is still running", p.state.TaskPID)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.destroyed {
		return nil
	}
	group := p.group
	if group == nil {
		if g, err := cgroups.Load(p.state.Cgroup); err == nil {
			group = g
		}
	}
	if group != nil {
		if err := group.Kill(); err != nil {
			return fmt.Errorf("failed to destroy task pid %d: %w", p.state.TaskPID, err)
		}
		if err := group.Destroy(); err != nil {
			return fmt.Errorf("failed to destroy task pid %d: %w", p.state.TaskPID, err)
		}
	}
	if p.state.StateDir != "" {
		if err := os.RemoveAll(p.state.StateDir); err != nil {
			return fmt.Errorf("failed to remove state dir %q: %w", p.state.StateDir, err)
		}
	}
	for _, fd := range []*int{&p.supFD, &p.taskFD} {
		if *fd >= 0 {
			_ = unix.Close(*fd)
			*fd = -1
		}
	}
	p.destroyed = true
	return nil
}

// sendTrees clones the late mounts' sources on the host and sends them to
// the supervisor; with cause set it tells the supervisor to give up
// instead.
func sendTrees(ctl *os.File, m mounter.Interface, mounts []Mount, cause error) error {
	send := func(lm wire.LateMessage, fds []int) error {
		if err := sendControl(ctl, lm, fds); err != nil {
			return fmt.Errorf("failed to hand the task's volumes to its supervisor: %w", err)
		}
		return nil
	}
	if cause != nil {
		return send(wire.LateMessage{Error: "the task's volumes could not be set up: " + cause.Error()}, nil)
	}
	var (
		trees []*os.File
		fds   []int
	)
	defer func() {
		for _, t := range trees {
			_ = t.Close()
		}
	}()
	for _, mnt := range mounts {
		t, err := cloneSource(m, mnt)
		if err != nil {
			err = fmt.Errorf("mount %q: %w", mnt.Target, err)
			_ = send(wire.LateMessage{Error: err.Error()}, nil)
			return err
		}
		trees = append(trees, t)
		fds = append(fds, int(t.Fd()))
	}
	return send(wire.LateMessage{Mounts: mounts}, fds)
}

// cloneSource clones the mount tree at mnt's source, resolved without
// symlinks below mnt.Beneath when it is set.
func cloneSource(m mounter.Interface, mnt Mount) (*os.File, error) {
	if mnt.Beneath != "" {
		return m.CloneTreeBeneath(mnt.Beneath, mnt.Source, true)
	}
	return m.CloneTree(mnt.Source, true)
}

// sendControl sends v as one JSON message over a supervisor's control
// socket, with fds attached as SCM_RIGHTS.
func sendControl(ctl *os.File, v any, fds []int) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	return unix.Sendmsg(int(ctl.Fd()), b, oob, nil, 0)
}

// profileOf is the spec's Profile.
func profileOf(s *Spec) Profile {
	return Profile{
		User:                s.User,
		Credential:          s.Credential,
		Privileged:          s.Privileged,
		Capabilities:        s.Capabilities,
		AmbientCapabilities: s.AmbientCapabilities,
		Isolated:            s.Isolation != nil,
		OOMScoreAdj:         s.OOMScoreAdj,
		NetNS:               s.NetNS != "",
	}
}
