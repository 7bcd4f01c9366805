package executor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// execOutputDrain bounds how long Exec waits for the last output of a
// command that has exited (a background child may hold the pipe open).
var execOutputDrain = 2 * time.Second

// Exec runs opts.Command inside the running task: in its mount namespace
// and cgroup, as its user with its capabilities, with its environment and
// working directory. It returns the command's exit code (128+N when killed
// by signal N). Cancelling ctx kills the command.
func (p *Process) Exec(ctx context.Context, opts ExecOptions) (int, error) {
	if len(opts.Command) == 0 {
		return 0, errors.New("failed to exec in task: command must not be empty")
	}
	if p.exited() {
		return 0, fmt.Errorf("failed to exec in task pid %d: the task is not running", p.state.TaskPID)
	}
	prof := p.state.Profile
	if prof == nil {
		return 0, fmt.Errorf("failed to exec in task pid %d: the task was started by an older driver that did not record what exec may run with; restart the task to use exec", p.state.TaskPID)
	}
	// Only the environment and working directory come from the spec file
	// (which is outside the task's view); who the command runs as and with
	// what powers comes from the state the driver keeps with Nomad.
	var spec Spec
	if err := wire.ReadJSON(filepath.Join(p.state.StateDir, wire.SpecFile), &spec); err != nil {
		return 0, fmt.Errorf("failed to exec in task pid %d: %w", p.state.TaskPID, err)
	}
	// The user is looked up here, on the host, whose /etc the task was
	// started by, unless the driver resolved it when the task started (an
	// image task's). The stage must never look it up: it runs in the
	// task's root, whose /etc a task can write (a volume mounted there),
	// and would take the task's passwd and group files (a `nobody` whose
	// uid is 0) and, with the C library's lookup, its nsswitch.conf and
	// the modules it names, loaded into a process that still holds every
	// capability.
	cred := prof.Credential
	if cred == nil {
		c, err := taskuser.Resolve(prof.User)
		if err != nil {
			return 0, fmt.Errorf("failed to exec in task pid %d: %w", p.state.TaskPID, err)
		}
		cred = &Credential{UID: c.UID, GID: c.GID, Groups: c.Groups}
	}
	cfg := &wire.StageConfig{Spec: Spec{
		TaskID:              spec.TaskID,
		Command:             opts.Command[0],
		Args:                opts.Command[1:],
		Env:                 spec.Env,
		Dir:                 spec.Dir,
		User:                prof.User,
		Credential:          cred,
		Privileged:          prof.Privileged,
		Capabilities:        prof.Capabilities,
		AmbientCapabilities: prof.AmbientCapabilities,
		OOMScoreAdj:         prof.OOMScoreAdj,
	}, Isolated: prof.Isolated}
	if p.state.Cgroup.Version != 0 {
		cg := p.state.Cgroup
		cfg.Cgroup = &cg
	}

	// A dup of the task's pidfd, so that Destroy cannot close it under us.
	p.mu.Lock()
	nsFD := -1
	if p.taskFD >= 0 {
		nsFD, _ = unix.FcntlInt(uintptr(p.taskFD), unix.F_DUPFD_CLOEXEC, 0)
	}
	p.mu.Unlock()
	if nsFD < 0 {
		return 0, fmt.Errorf("failed to exec in task pid %d: the task is not running", p.state.TaskPID)
	}
	// Owned by pidfd from here: closed once, by it.
	pidfd := os.NewFile(uintptr(nsFD), "task-pidfd")
	defer pidfd.Close()

	// The stage is this binary, run from a read-only clone of its mount
	// (mounter.OpenSealed): the command it execs in the task inherits
	// its /proc/self/exe when it is named /proc/self/exe (or is a script
	// with that interpreter), and would then run the host's binary as
	// the task, dumpable, so that any process of the task could open it
	// through /proc/<pid>/exe on the host's mount and a root task chmod
	// it (setuid, or mode 0), give it file capabilities, or overwrite it
	// once no process runs it. On the clone each fails with EROFS.
	exe, err := mounter.OpenSealed(mounter.New(), "/proc/self/exe")
	if err != nil {
		return 0, fmt.Errorf("failed to exec in task pid %d: %w", p.state.TaskPID, err)
	}
	defer exe.Close()
	// A session of its own, as the task's supervisor has: in the driver's
	// session the command (one of the task's binaries) would have the
	// driver's controlling terminal, which an agent started from a shell
	// has, and would open it as the task's /dev/tty to read what is typed
	// there, write to it, or push input into it (TIOCSTI).
	cmd := &exec.Cmd{
		Path:        fmt.Sprintf("/proc/self/fd/%d", wire.StageExeFD),
		Args:        []string{os.Args[0], wire.StageExec},
		Env:         []string{},
		WaitDelay:   execOutputDrain,
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	var (
		ptmx      *os.File
		stageTty  *os.File
		ttySock   *os.File
		stdinW    *os.File
		stageMore []*os.File
		copyDone  = make(chan struct{})
	)
	if opts.Tty {
		// The terminal comes from the task's own devpts, which the stage
		// opens in the task's mount namespace (see wire.StageTtyFD):
		// one of the host's would not be in the task's /dev/pts (tty:
		// "not a tty"), nor counted against the task's terminals. The
		// stage's stdio is /dev/null until it has the terminal.
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return 0, fmt.Errorf("failed to exec in task pid %d: failed to make a socket for the terminal: %w", p.state.TaskPID, err)
		}
		ttySock, stageTty = os.NewFile(uintptr(fds[0]), "tty-socket"), os.NewFile(uintptr(fds[1]), "stage-tty-socket")
		defer ttySock.Close()
		defer stageTty.Close()
		cfg.Tty = true
		stageMore = []*os.File{stageTty}
	} else {
		// Never nil: os/exec gives a nil one the host's /dev/null, opened
		// on the host's mount of /dev, through which a root command would
		// chmod or chown the node's /dev/null (/proc/self/fd/0). A pipe
		// instead, empty for stdin, read and dropped for output.
		cmd.Stdout, cmd.Stderr = opts.Stdout, opts.Stderr
		if cmd.Stdout == nil {
			cmd.Stdout = io.Discard
		}
		if cmd.Stderr == nil {
			cmd.Stderr = io.Discard
		}
		if opts.Stdin == nil {
			opts.Stdin = bytes.NewReader(nil)
		}
		// A pipe of our own: os/exec would wait for an interactive stdin
		// to end before Wait returns.
		r, w, err := os.Pipe()
		if err != nil {
			return 0, fmt.Errorf("failed to exec in task pid %d: %w", p.state.TaskPID, err)
		}
		defer r.Close()
		cmd.Stdin, stdinW = r, w
	}

	// setns(2) changes only the calling thread: start the stage from a
	// thread of its own that joins the task's PID and IPC namespaces (a
	// PID namespace is entered by the children of the thread). The stage
	// joins the task's cgroup while it still sees the host's cgroup file
	// system, then its mount namespace, through the pidfd it is handed.
	// The thread is never unlocked, so the runtime throws it away
	// afterwards.
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if prof.Isolated {
			if err := unix.Setns(nsFD, unix.CLONE_NEWPID|unix.CLONE_NEWIPC); err != nil {
				started <- fmt.Errorf("failed to join the task's PID and IPC namespaces: %w", err)
				return
			}
		}
		if err := joinTaskNet(nsFD, prof); err != nil {
			started <- err
			return
		}
		started <- startStage(ctx, cmd, cfg, pidfd, exe, stageMore...)
	}()
	if err := <-started; err != nil {
		if stdinW != nil {
			_ = stdinW.Close()
		}
		if opts.Tty && strings.HasPrefix(err.Error(), wire.StageNoTerminal) {
			err = noTerminalError(int(pidfd.Fd()), p.state.TaskPID)
		}
		return 0, fmt.Errorf("failed to exec in task pid %d: %w", p.state.TaskPID, err)
	}
	if opts.Tty {
		_ = stageTty.Close()
		var err error
		if ptmx, err = receiveTerminal(ttySock); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			return 0, fmt.Errorf("failed to exec in task pid %d: %w", p.state.TaskPID, err)
		}
		defer ptmx.Close()
	}

	stop := make(chan struct{})
	stopOnce := sync.OnceFunc(func() { close(stop) })
	defer stopOnce()
	// resizing must end before the deferred ptmx.Close.
	var resizing sync.WaitGroup
	defer resizing.Wait()
	go func() {
		select {
		case <-ctx.Done():
			_ = cmd.Process.Kill()
		case <-stop:
		}
	}()

	if opts.Tty {
		if opts.Stdin != nil {
			go func() { _, _ = io.Copy(ptmx, opts.Stdin) }()
		}
		go func() {
			if opts.Stdout != nil {
				_, _ = io.Copy(opts.Stdout, ptmx)
			} else {
				_, _ = io.Copy(io.Discard, ptmx)
			}
			close(copyDone)
		}()
		if opts.Resize != nil {
			resizing.Add(1)
			go func() {
				defer resizing.Done()
				for {
					select {
					case sz, ok := <-opts.Resize:
						if !ok {
							return
						}
						if err := setTerminalSize(ptmx, sz); err != nil {
							p.logger.Debug("failed to resize exec tty", "error", err)
						}
					case <-stop:
						return
					}
				}
			}()
		}
	} else {
		close(copyDone)
		if stdinW != nil {
			go func() {
				_, _ = io.Copy(stdinW, opts.Stdin)
				_ = stdinW.Close()
			}()
		}
	}

	werr := cmd.Wait()
	stopOnce()
	if stdinW != nil {
		_ = stdinW.Close()
	}
	select {
	case <-copyDone:
	case <-time.After(execOutputDrain):
	}

	code := 0
	if cmd.ProcessState != nil {
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			code = 128 + int(ws.Signal())
		} else {
			code = cmd.ProcessState.ExitCode()
		}
	}
	var exitErr *exec.ExitError
	if werr != nil && !errors.As(werr, &exitErr) && !errors.Is(werr, exec.ErrWaitDelay) {
		return code, fmt.Errorf("failed to exec in task pid %d: %w", p.state.TaskPID, werr)
	}
	return code, nil
}

// joinTaskNet makes the calling thread of `nomad alloc exec` join the
// network namespace of the task behind pidfd, when the task has one of its
// own (prof.NetNS): the command forked from the thread starts in it.
func joinTaskNet(pidfd int, prof *Profile) error {
	if !prof.NetNS {
		return nil
	}
	if err := unix.Setns(pidfd, unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("failed to join the task's network namespace: %w", err)
	}
	return nil
}

// receiveTerminal takes the multiplexer of the command's terminal that the
// exec stage sent on sock (wire.StageTtyFD) before it exec'd the command,
// and checks it is a devpts's ptmx: never anything else the stage could
// have been given in the task's root.
func receiveTerminal(sock *os.File) (*os.File, error) {
	buf := make([]byte, 1)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, flags, _, err := unix.Recvmsg(int(sock.Fd()), buf, oob, unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("the task stage sent no terminal: %w", err)
	}
	if n == 0 {
		return nil, errors.New("the task stage sent no terminal")
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	var fds []int
	if err == nil && len(msgs) == 1 {
		fds, err = unix.ParseUnixRights(&msgs[0])
	}
	if err != nil || len(fds) != 1 || flags&unix.MSG_CTRUNC != 0 {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
		return nil, errors.New("the task stage sent a malformed terminal message")
	}
	if err := checkPtmx(fds[0]); err != nil {
		_ = unix.Close(fds[0])
		return nil, fmt.Errorf("the task stage sent no terminal multiplexer: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "ptmx"), nil
}

// checkPtmx checks that fd is a devpts's multiplexer (5:2 on a devpts).
func checkPtmx(fd int) error {
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if fs.Type != unix.DEVPTS_SUPER_MAGIC || st.Mode&unix.S_IFMT != unix.S_IFCHR ||
		unix.Major(st.Rdev) != 5 || unix.Minor(st.Rdev) != 2 {
		return fmt.Errorf("device %d:%d, mode %#o, file system magic %#x", unix.Major(st.Rdev), unix.Minor(st.Rdev), st.Mode, fs.Type)
	}
	return nil
}

// setTerminalSize resizes the terminal whose multiplexer is ptmx.
func setTerminalSize(ptmx *os.File, sz TerminalSize) error {
	rc, err := ptmx.SyscallConn()
	if err != nil {
		return err
	}
	ws := &unix.Winsize{Row: uint16(sz.Height), Col: uint16(sz.Width)}
	cerr := rc.Control(func(fd uintptr) { err = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, ws) })
	if cerr != nil {
		return cerr
	}
	return err
}

// startStage starts the exec stage with cmd (whose Path, Args and
// stdio are set by the caller), sends it cfg, and waits until it has
// exec'd the task's command. On a stage error the stage has exited: it is
// reaped and the error returned. A stage that has not exec'd the command
// when ctx ends (one stuck on a file system in the task's root, such as a
// FUSE volume whose server never answers) is killed and reaped.
func startStage(ctx context.Context, cmd *exec.Cmd, cfg *wire.StageConfig, task, exe *os.File, more ...*os.File) error {
	extra := &cmd.ExtraFiles
	cfgR, cfgW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("failed to make a pipe: %w", err)
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		_ = cfgR.Close()
		_ = cfgW.Close()
		return fmt.Errorf("failed to make a pipe: %w", err)
	}
	*extra = append([]*os.File{cfgR, errW, task, exe}, more...)
	err = cmd.Start()
	_ = cfgR.Close()
	_ = errW.Close()
	if err != nil {
		_ = cfgW.Close()
		_ = errR.Close()
		return fmt.Errorf("failed to start the task stage: %w", err)
	}
	defer errR.Close()
	stopKill := context.AfterFunc(ctx, func() { _ = cmd.Process.Kill() })

	// The pipe buffer may be smaller than the config (a large env): write
	// while the stage reads.
	werr := make(chan error, 1)
	go func() {
		err := json.NewEncoder(cfgW).Encode(cfg)
		_ = cfgW.Close()
		werr <- err
	}()
	msg, rerr := io.ReadAll(errR)
	if !stopKill() {
		_ = cmd.Wait()
		return fmt.Errorf("the task stage did not start the command: %w", ctx.Err())
	}
	if err := <-werr; err != nil && len(msg) == 0 {
		_ = cmd.Wait()
		return fmt.Errorf("failed to send the task stage its config: %w", err)
	}
	if rerr != nil {
		return fmt.Errorf("failed to read the task stage's answer: %w", rerr)
	}
	if len(msg) > 0 {
		_ = cmd.Wait()
		return errors.New(string(msg))
	}
	return nil
}
