package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// RunReexec runs an internal stage when os.Args names one, and then exits
// the process; otherwise it returns false at once. main (and TestMain of
// tests that start tasks) must call it before anything else.
func RunReexec() bool {
	if len(os.Args) < 2 {
		return false
	}
	switch os.Args[1] {
	case wire.StageSupervisor, wire.StageExec, wire.StageSeccomp:
		hardenStage()
	}
	switch os.Args[1] {
	case wire.StageSupervisor:
		os.Exit(runSupervisor(os.Args[2:]))
	case wire.StageExec:
		runTaskStage()
	case wire.StageSeccomp:
		runSeccompStage(os.Args[2:])
	}
	return false
}

// runSeccompStage is the task's own process before its command: it
// attaches the task's filter and the user namespace rules (usernsList,
// unless it holds SYS_ADMIN), both programs in the stage's file (see
// stageFile), waits for its go-ahead (wire.SeccompGoFD) and execs the
// command, on one thread, so that the command inherits both filters. It
// runs as the task already, with no more than the task's capabilities and
// no_new_privs; its binary's descriptor, its error pipe and its socket are
// closed at exec (hardenStage). It never returns. A shim built with
// stageEntry as its entry point does the same before the Go runtime
// starts, and gets here only when that could not.
func runSeccompStage(args []string) {
	runtime.LockOSThread()
	errPipe := os.NewFile(wire.SeccompErrorFD, "error-pipe")
	fail := func(err error) {
		_, _ = io.WriteString(errPipe, err.Error())
		os.Exit(127)
	}
	if len(args) < 1 {
		fail(errors.New("the seccomp stage got no command"))
	}
	envFile := os.NewFile(wire.SeccompEnvFD, "task-env")
	filter, userns, env, err := readStageFile(envFile)
	_ = envFile.Close()
	if err != nil {
		fail(fmt.Errorf("the seccomp stage could not read the task's environment: %w", err))
	}
	if err := attachProgram(filter); err != nil {
		fail(err)
	}
	if !stageCaps().has(unix.CAP_SYS_ADMIN) {
		if err := attachProgram(userns); err != nil {
			fail(err)
		}
	}
	buf := make([]byte, wire.SeccompGoMax)
	oob := make([]byte, unix.CmsgSpace(3*4))
	n, noob, flags, _, err := unix.Recvmsg(wire.SeccompGoFD, buf, oob, unix.MSG_CMSG_CLOEXEC)
	for errors.Is(err, unix.EINTR) {
		n, noob, flags, _, err = unix.Recvmsg(wire.SeccompGoFD, buf, oob, unix.MSG_CMSG_CLOEXEC)
	}
	if err != nil {
		fail(fmt.Errorf("the seccomp stage could not take its go-ahead: %w", err))
	}
	if n == 0 && noob == 0 {
		// The supervisor let the task go before it ran.
		os.Exit(127)
	}
	dir, path, fds, err := goAheadMessage(buf[:n], oob[:noob], flags)
	if err != nil {
		fail(fmt.Errorf("the seccomp stage could not take its go-ahead: %w", err))
	}
	for i, fd := range fds {
		if err := unix.Dup3(fd, i, 0); err != nil {
			fail(fmt.Errorf("the seccomp stage could not take its go-ahead: %w", err))
		}
	}
	if dir != "" {
		if err := unix.Chdir(dir); err != nil {
			fail(fmt.Errorf("failed to change to working directory %q: %w", dir, err))
		}
	}
	if _, err := io.WriteString(errPipe, wire.SeccompReady); err != nil {
		os.Exit(127)
	}
	err = syscall.Exec(path, args, env)
	fail(fmt.Errorf("failed to execute %q: %w", path, err))
}

// stageCaps is what the seccomp stage holds, and so the command after it:
// the task's capabilities (no_new_privs keeps the exec from adding any).
// On an error it is none, which gets every rule.
func stageCaps() capSet {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return 0
	}
	return capSet(data[0].Effective) | capSet(data[1].Effective)<<32
}

// hardenStage runs first in a supervisor or exec stage, which hold every
// capability in the host's mount namespace while they set a task up:
//
//   - Not dumpable: an exec stage shares the task's PID namespace and, once
//     its launching thread has dropped to the task's capabilities, a task
//     running as root could pass the ptrace check against that thread and
//     write the memory its other, fully privileged threads run. A process
//     that is not dumpable is out of reach of anyone without CAP_SYS_PTRACE
//     (execve makes the task's command dumpable again, as its own
//     credentials say).
//   - Every descriptor above stderr closed at exec: descriptors the Nomad
//     agent or the driver inherited without close-on-exec would otherwise
//     reach every task (a directory descriptor is a way out of any root).
//     The stage's own descriptors (3, 4, 5) are used before the exec.
func hardenStage() {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		fmt.Fprintf(os.Stderr, "nomad-driver-csi: failed to make the stage not dumpable: %v\n", err)
		os.Exit(2)
	}
	if err := closeOnExecFrom(3); err != nil {
		fmt.Fprintf(os.Stderr, "nomad-driver-csi: failed to close inherited descriptors: %v\n", err)
		os.Exit(2)
	}
}

// closeOnExecFrom marks every descriptor from fd up close-on-exec.
func closeOnExecFrom(fd int) error {
	err := unix.CloseRange(uint(fd), ^uint(0), unix.CLOSE_RANGE_CLOEXEC)
	if err == nil || !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
		return err
	}
	// Before Linux 5.11: one at a time.
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return err
	}
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err == nil && n >= fd {
			unix.CloseOnExec(n)
		}
	}
	return nil
}

// runTaskStage is the exec stage, started in the task's mount namespace
// (nomad alloc exec): it prepares the process as the task and execs the
// command. It never returns.
func runTaskStage() {
	// capset(2) is per thread: set it and exec from the same thread.
	runtime.LockOSThread()

	errPipe := os.NewFile(wire.StageErrorFD, "error-pipe")
	fail := func(err error) {
		_, _ = io.WriteString(errPipe, err.Error())
		os.Exit(1)
	}
	defer func() {
		if r := recover(); r != nil {
			fail(fmt.Errorf("task stage panicked: %v", r))
		}
	}()
	if errPipe == nil {
		os.Exit(2)
	}
	unix.CloseOnExec(wire.StageErrorFD)

	cfgPipe := os.NewFile(wire.StageConfigFD, "config-pipe")
	var cfg wire.StageConfig
	err := json.NewDecoder(cfgPipe).Decode(&cfg)
	_ = cfgPipe.Close()
	if err != nil {
		fail(fmt.Errorf("failed to read the task stage config: %w", err))
	}
	fail(prepareAndExec(&cfg))
}

// prepareAndExec returns only on error.
func prepareAndExec(cfg *wire.StageConfig) error {
	spec := &cfg.Spec
	if cfg.Cgroup != nil {
		g, err := cgroups.Load(*cfg.Cgroup)
		if err != nil {
			return err
		}
		if err := g.Join(0); err != nil {
			return err
		}
	}
	if spec.OOMScoreAdj != 0 {
		if err := os.WriteFile("/proc/self/oom_score_adj", []byte(strconv.Itoa(spec.OOMScoreAdj)), 0); err != nil {
			return fmt.Errorf("failed to set oom_score_adj to %d: %w", spec.OOMScoreAdj, err)
		}
	}
	last, err := lastCap()
	if err != nil {
		return err
	}
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("failed to unshare the filesystem context: %w", err)
	}
	if err := unix.Setns(wire.StageTaskFD, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("failed to join the task's mount namespace: %w", err)
	}
	_ = unix.Close(wire.StageTaskFD)
	if err := os.Chdir("/"); err != nil {
		return fmt.Errorf("failed to enter the task's root: %w", err)
	}
	// Never looked up here, in the task's root, whose /etc the task can
	// write: the driver resolved it on the host (see Process.Exec).
	if spec.Credential == nil {
		return errors.New("the task stage got no resolved user; it never looks one up in the task's root")
	}
	cred, err := specCredential(spec)
	if err != nil {
		return err
	}
	// In the task's mount namespace, with every capability still held:
	// the terminal of `alloc exec -t` comes from the task's own devpts.
	if cfg.Tty {
		if err := takeTerminal(cred.UID); err != nil {
			return err
		}
	}
	keep, err := keptCaps(spec.Privileged, spec.Capabilities, last)
	if err != nil {
		return err
	}
	if err := dropBoundingSet(keep, last); err != nil {
		return err
	}
	// A task of another user holds no capabilities but its ambient ones,
	// which it keeps through setuid with PR_SET_KEEPCAPS.
	var ambient capSet
	if cred.UID != 0 {
		if ambient, err = capsOf(spec.AmbientCapabilities, keep); err != nil {
			return err
		}
	}
	if ambient != 0 {
		if err := unix.Prctl(unix.PR_SET_KEEPCAPS, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("failed to keep capabilities across setuid: %w", err)
		}
	}
	groups := make([]int, 0, len(cred.Groups))
	for _, g := range cred.Groups {
		groups = append(groups, int(g))
	}
	// The syscall package applies these to every thread of the process.
	if err := syscall.Setgroups(groups); err != nil {
		return fmt.Errorf("failed to set supplementary groups %v: %w", groups, err)
	}
	if err := syscall.Setresgid(int(cred.GID), int(cred.GID), int(cred.GID)); err != nil {
		return fmt.Errorf("failed to set gid %d: %w", cred.GID, err)
	}
	if err := syscall.Setresuid(int(cred.UID), int(cred.UID), int(cred.UID)); err != nil {
		return fmt.Errorf("failed to set uid %d: %w", cred.UID, err)
	}
	// A root task keeps exactly the allowed set; a task of another user
	// only its ambient set, and its inheritable set must not hand any more
	// back through file capabilities.
	threadCaps := keep
	if cred.UID != 0 {
		threadCaps = ambient
	}
	if err := setThreadCaps(threadCaps, true); err != nil {
		return err
	}
	if err := raiseAmbient(ambient); err != nil {
		return err
	}
	if cfg.Isolated {
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("failed to set no_new_privs: %w", err)
		}
		// Last of all, as the task itself gets it: see seccomp.go. This
		// process execs the command itself, so the user namespace rules
		// go on at once.
		if err := installFilter(append(seccompList(threadCaps), usernsList(threadCaps)...)); err != nil {
			return err
		}
	}
	if spec.Dir != "" {
		if err := os.Chdir(spec.Dir); err != nil {
			return fmt.Errorf("failed to change to working directory %q: %w", spec.Dir, err)
		}
	}
	path, err := commandPath(spec)
	if err != nil {
		return err
	}
	argv := append([]string{spec.Command}, spec.Args...)
	env := spec.Env
	if env == nil {
		env = []string{}
	}
	err = syscall.Exec(path, argv, env)
	return fmt.Errorf("failed to execute %q: %w", path, err)
}

// commandPath is the executable the task runs: Path as the driver resolved
// it, or Command looked up in the task's PATH.
func commandPath(spec *wire.Spec) (string, error) {
	if spec.Path == "" {
		return lookPath(spec.Command, spec.Dir, spec.Env)
	}
	if !filepath.IsAbs(spec.Path) {
		return "", fmt.Errorf("command %q: the resolved path %q is not absolute", spec.Command, spec.Path)
	}
	if err := checkExecutable(spec.Path); err != nil {
		return "", fmt.Errorf("command %q: %q: %w", spec.Command, spec.Path, err)
	}
	return spec.Path, nil
}

// lookPath finds command like a shell would, with the PATH of the task's
// environment. Executability is checked for the current (task) user. A
// relative path (a command with a slash, or a relative PATH entry) is
// relative to the task's working directory dir, as execve takes it once
// the task is there (runc and Docker resolve an image's ENTRYPOINT
// ["bin/plugin"] in its WORKDIR so), whatever directory this process is
// in; the path returned is absolute when dir is.
func lookPath(command, dir string, env []string) (string, error) {
	if command == "" {
		return "", errors.New("command is empty")
	}
	inDir := func(p string) string {
		if dir != "" && !filepath.IsAbs(p) {
			return filepath.Join(dir, p)
		}
		return p
	}
	if strings.Contains(command, "/") {
		p := inDir(command)
		if err := checkExecutable(p); err != nil {
			return "", fmt.Errorf("command %q: %w", command, err)
		}
		return p, nil
	}
	pathVar := defaultPath
	for i := len(env) - 1; i >= 0; i-- {
		if v, ok := strings.CutPrefix(env[i], "PATH="); ok {
			pathVar = v
			break
		}
	}
	var firstErr error
	for _, entry := range filepath.SplitList(pathVar) {
		if entry == "" {
			entry = "."
		}
		p := inDir(filepath.Join(entry, command))
		err := checkExecutable(p)
		if err == nil {
			return p, nil
		}
		if firstErr == nil && !errors.Is(err, os.ErrNotExist) {
			firstErr = fmt.Errorf("command %q: %q: %w", command, p, err)
		}
	}
	if firstErr != nil {
		return "", firstErr
	}
	return "", fmt.Errorf("command %q not found in PATH", command)
}

func checkExecutable(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return errors.New("is a directory")
	}
	if err := unix.Faccessat(unix.AT_FDCWD, path, unix.X_OK, 0); err != nil {
		return fmt.Errorf("not executable: %w", err)
	}
	return nil
}

// defaultPath is searched when the task's environment has no PATH.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
