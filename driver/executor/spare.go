package executor

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// Spares keeps one supervisor started ahead of need for each supervisor
// binary, so that a task's start does not wait for a program to start (a
// few milliseconds of exec and runtime start-up, which on a small machine
// also take CPU from the task's volume calls). A spare knows nothing of a
// task until Start hands it one; it exits on its own when its driver goes
// away. The zero value is ready to use, and a nil *Spares has no spares.
type Spares struct {
	mu     sync.Mutex
	spares map[string]*spare
	closed bool
	// dir, when set, holds a directory per spare for the task root it
	// prepares ahead (see prebuilt); without it a spare prepares nothing.
	dir string
	// iso is the isolation spares prepare for: a spare of an isolation
	// with a private PID namespace starts in one of its own.
	iso *Isolation
	// group, when set, has spares that prepare an isolated root make
	// their task's cgroup ahead too, under group.Parent with group.Limits
	// (see cgroups.Ahead): SetGroup's, then the last isolated task's (see
	// learnLimits); each names its own.
	group *wire.SpareGroup
	// died counts, per binary, the waiting spares that died one after
	// the other without a task taking one between (see dropDead).
	died map[string]int
	// held marks the binaries whose next spare waits for its back-off
	// (see backoff): a Fill meanwhile, a start's own among them, starts
	// none, so a spare that dies at once costs no fork per start.
	held map[string]bool
	// after is time.AfterFunc; tests set it to see the refills waited
	// for.
	after func(time.Duration, func())
}

// spareMaxAge bounds how old a spare's prepared namespace gets before the
// spare is replaced: its copy of the host's mounts may miss mounts made on
// the host since, when they do not propagate. Read under Spares.mu.
var spareMaxAge = time.Minute

// SetDir makes later spares prepare the task's root ahead, each in a
// directory of its own under dir (which must exist), for tasks isolated as
// iso (nil: for tasks with the host's view).
func (s *Spares) SetDir(dir string, iso *Isolation) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dir, s.iso = dir, iso
}

// SetGroup makes later spares that prepare an isolated root make their
// task's cgroup ahead, under parent, on cgroup v1 (elsewhere it does
// nothing): with the limits l (the limits every isolated task has) until an
// isolated task starts, then with that task's (see learnLimits). A task
// writes those of its own that differ when it claims the group. Groups
// made ahead by spares whose driver is gone (killed with them) are removed
// now, where empty; this process's spares and those of another running
// driver keep theirs.
func (s *Spares) SetGroup(parent string, l cgroups.Limits, logger hclog.Logger) {
	if s == nil || !cgroups.AheadAvailable() {
		return
	}
	// Held throughout, so that no spare starts making a group between the
	// names kept and the groups listed.
	aheadMu.Lock()
	if err := cgroups.RemoveAheadAll(parent, wire.SpareGroupPrefix, aheadKept); err != nil {
		logger.Warn("failed to remove cgroups made ahead by spare supervisors that are gone", "error", err)
	}
	aheadMu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.group = &wire.SpareGroup{Parent: parent, Limits: l}
}

// aheadLive names the groups made ahead by this process's spares that are
// not reaped yet: waiting, still starting, or taken for a task that has
// not claimed its group yet. Each is named before its spare starts and
// dropped once its reaper removed what is left of it; SetGroup keeps them.
var (
	aheadMu   sync.Mutex
	aheadLive = map[string]bool{}
)

// aheadOwner begins the names of this process's groups made ahead, after
// wire.SpareGroupPrefix: its PID and start time, so that a driver removes
// another's groups only once that driver is gone (two Nomad clients on one
// host may share a cgroup_parent).
var aheadOwner = sync.OnceValue(func() string {
	start, _ := wire.ProcStartTime(os.Getpid())
	return fmt.Sprintf("%d-%d-", os.Getpid(), start)
})

// aheadKept says whether the group made ahead of that name is kept when
// SetGroup removes those of spares that are gone: this process's live
// spares' groups, and those of another driver process that still runs.
// Called with aheadMu held.
func aheadKept(name string) bool {
	if aheadLive[name] {
		return true
	}
	rest := strings.TrimPrefix(name, wire.SpareGroupPrefix)
	if strings.HasPrefix(rest, aheadOwner()) {
		return false
	}
	var pid int
	var start uint64
	if _, err := fmt.Sscanf(rest, "%d-%d-", &pid, &start); err != nil || pid <= 0 {
		return false
	}
	got, err := wire.ProcStartTime(pid)
	return err == nil && got == start
}

// spare is a supervisor this process started: a spare waiting for its
// task, or one started for a task (see startSupervisor).
type spare struct {
	cmd *exec.Cmd
	// root is the directory of the task root the spare prepares ("" for
	// none); the spare removes it once it entered that root, and reap
	// once the spare is gone, never before (see removeRoot).
	root    string
	logger  hclog.Logger
	reportR *os.File
	// ctl is the driver's end of the control socket: the task's state
	// directory is sent first (wire.SpareHello), then the late mounts.
	ctl    *os.File
	reaped chan struct{}
	// after runs once the supervisor is reaped, on the goroutine that
	// reaped it (see afterReap).
	afterMu   sync.Mutex
	after     func()
	afterDone bool
	// pidNS is set for a supervisor started in a PID namespace of its own.
	pidNS bool
	// group is the cgroup the spare makes ahead (nil: none), removed once
	// the spare is reaped when it is still there (the spare was killed
	// before its task claimed it, or before it removed it).
	group *wire.SpareGroup
}

// afterReap has f run once the supervisor is reaped, on the goroutine that
// reaped it: no goroutine of the driver waits for a task's supervisor
// while it runs (onExited). When it is reaped already, f runs now.
func (sp *spare) afterReap(f func()) {
	sp.afterMu.Lock()
	if !sp.afterDone {
		sp.after = f
		sp.afterMu.Unlock()
		return
	}
	sp.afterMu.Unlock()
	f()
}

// reap reaps the supervisor once it has exited (onChildExited), removes
// its spare's root directory, and runs what afterReap gave.
func (sp *spare) reap() {
	_ = sp.cmd.Wait()
	if err := removeRoot(sp.root); err != nil {
		sp.logger.Warn("failed to remove a spare supervisor's directory", "path", sp.root, "error", err)
	}
	if sp.group != nil {
		if err := cgroups.RemoveAhead(sp.group.Parent, sp.group.Name); err != nil {
			sp.logger.Warn("failed to remove a spare supervisor's cgroup", "error", err)
		}
		aheadMu.Lock()
		delete(aheadLive, sp.group.Name)
		aheadMu.Unlock()
	}
	close(sp.reaped)
	sp.afterMu.Lock()
	f := sp.after
	sp.after, sp.afterDone = nil, true
	sp.afterMu.Unlock()
	if f != nil {
		f()
	}
}

// Start is the package's Start, run by a spare supervisor of
// spec.Supervisor when one is waiting. A new spare is started afterwards,
// in the background.
func (s *Spares) Start(logger hclog.Logger, spec *Spec, late func() ([]Mount, error)) (*Process, error) {
	defer s.Fill(spec.Supervisor, logger)
	// The spare's root directory is not removed here, even when the task
	// does not take the root prepared there: the spare may still be
	// preparing it, and only its reaper may remove it (see removeRoot).
	sp := s.take(spec.Supervisor, privatePID(spec.Isolation))
	p, err := start(logger, spec, late, sp)
	if err == nil {
		s.learnLimits(spec)
	}
	return p, err
}

// learnLimits has the next spares make their group ahead with the limits
// of spec's task, when it is an isolated task under the spares' parent:
// tasks on a node tend to come alike (the allocations of one job, or of
// one task group, ask for the same resources), and a task that claims a
// group made with its own limits writes none of them (see
// cgroups.Ahead.Claim). A task unlike the last one writes the limits that
// differ, as the first task does. The cpuset is never made ahead: it is
// Nomad's group, joined at the start.
func (s *Spares) learnLimits(spec *Spec) {
	if s == nil || spec.Isolation == nil || spec.Limits.Devices == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.group == nil || s.group.Parent != spec.CgroupParent {
		return
	}
	l := spec.Limits
	l.CpusetCpus, l.CpusetCgroupPath = "", ""
	l.Devices = slices.Clone(l.Devices)
	s.group = &wire.SpareGroup{Parent: s.group.Parent, Limits: l}
}

// Fill starts a spare supervisor of binary ("" is this binary) in the
// background unless one is waiting already, or the pool waits out the
// back-off of spares of binary that died (see dropDead). Failures are
// logged: a start without a spare starts its own supervisor.
func (s *Spares) Fill(binary string, logger hclog.Logger) {
	if s == nil {
		return
	}
	s.mu.Lock()
	if s.closed || s.spares[binary] != nil || s.held[binary] {
		s.mu.Unlock()
		return
	}
	if s.spares == nil {
		s.spares = map[string]*spare{}
	}
	// A placeholder, so that concurrent fills start one spare.
	s.spares[binary] = &spare{}
	dir, iso, group := s.dir, s.iso, s.group
	s.mu.Unlock()
	go func() {
		sp, err := startSpare(binary, dir, iso, group, logger)
		if err != nil {
			s.mu.Lock()
			delete(s.spares, binary)
			s.mu.Unlock()
			logger.Warn("failed to start a spare supervisor", "supervisor", binary, "error", err)
			return
		}
		// Before the spare is the pool's, so that the start that takes
		// it replaces this with its own (see start).
		sp.afterReap(func() { s.dropDead(binary, sp, logger) })
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			sp.stop()
			return
		}
		select {
		case <-sp.reaped:
			// It died before it was the pool's: dropDead saw the
			// placeholder, and it is dropped here instead.
			delete(s.spares, binary)
			delay := s.backoff(binary)
			s.mu.Unlock()
			s.replaceDead(binary, sp, delay, logger)
			return
		default:
		}
		s.spares[binary] = sp
		age := spareMaxAge
		s.mu.Unlock()
		time.AfterFunc(age, func() { s.replace(binary, sp, logger) })
	}()
}

// spareRetry is how long the pool waits before it starts a spare again
// after the second waiting spare in a row died; each further one doubles
// it, up to spareMaxAge.
const spareRetry = time.Second

// dropDead drops sp, a spare of binary that died while it waited (killed,
// out of memory), from the pool, and has another one started: at once
// after the first death, then after spareRetry, twice that after the next
// one, up to spareMaxAge, until a task takes a spare or one lives to be
// replaced for its age. A spare that dies at once every time is then
// started about once a minute, not in a loop. A spare taken meanwhile, or
// replaced, or one of a closed pool is not the pool's any more, and left
// alone.
func (s *Spares) dropDead(binary string, sp *spare, logger hclog.Logger) {
	s.mu.Lock()
	if s.spares[binary] != sp {
		s.mu.Unlock()
		return
	}
	delete(s.spares, binary)
	delay := s.backoff(binary)
	s.mu.Unlock()
	s.replaceDead(binary, sp, delay, logger)
}

// replaceDead lets go of sp, a spare of binary that died while it waited,
// says so, and starts another after delay (backoff).
func (s *Spares) replaceDead(binary string, sp *spare, delay time.Duration, logger hclog.Logger) {
	sp.closeFiles()
	logger.Warn("a waiting spare supervisor died; starting another", "supervisor", binary,
		"pid", sp.cmd.Process.Pid, "state", sp.cmd.ProcessState.String(), "start_in", delay.String())
	s.refill(binary, delay, logger)
}

// backoff counts a waiting spare of binary that died and returns how long
// to wait before the next one starts; a wait holds binary's fills until
// refill's timer ends it. Called with s.mu held.
func (s *Spares) backoff(binary string) time.Duration {
	if s.died == nil {
		s.died = map[string]int{}
	}
	n := s.died[binary]
	s.died[binary] = n + 1
	if n == 0 {
		return 0
	}
	d := spareRetry
	for i := 1; i < n && d < spareMaxAge; i++ {
		d *= 2
	}
	if s.held == nil {
		s.held = map[string]bool{}
	}
	s.held[binary] = true
	return min(d, spareMaxAge)
}

// refill starts a spare of binary after delay (at once for 0), ending the
// hold backoff put on its fills.
func (s *Spares) refill(binary string, delay time.Duration, logger hclog.Logger) {
	if delay == 0 {
		s.Fill(binary, logger)
		return
	}
	after := s.after
	if after == nil {
		after = func(d time.Duration, f func()) { time.AfterFunc(d, f) }
	}
	after(delay, func() {
		s.mu.Lock()
		delete(s.held, binary)
		s.mu.Unlock()
		s.Fill(binary, logger)
	})
}

// replace stops sp if it is still the spare of binary, and starts another.
func (s *Spares) replace(binary string, sp *spare, logger hclog.Logger) {
	s.mu.Lock()
	if s.spares[binary] != sp {
		s.mu.Unlock()
		return
	}
	delete(s.spares, binary)
	// It lived its whole time: spares of binary do not die at once.
	delete(s.died, binary)
	s.mu.Unlock()
	sp.stop()
	s.Fill(binary, logger)
}

// Waiting reports whether a spare supervisor of binary is ready for a
// task.
func (s *Spares) Waiting(binary string) bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sp := s.spares[binary]
	return sp != nil && sp.cmd != nil
}

// Close stops the spare supervisors; later Fills do nothing.
func (s *Spares) Close() {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.closed = true
	spares := s.spares
	s.spares = nil
	s.mu.Unlock()
	for _, sp := range spares {
		if sp.cmd != nil {
			sp.stop()
		}
	}
}

// take removes and returns the spare of binary, if one is ready and alive
// and in a PID namespace of its own exactly when pidNS is set.
func (s *Spares) take(binary string, pidNS bool) *spare {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sp := s.spares[binary]
	if sp == nil || sp.cmd == nil || sp.pidNS != pidNS {
		return nil
	}
	delete(s.spares, binary)
	select {
	case <-sp.reaped:
		sp.closeFiles()
		return nil
	default:
		delete(s.died, binary)
		return sp
	}
}

// spareSeq numbers the spares' root directories, so that no two spares of
// one driver process ever have the same one: a reaper removes its spare's
// directory by name, and must never hit another's.
var spareSeq atomic.Uint64

func startSpare(binary, dir string, iso *Isolation, group *wire.SpareGroup, logger hclog.Logger) (*spare, error) {
	var args []string
	var root string
	var ahead *wire.SpareGroup
	if dir != "" {
		var err error
		if root, err = os.MkdirTemp(dir, "spare-"+strconv.FormatUint(spareSeq.Add(1), 10)+"-"); err != nil {
			return nil, fmt.Errorf("failed to make a directory for a spare supervisor: %w", err)
		}
		args = []string{wire.SpareRootFlag, root}
		if iso != nil {
			b, err := json.Marshal(iso)
			if err != nil {
				_ = removeRoot(root)
				return nil, err
			}
			args = append(args, string(b))
			if group != nil {
				// Named after this process and the spare's root
				// directory, which no other spare of it has.
				ahead = &wire.SpareGroup{Parent: group.Parent, Name: wire.SpareGroupPrefix + aheadOwner() + strings.TrimPrefix(filepath.Base(root), "spare-"), Limits: group.Limits}
				if b, err = json.Marshal(ahead); err != nil {
					_ = removeRoot(root)
					return nil, err
				}
				args = append(args, string(b))
				aheadMu.Lock()
				aheadLive[ahead.Name] = true
				aheadMu.Unlock()
			}
		}
	}
	sp, err := startSupervisor(binary, args, nil, true, privatePID(iso), root, ahead, nil, logger)
	if err != nil {
		_ = removeRoot(root)
		if ahead != nil {
			aheadMu.Lock()
			delete(aheadLive, ahead.Name)
			aheadMu.Unlock()
		}
		return nil, err
	}
	return sp, nil
}

// privatePID reports whether tasks isolated as iso run in a PID namespace
// of their own.
func privatePID(iso *Isolation) bool { return iso != nil && iso.PrivatePID }

// startSupervisor starts binary ("" is this binary) as a supervisor with
// args, its output going to out (nil: /dev/null), with a report pipe and,
// when control is set, a control socket; the spare's reaped channel is
// closed once it is reaped. With pidNS the supervisor starts in a new PID
// namespace, as its init: its task will be the namespace's second process.
// root is a spare's root directory ("" for none) and group the cgroup it
// makes ahead (nil for none), removed once the supervisor is reaped;
// logger says when that fails. token is the task's go token (see
// wire.GoTokenFD), nil for a spare, which gets it with its task.
func startSupervisor(binary string, args []string, out *os.File, control, pidNS bool, root string, group *wire.SpareGroup, token *os.File, logger hclog.Logger) (*spare, error) {
	if binary == "" {
		binary = "/proc/self/exe"
	}
	reportR, reportW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("failed to make a pipe: %w", err)
	}
	// At fixed numbers: wire.ReportFD, wire.ControlFD (nil: none),
	// wire.GoTokenFD.
	extra := []*os.File{reportW, nil}
	var ctl *os.File
	if control {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			_ = reportR.Close()
			_ = reportW.Close()
			return nil, fmt.Errorf("failed to make a socket pair: %w", err)
		}
		ctl = os.NewFile(uintptr(fds[0]), "control-socket")
		extra[1] = os.NewFile(uintptr(fds[1]), "control-socket")
	}
	if token != nil {
		extra = append(extra, token)
	}
	cmd := &exec.Cmd{
		Path:        binary,
		Args:        append([]string{os.Args[0], wire.StageSupervisor}, args...),
		Env:         supervisorEnv(),
		ExtraFiles:  extra,
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	if pidNS {
		cmd.SysProcAttr.Cloneflags = unix.CLONE_NEWPID
	}
	if out != nil {
		cmd.Stdout, cmd.Stderr = out, out
	}
	err = cmd.Start()
	// The supervisor's ends; the token's read end stays Start's too.
	for _, f := range extra[:2] {
		if f != nil {
			_ = f.Close()
		}
	}
	if err != nil {
		_ = reportR.Close()
		if ctl != nil {
			_ = ctl.Close()
		}
		return nil, fmt.Errorf("failed to start the supervisor: %w", err)
	}
	sp := &spare{cmd: cmd, root: root, logger: logger, reportR: reportR, ctl: ctl, reaped: make(chan struct{}), pidNS: pidNS, group: group}
	onChildExited(cmd.Process, sp.reap)
	return sp, nil
}

// hand gives the spare its task's state directory and go token.
func (sp *spare) hand(stateDir string, token *os.File) error {
	if err := sendControl(sp.ctl, wire.SpareHello{StateDir: stateDir}, []int{int(token.Fd())}); err != nil {
		return fmt.Errorf("failed to hand the task to a spare supervisor: %w", err)
	}
	return nil
}

// stop ends a spare that will not be used: closing its control socket is
// enough, the kill makes sure. Its root directory is gone on return.
func (sp *spare) stop() {
	sp.closeFiles()
	_ = sp.cmd.Process.Kill()
	<-sp.reaped
}

// removeRoot removes a spare's root directory once the spare is gone (or
// never started), if the spare did not remove it itself. It removes that
// one directory and nothing else: the spare mounts its root's tmpfs on it
// in a mount namespace of its own, which died with it, and never makes
// anything on the host's side of it (the supervisor never makes the
// directory again once it is removed). rmdir(2) does not follow a symlink
// in the directory's place (ENOTDIR), does not remove a mount point of the
// driver's namespace (EBUSY), and removes nothing below the directory
// (ENOTEMPTY): whatever is there was not made by the spare, and stays.
// While the spare lives, the directory must stay: removing it would
// detach the tmpfs the spare prepares the root in.
func removeRoot(root string) error {
	if root == "" {
		return nil
	}
	if err := unix.Rmdir(root); err != nil && !errors.Is(err, unix.ENOENT) {
		return err
	}
	return nil
}

func (sp *spare) closeFiles() {
	if sp.ctl != nil {
		_ = sp.ctl.Close()
	}
	_ = sp.reportR.Close()
}
