package supervisor

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// launchTask starts the task from an OS thread of the supervisor's own
// that becomes the task's environment first: a fresh mount namespace with
// the task's root and mounts, the task's cgroup, and the bounding and
// inheritable capability sets the task may have. A child forked from that
// thread starts with all of it, so no second program has to be executed
// to set the task up. The thread is never unlocked: the runtime ends it
// with its goroutine, and only the task keeps the namespace alive.
//
// It calls started on the thread as soon as the command runs and, on v1,
// the thread has left the task's cgroup (see cgroups.Group.JoinThread), and
// returns after that; left says whether leaving failed (the thread is then
// still in the group, and nothing may look for the group's processes until
// it ends). On error nothing forked is left (a seccomp stage forked ahead
// of the late mounts was killed and reaped), and the thread has left the
// group.
//
// claim is called as the last step before the command may run (see
// claimGo); when it fails, the command does not run.
func launchTask(spec *wire.Spec, group *cgroups.Group, stdio func() ([]*os.File, error), ctl *os.File, claim func() error, started func(*exec.Cmd), pre *prebuilt) (cmd *exec.Cmd, left <-chan error, err error) {
	type result struct {
		cmd *exec.Cmd
		err error
	}
	done := make(chan result, 1)
	leftCh := make(chan error, 1)
	job := func(pivoted bool) {
		cmd, leave, err := launchOnThread(spec, group, stdio, ctl, claim, pivoted)
		var lerr error
		if err == nil && leave != nil {
			// Out of the task's cgroup before the driver hears of the
			// task: the driver may kill the group at once (a stop right
			// after the start), and this process, with a thread still in
			// the group, would die with it and lose the exit status.
			lerr = leave()
		}
		if err == nil {
			started(cmd)
		}
		done <- result{cmd, err}
		leftCh <- lerr
	}
	if pre == nil || !pre.take(spec, job) {
		go func() {
			runtime.LockOSThread()
			job(false)
		}()
	}
	r := <-done
	return r.cmd, leftCh, r.err
}

// prebuilt is a launching thread prepared before its task is known, by a
// spare supervisor: in a new mount namespace, the host's mounts made slaves
// and the task's root assembled and entered. It serves a task whose mounts
// all come as trees (late mounts), since a mount made on the host after the
// namespace was made may be missing from it when the host's mounts are
// private.
type prebuilt struct {
	ready chan error
	jobs  chan func(pivoted bool)
	// used is set once a task took the thread.
	used bool
	// iso is the isolation the root was built for.
	iso *wire.Isolation
	// why says why a task did not take the thread, for the log.
	why string
}

// prebuild prepares a launching thread with the task's root assembled at
// root, a directory of its own that is removed once entered, for tasks
// isolated as iso (nil: with the host's view). The driver made root and
// removes it once this process is gone, if the thread did not get that
// far; nothing of the build is ever made outside the root's tmpfs (see
// mountRootTmpfs).
func prebuild(root string, iso *wire.Isolation) *prebuilt {
	p := &prebuilt{ready: make(chan error, 1), jobs: make(chan func(bool), 1), iso: iso}
	go func() {
		// Never unlocked, like launchTask's thread.
		runtime.LockOSThread()
		err := buildNamespace(root, iso)
		p.ready <- err
		if err != nil {
			return
		}
		if job, ok := <-p.jobs; ok {
			job(true)
		}
	}()
	return p
}

func buildNamespace(root string, iso *wire.Isolation) error {
	if err := unix.Unshare(namespaceFlags(iso)); err != nil {
		return fmt.Errorf("failed to make the task's namespaces: %w", err)
	}
	if err := prepareNamespace(mounter.New(), nil, root, iso, nil); err != nil {
		return err
	}
	if err := pivotRoot(root); err != nil {
		return err
	}
	// The host's directory is no mount point in this namespace any more:
	// the root moved off it. An isolated root does not show the host's
	// paths: the directory is reached through the handle on the host's
	// root.
	dir := root
	if hostRoot >= 0 {
		dir = filepath.Join(hostRootPath(), root)
	}
	if err := os.Remove(dir); err != nil {
		return fmt.Errorf("failed to remove the spare's root directory %q: %w", root, err)
	}
	return nil
}

// take runs job on the prepared thread when it suits spec and was prepared
// without error; otherwise the thread is let go and take returns false.
func (p *prebuilt) take(spec *wire.Spec, job func(pivoted bool)) bool {
	// A task in a network namespace of its own needs its sysfs mounted
	// there: see netns.go.
	if spec.NetNS != "" {
		p.why = "the task joins a network namespace and the prepared root's sysfs shows the host's network"
		close(p.jobs)
		return false
	}
	if spec.Image != nil {
		p.why = "the task's root is an image, not the chroot_env root prepared ahead"
		close(p.jobs)
		return false
	}
	if len(spec.Mounts) > 0 || !p.iso.Equal(spec.Isolation) {
		p.why = "the task's mounts or isolation differ from the prepared root's"
		close(p.jobs)
		return false
	}
	if err := <-p.ready; err != nil {
		p.why = "the prepared root failed: " + err.Error()
		return false
	}
	p.used = true
	p.jobs <- job
	return true
}

// discard lets a thread go that no task will take.
func (p *prebuilt) discard() { close(p.jobs) }

// launchOnThread runs on launchTask's thread. It does what does not depend
// on the late mounts before it waits for them.
func launchOnThread(spec *wire.Spec, group *cgroups.Group, stdio func() ([]*os.File, error), ctl *os.File, claim func() error, pivoted bool) (cmd *exec.Cmd, leave func() error, err error) {
	// The thread enters the task's root (or has already): the host's
	// cgroup file systems, which an isolated root does not mount, are
	// reached through the supervisor's handle on the host's root, before
	// and after.
	if hostRoot >= 0 {
		group = group.Via(hostRootPath())
	}
	cred, err := specCredential(spec)
	if err != nil {
		return nil, nil, err
	}
	last, err := lastCap()
	if err != nil {
		return nil, nil, err
	}
	keep, err := keptCaps(spec.Privileged, spec.Capabilities, last)
	if err != nil {
		return nil, nil, err
	}

	var m mounter.Interface = mounter.New()
	root := filepath.Join(spec.StateDir, "root")
	if spec.Image != nil {
		m = newImageTargets(m, root, spec)
	}
	iso := spec.Isolation
	var early, after []wire.Mount
	if iso == nil {
		early, after = splitLate(spec.Mounts, spec.LateMounts)
	}
	var trees []*os.File
	defer func() {
		for _, t := range trees {
			_ = t.Close()
		}
	}()
	if !pivoted {
		// unshare(2) of the mount and IPC namespaces (and so of the
		// filesystem context) changes only the calling thread.
		if err := unix.Unshare(namespaceFlags(iso)); err != nil {
			return nil, nil, fmt.Errorf("failed to make the task's namespaces: %w", err)
		}
		// Before the root's sysfs is mounted: see netns.go.
		if err := joinNetNS(spec.NetNS); err != nil {
			return nil, nil, err
		}
		// The task's root is made in its state directory; the tmpfs goes
		// onto it (see mountRootTmpfs).
		if err := os.Mkdir(root, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, nil, fmt.Errorf("failed to create the task's root %q: %w", root, err)
		}
		if err := prepareNamespace(m, spec.Mounts, root, iso, spec.Image); err != nil {
			return nil, nil, err
		}
		if iso == nil {
			if err := bindAll(m, early, root); err != nil {
				return nil, nil, err
			}
		} else {
			// An isolated task's mounts are all attached inside its root,
			// once entered: its host sources are taken now, while the
			// host's root is still reachable.
			for _, mnt := range spec.Mounts {
				var t *os.File
				if mnt.Beneath != "" {
					t, err = m.CloneTreeBeneath(mnt.Beneath, mnt.Source, true)
				} else {
					t, err = m.CloneTree(mnt.Source, true)
				}
				if err != nil {
					return nil, nil, fmt.Errorf("mount %q: %w", mnt.Target, err)
				}
				trees = append(trees, t)
			}
		}
	}

	// The bounding and inheritable sets are per thread and inherited by the
	// child; the thread's effective set stays full, for the mounts still to
	// come and for setuid(2) and setgid(2) in the child. At exec a root
	// task gets exactly the kept set (inheritable and bounding), and a task
	// of another user, whose permitted set setuid(2) emptied, gets nothing.
	if err := dropBoundingSet(keep, last); err != nil {
		return nil, nil, err
	}
	inheritable := keep
	if cred.UID != 0 {
		inheritable = 0
	}
	if err := setThreadCaps(inheritable, false); err != nil {
		return nil, nil, err
	}
	groups := make([]uint32, len(cred.Groups))
	copy(groups, cred.Groups)
	attr := &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: cred.UID, Gid: cred.GID, Groups: groups},
	}
	// held is what the task holds once it runs: the kept set as root, its
	// ambient set as another user. The seccomp filter lets through the
	// calls these capabilities are for.
	held := keep
	if cred.UID != 0 {
		ambient, err := capsOf(spec.AmbientCapabilities, keep)
		if err != nil {
			return nil, nil, err
		}
		held = ambient
		for n := 0; n < 64; n++ {
			if ambient.has(n) {
				attr.AmbientCaps = append(attr.AmbientCaps, uintptr(n))
			}
		}
	}
	if dir := group.UnifiedDir(); dir != "" {
		fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, nil, fmt.Errorf("failed to open the task's cgroup %s: %w", dir, err)
		}
		defer unix.Close(fd)
		attr.UseCgroupFD, attr.CgroupFD = true, fd
	} else if leave, err = group.JoinThread(); err != nil {
		return nil, nil, err
	}
	allowDevices, doneDevices, err := group.DeviceAllower()
	if err != nil {
		if leave != nil {
			err = errors.Join(err, leave())
		}
		return nil, nil, err
	}
	defer doneDevices()
	// A seccomp stage forked ahead of the late mounts has the thread leave
	// the group at once: nothing else is forked from it.
	// A failed leave is reported as it is after a fork at the end (launchTask
	// hears it from the leave returned).
	var (
		leftEarly bool
		leftErr   error
	)
	forked := func() {
		if leave != nil {
			leftEarly, leftErr = true, leave()
		}
	}
	cmd, err = forkTask(m, spec, attr, root, after, trees, stdio, ctl, claim, pivoted, allowDevices, held, forked)
	switch {
	case leftEarly && err != nil:
		err = errors.Join(err, leftErr)
		leave = nil
	case leftEarly:
		leave = func() error { return leftErr }
	case err != nil && leave != nil:
		err = errors.Join(err, leave())
		leave = nil
	}
	return cmd, leave, err
}

// forkTask finishes the task's mounts once the late ones are there, enters
// its root and forks it. early are trees of spec.Mounts taken before, for
// an isolated task.
//
// A task that is not privileged has its seccomp stage forked before the
// late mounts come (it waits for its go-ahead: see wire.SeccompGoFD), and
// forked is called once it is; the go-ahead gives it the working
// directory, the command's path and its stdio once the mounts are there.
// claim comes right before the go-ahead, or the fork of a privileged
// command: only once it succeeded may the command run.
func forkTask(m mounter.Interface, spec *wire.Spec, attr *syscall.SysProcAttr, root string, after []wire.Mount, early []*os.File, stdio func() ([]*os.File, error), ctl *os.File, claim func() error, pivoted bool, allowDevices func([]cgroups.DeviceRule) error, held capSet, forked func()) (_ *exec.Cmd, err error) {
	// The root is entered before the wait, so that what is left after the
	// volumes come is short: their trees are attached at their targets in
	// the entered root, which is sealed after that. Mounts inside a
	// volume's target bind host paths, which are reached by their own
	// names only before the root is entered: then the root waits. An
	// isolated task has no such mounts (all its mounts come as trees), so
	// every target of it is made inside its root, where no path, symlink
	// or not, leads out.
	pivotFirst := len(after) == 0
	if pivotFirst && !pivoted {
		if err := pivotRoot(root); err != nil {
			return nil, err
		}
	}
	// The task's own /tmp (a tmpfs of bounded size, tmp_size) comes before
	// the mounts: one inside /tmp (a volume at /tmp/data) is attached on
	// it, where a tmpfs mounted after would hide it, and the task would
	// write into its /tmp what it meant for its volume. An isolated task
	// has no mounts bound by host path (after), so its root is entered by
	// now, and "/tmp" is its own.
	if spec.Isolation != nil {
		if !pivotFirst {
			return nil, errors.New("an isolated task has mounts bound by host path: its /tmp would be made outside its root")
		}
		if err := mountTmp(m, spec.Isolation, spec.Mounts, spec.LateMounts); err != nil {
			return nil, err
		}
	}
	mounts, trees := spec.Mounts, early
	if spec.Isolation == nil {
		mounts, trees = nil, nil
	}
	env := spec.Env
	if env == nil {
		env = []string{}
	}
	// What the seccomp filter and stage of a task that is not privileged
	// need depends on the spec alone: made before the volumes come, it is
	// off the path from their arrival to the task's start.
	var stage *seccompStage
	if spec.Isolation != nil {
		if stage, err = startStage(spec, attr, env, held); err != nil {
			return nil, err
		}
		defer func() {
			if err != nil {
				killStarted(stage.cmd)
			}
			stage.close()
		}()
		forked()
	}
	if len(spec.LateMounts) > 0 {
		late, lateTrees, err := receiveTrees(ctl, spec.LateMounts)
		if err != nil {
			return nil, err
		}
		defer func() {
			for _, t := range lateTrees {
				_ = t.Close()
			}
		}()
		mounts = append(append([]wire.Mount(nil), mounts...), late...)
		trees = append(append([]*os.File(nil), trees...), lateTrees...)
	}
	at := root
	if pivotFirst {
		at = "/"
	}
	// A block-device volume is a device node the task must be able to
	// open: the device filter learns it now that it is published.
	if rules, err := deviceRules(trees, mounts); err != nil {
		return nil, err
	} else if len(rules) > 0 {
		if err := allowDevices(rules); err != nil {
			return nil, err
		}
	}
	// An isolated task's /dev takes the targets of device nodes handed to
	// it (see buildDev) and is sealed after them.
	var dev *os.File
	if spec.Isolation != nil {
		if dev, err = openDev(); err != nil {
			return nil, err
		}
		defer dev.Close()
	}
	if err := attachAll(m, trees, mounts, at, spec.Isolation != nil); err != nil {
		return nil, err
	}
	if err := bindAll(m, after, at); err != nil {
		return nil, err
	}
	if dev != nil {
		if err := sealDev(dev); err != nil {
			return nil, err
		}
	}
	if !pivotFirst {
		if err := pivotRoot(root); err != nil {
			return nil, err
		}
	}
	// An image's working directory may be missing from the image, as
	// Docker and runc make it: made here, without following a symlink
	// inside another of the task's mounts (see imageTargets).
	if spec.Image != nil && spec.Dir != "" {
		if _, err := os.Stat(spec.Dir); errors.Is(err, os.ErrNotExist) {
			f, err := m.OpenTarget("/", spec.Dir, true)
			if err != nil {
				return nil, fmt.Errorf("failed to make working directory %q: %w", spec.Dir, err)
			}
			_ = f.Close()
		}
	}
	// An image root keeps its writable layer, unless the job asked for
	// readonly_rootfs.
	if spec.Image == nil || spec.Image.ReadOnly {
		if err := sealRoot(m); err != nil {
			return nil, err
		}
	}

	if spec.Dir != "" {
		if fi, err := os.Stat(spec.Dir); err != nil {
			return nil, fmt.Errorf("failed to change to working directory %q: %w", spec.Dir, err)
		} else if !fi.IsDir() {
			return nil, fmt.Errorf("failed to change to working directory %q: not a directory", spec.Dir)
		}
	}
	path, err := commandPath(spec)
	if err != nil {
		return nil, err
	}
	files, err := stdio()
	if err != nil {
		return nil, err
	}
	// Start may have given up on the task meanwhile: the command runs
	// only when this process, not Start, took the go token.
	if err := claim(); err != nil {
		return nil, err
	}
	if stage != nil {
		if err := stage.goAhead(spec.Dir, path, files); err != nil {
			return nil, err
		}
		return stage.cmd, nil
	}
	cmd := &exec.Cmd{
		Path:        path,
		Args:        append([]string{spec.Command}, spec.Args...),
		Env:         env,
		Dir:         spec.Dir,
		Stdin:       files[0],
		Stdout:      files[1],
		Stderr:      files[2],
		SysProcAttr: attr,
	}
	if err := startAdjusted(cmd, spec.OOMScoreAdj); err != nil {
		return nil, fmt.Errorf("failed to execute %q: %w", path, err)
	}
	return cmd, nil
}

// startAdjusted starts cmd from the calling thread with its oom_score_adj
// at adj, which the child inherits, and puts the thread's back after.
func startAdjusted(cmd *exec.Cmd, adj int) error {
	restore, err := setOOMScoreAdj(adj)
	if err != nil {
		return err
	}
	err = cmd.Start()
	if rerr := restore(); rerr != nil && err == nil {
		err = rerr
		killStarted(cmd)
	}
	return err
}

// seccompStage is a task's seccomp stage, forked and waiting for its
// go-ahead (wire.SeccompGoFD).
type seccompStage struct {
	cmd *exec.Cmd
	// answer is the read end of its error pipe (wire.SeccompErrorFD).
	answer *os.File
	// sock is this end of its go-ahead socket.
	sock *os.File
}

// startStage forks the seccomp stage of a task that is not privileged from
// the calling thread, whose namespaces, cgroup and capability sets it
// inherits, as the task (attr). Until its go-ahead it runs nothing of the
// task's: it attaches the task's filter and the user namespace rules
// (which a launching thread cannot hold: Go forks with clone3, which they
// refuse; see usernsList) and waits. The launching thread goes on with
// the task's mounts, which the stage sees (it shares the thread's mount
// namespace), and so could not hold the filter itself.
//
// The stage runs for a task that holds SYS_ADMIN too, which gets no user
// namespace rules: the fork is this binary on the host's mount until it
// execs, so a command named /proc/self/exe (or a script with that
// interpreter) exec'd from it would run the host's file, which a root task
// could then chmod through /proc/<pid>/exe; the stage is run from
// selfExe's read-only clone.
func startStage(spec *wire.Spec, attr *syscall.SysProcAttr, env []string, held capSet) (_ *seccompStage, err error) {
	if selfExe == nil {
		return nil, errors.New("the supervisor's binary is not open: cannot start the seccomp stage")
	}
	if spec.Image != nil {
		if err := checkStaticExe(selfExe); err != nil {
			return nil, err
		}
	}
	filter, err := seccompFilter(held)
	if err != nil {
		return nil, err
	}
	if err := checkProgramLen(filter); err != nil {
		return nil, err
	}
	envFile, err := stageFile(env, filter)
	if err != nil {
		return nil, err
	}
	defer envFile.Close()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to make the seccomp stage's go-ahead socket: %w", err)
	}
	sock := os.NewFile(uintptr(fds[0]), "seccomp-go-ahead")
	peer := os.NewFile(uintptr(fds[1]), "seccomp-go-ahead")
	defer peer.Close()
	r, w, err := os.Pipe()
	if err != nil {
		_ = sock.Close()
		return nil, fmt.Errorf("failed to make the seccomp stage's error pipe: %w", err)
	}
	defer w.Close()
	defer func() {
		if err != nil {
			_ = r.Close()
			_ = sock.Close()
		}
	}()
	// Per thread, and inherited: the task and everything it runs can never
	// gain privileges through setuid binaries or file capabilities (and
	// the stage may attach its filters without CAP_SYS_ADMIN).
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return nil, fmt.Errorf("failed to set no_new_privs: %w", err)
	}
	// stdio is /dev/null until the go-ahead hands over the task's own.
	cmd := &exec.Cmd{
		Path:        fmt.Sprintf("/proc/self/fd/%d", wire.SeccompExeFD),
		Args:        append([]string{spec.Command, wire.StageSeccomp, spec.Command}, spec.Args...),
		Env:         []string{},
		ExtraFiles:  []*os.File{selfExe, w, envFile, peer},
		SysProcAttr: attr,
	}
	if err := startAdjusted(cmd, spec.OOMScoreAdj); err != nil {
		return nil, fmt.Errorf("failed to start the seccomp stage: %w", err)
	}
	return &seccompStage{cmd: cmd, answer: r, sock: sock}, nil
}

// goAhead hands the stage the task's working directory, its command's
// path and stdio, and returns once the stage exec'd the command (or says
// why it did not).
func (s *seccompStage) goAhead(dir, path string, stdio []*os.File) error {
	if strings.IndexByte(dir, 0) >= 0 || strings.IndexByte(path, 0) >= 0 || path == "" {
		return fmt.Errorf("command path %q or working directory %q cannot be passed to the seccomp stage", path, dir)
	}
	if len(dir)+len(path)+2 > wire.SeccompGoMax {
		return fmt.Errorf("command path %q and working directory %q are longer than %d bytes together", path, dir, wire.SeccompGoMax-2)
	}
	msg := make([]byte, 0, len(dir)+len(path)+2)
	msg = append(append(append(append(msg, dir...), 0), path...), 0)
	rights := unix.UnixRights(int(stdio[0].Fd()), int(stdio[1].Fd()), int(stdio[2].Fd()))
	serr := unix.Sendmsg(int(s.sock.Fd()), msg, rights, nil, unix.MSG_NOSIGNAL)
	runtime.KeepAlive(stdio)
	_ = s.sock.Close()
	err := stageAnswer(s.answer, dir, path)
	if serr != nil && errors.Is(err, errStageEnded) {
		// A stage that never got its go-ahead cannot have exec'd, and says
		// nothing when it ends at the EOF; one gone before it had /dev/null
		// for stdio. The send and how the stage ended say why.
		how := "could not be waited for"
		if st, werr := s.cmd.Process.Wait(); werr == nil {
			how = st.String()
		}
		err = fmt.Errorf("failed to give the seccomp stage its go-ahead: %w (the stage ended: %s)", serr, how)
	}
	return err
}

// close closes this process's ends of the stage's pipe and socket.
func (s *seccompStage) close() {
	_ = s.answer.Close()
	_ = s.sock.Close()
}

// errStageEnded is stageAnswer's error for a stage that said nothing: it
// ended before it started the command.
var errStageEnded = errors.New("the seccomp stage ended before it started the command (its reason, if any, is in the task's stderr)")

// stageTimeout bounds the wait for the seccomp stage to exec the command
// once it has its go-ahead.
var stageTimeout = time.Minute

// stageAnswer reads what the seccomp stage says on its error pipe, whose
// write end this process has closed: the ready byte and EOF when it
// executed the command, an error otherwise (what it wrote, the errno of
// the step that failed, or that it ended or hung before the exec).
func stageAnswer(r *os.File, dir, path string) error {
	if err := r.SetReadDeadline(time.Now().Add(stageTimeout)); err != nil {
		return fmt.Errorf("failed to bound the wait for the seccomp stage: %w", err)
	}
	msg, err := io.ReadAll(io.LimitReader(r, 4096))
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("the seccomp stage did not start the command within %v", stageTimeout)
	case err != nil:
		return fmt.Errorf("failed to read the seccomp stage's answer: %w", err)
	case string(msg) == wire.SeccompReady:
		return nil
	case len(msg) == 0:
		return errStageEnded
	}
	errnoAfter := func(prefix string) (syscall.Errno, bool) {
		rest, ok := strings.CutPrefix(string(msg), prefix)
		if !ok || len(rest) != 2 {
			return 0, false
		}
		return syscall.Errno(binary.LittleEndian.Uint16([]byte(rest))), true
	}
	if errno, ok := errnoAfter(wire.SeccompReady + wire.SeccompExecFailed); ok {
		return fmt.Errorf("failed to execute %q: %w", path, errno)
	}
	if errno, ok := errnoAfter(wire.SeccompChdirFailed); ok {
		return fmt.Errorf("failed to change to working directory %q: %w", dir, errno)
	}
	if errno, ok := errnoAfter(wire.SeccompGoFailed); ok {
		return fmt.Errorf("the seccomp stage could not take its go-ahead: %w", errno)
	}
	return errors.New(strings.TrimPrefix(string(msg), wire.SeccompReady))
}

// goAheadMessage checks what the seccomp stage received on its go-ahead
// socket (n bytes of buf, noob of oob, the receive's flags) and returns
// the working directory, the command's path and the three descriptors.
// Whatever it returns, the descriptors received are in fds.
func goAheadMessage(buf, oob []byte, flags int) (dir, path string, fds []int, err error) {
	if msgs, perr := unix.ParseSocketControlMessage(oob); perr == nil {
		for _, m := range msgs {
			if got, rerr := unix.ParseUnixRights(&m); rerr == nil {
				fds = append(fds, got...)
			}
		}
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		return "", "", fds, errors.New("the go-ahead was truncated")
	}
	if len(fds) != 3 {
		return "", "", fds, fmt.Errorf("the go-ahead came with %d descriptors, want 3", len(fds))
	}
	d, rest, ok := strings.Cut(string(buf), "\x00")
	p, tail, ok2 := strings.Cut(rest, "\x00")
	if !ok || !ok2 || tail != "" || p == "" {
		return "", "", fds, errors.New("the go-ahead is not a directory and a path, each NUL-terminated")
	}
	return d, p, fds, nil
}

// stageFile is the seccomp stage's memory file (wire.SeccompEnvFD): the
// task's filter (none when empty), which the stage attaches, the user
// namespace rules, which it adds unless it holds CAP_SYS_ADMIN, and the
// task's environment, handed to the command alone (never in the stage's
// own environment or arguments). It is sealed: no process that reaches the
// descriptor can change what the stage reads.
func stageFile(env []string, filter []unix.SockFilter) (*os.File, error) {
	userns, err := seccompProgram(usernsList(0))
	if err != nil {
		return nil, err
	}
	fd, err := unix.MemfdCreate("nomad-task-env", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("failed to make the seccomp stage's environment file: %w", err)
	}
	f := os.NewFile(uintptr(fd), "nomad-task-env")
	size := 16 + 8*len(filter) + 8*len(userns)
	for _, kv := range env {
		size += len(kv) + 1
	}
	b := make([]byte, 0, size)
	for _, prog := range [][]unix.SockFilter{filter, userns} {
		b = binary.LittleEndian.AppendUint64(b, uint64(len(prog)))
		for _, in := range prog {
			b = binary.LittleEndian.AppendUint16(b, in.Code)
			b = append(b, in.Jt, in.Jf)
			b = binary.LittleEndian.AppendUint32(b, in.K)
		}
	}
	for _, kv := range env {
		b = append(append(b, kv...), 0)
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return nil, fmt.Errorf("failed to write the seccomp stage's environment file: %w", err)
	}
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SEAL|unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE); err != nil {
		f.Close()
		return nil, fmt.Errorf("failed to seal the seccomp stage's environment file: %w", err)
	}
	return f, nil
}

// readStageFile reads what stageFile wrote, from offset 0: the task's
// filter, the user namespace rules and the environment.
func readStageFile(f *os.File) (filter, userns []unix.SockFilter, env []string, err error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, nil, nil, err
	}
	b := make([]byte, fi.Size())
	if _, err := f.ReadAt(b, 0); err != nil && !errors.Is(err, io.EOF) {
		return nil, nil, nil, err
	}
	var progs [2][]unix.SockFilter
	for p := range progs {
		if len(b) < 8 {
			return nil, nil, nil, fmt.Errorf("the file has %d bytes left for filter %d's length", len(b), p+1)
		}
		n := binary.LittleEndian.Uint64(b)
		b = b[8:]
		if n > uint64(len(b))/8 {
			return nil, nil, nil, fmt.Errorf("the file has %d bytes left for filter %d's %d instructions", len(b), p+1, n)
		}
		prog := make([]unix.SockFilter, n)
		for i := range prog {
			in := b[8*i:]
			prog[i] = unix.SockFilter{Code: binary.LittleEndian.Uint16(in), Jt: in[2], Jf: in[3], K: binary.LittleEndian.Uint32(in[4:])}
		}
		progs[p] = prog
		b = b[8*n:]
	}
	env = []string{}
	for _, kv := range strings.Split(string(b), "\x00") {
		if kv != "" {
			env = append(env, kv)
		}
	}
	return progs[0], progs[1], env, nil
}

// deviceRules are the device filter rules for the trees that are device
// nodes (block-device volumes, devices Nomad hands over), read-only ones
// for read-only mounts.
func deviceRules(trees []*os.File, mounts []wire.Mount) ([]cgroups.DeviceRule, error) {
	var rules []cgroups.DeviceRule
	for i, t := range trees {
		access := "rw"
		if mounts[i].ReadOnly {
			access = "r"
		}
		r, ok, err := cgroups.DeviceRuleForFile(t, access)
		if err != nil {
			return nil, fmt.Errorf("mount %q: %w", mounts[i].Target, err)
		}
		if ok {
			rules = append(rules, r)
		}
	}
	return rules, nil
}

// namespaceFlags are the unshare(2) flags of a task's launching thread.
func namespaceFlags(iso *wire.Isolation) int {
	flags := unix.CLONE_FS | unix.CLONE_NEWNS
	if iso != nil && iso.PrivateIPC {
		flags |= unix.CLONE_NEWIPC
	}
	return flags
}

// killStarted kills and reaps a task that started but cannot be kept.
func killStarted(cmd *exec.Cmd) {
	_ = cmd.Process.Kill()
	_, _ = cmd.Process.Wait()
}

// splitLate divides mounts into those set up before the late mounts and
// those whose targets lie inside a late mount's target, which must wait
// for it.
func splitLate(mounts, late []wire.Mount) (early, after []wire.Mount) {
	for _, mnt := range mounts {
		inside := false
		for _, l := range late {
			if mounter.PathWithin(filepath.Clean(mnt.Target), filepath.Clean(l.Target)) {
				inside = true
				break
			}
		}
		if inside {
			after = append(after, mnt)
		} else {
			early = append(early, mnt)
		}
	}
	return early, after
}

// attachAll attaches the late mounts' trees, parents before children;
// isolated: the task is not privileged (attachTree).
func attachAll(m mounter.Interface, trees []*os.File, late []wire.Mount, root string, isolated bool) error {
	order := make([]int, len(late))
	for i := range order {
		order[i] = i
	}
	// Stable: equal depths keep the spec's order.
	for i := 1; i < len(order); i++ {
		for j := i; j > 0 && depth(late[order[j]].Target) < depth(late[order[j-1]].Target); j-- {
			order[j], order[j-1] = order[j-1], order[j]
		}
	}
	for _, i := range order {
		if err := attachTree(m, trees[i], late[i], root, isolated); err != nil {
			return err
		}
	}
	return nil
}

// receiveTrees waits for Start's wire.LateMessage and returns its mounts and
// their trees, checked against the spec's late mounts.
func receiveTrees(ctl *os.File, want []wire.Mount) ([]wire.Mount, []*os.File, error) {
	if ctl == nil {
		return nil, nil, errors.New("the task has late mounts but the supervisor has no control socket")
	}
	buf := make([]byte, wire.LateMessageMax)
	oob := make([]byte, unix.CmsgSpace(4*len(want)))
	nr, noob, flags, _, err := unix.Recvmsg(int(ctl.Fd()), buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to receive the task's volumes: %w", err)
	}
	var trees []*os.File
	fail := func(err error) ([]wire.Mount, []*os.File, error) {
		for _, t := range trees {
			_ = t.Close()
		}
		return nil, nil, err
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:noob])
	if err != nil {
		return fail(fmt.Errorf("failed to receive the task's volumes: %w", err))
	}
	for _, msg := range msgs {
		fds, err := unix.ParseUnixRights(&msg)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			trees = append(trees, os.NewFile(uintptr(fd), "late-mount-"+strconv.Itoa(len(trees))))
		}
	}
	switch {
	case nr == 0 && len(trees) == 0:
		return fail(errors.New("the driver gave up on the task before its volumes were ready"))
	case flags&(unix.MSG_CTRUNC|unix.MSG_TRUNC) != 0:
		return fail(errors.New("failed to receive the task's volumes: the message was truncated"))
	}
	var lm wire.LateMessage
	if err := json.Unmarshal(buf[:nr], &lm); err != nil {
		return fail(fmt.Errorf("failed to decode the driver's message about the task's volumes: %w", err))
	}
	if lm.Error != "" {
		return fail(errors.New(lm.Error))
	}
	if len(trees) != len(want) || len(lm.Mounts) != len(want) {
		return fail(fmt.Errorf("failed to receive the task's volumes: got %d mounts and %d trees for %d volumes",
			len(lm.Mounts), len(trees), len(want)))
	}
	for i, mnt := range lm.Mounts {
		if filepath.Clean(mnt.Target) != filepath.Clean(want[i].Target) {
			return fail(fmt.Errorf("failed to receive the task's volumes: mount %d is for %q, want %q", i, mnt.Target, want[i].Target))
		}
	}
	return lm.Mounts, trees, nil
}

// setOOMScoreAdj gives this process, and so the task forked next, the
// task's oom_score_adj; restore puts the supervisor's own back. Lowering it
// again needs no privilege as long as it does not go below where it was.
func setOOMScoreAdj(adj int) (restore func() error, err error) {
	const path = "/proc/self/oom_score_adj"
	if adj == 0 {
		return func() error { return nil }, nil
	}
	old, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("failed to read oom_score_adj: %w", err)
	}
	if err := os.WriteFile(path, []byte(strconv.Itoa(adj)), 0); err != nil {
		return nil, fmt.Errorf("failed to set oom_score_adj to %d: %w", adj, err)
	}
	return func() error {
		if err := os.WriteFile(path, []byte(strings.TrimSpace(string(old))), 0); err != nil {
			return fmt.Errorf("failed to restore the supervisor's oom_score_adj: %w", err)
		}
		return nil
	}, nil
}
