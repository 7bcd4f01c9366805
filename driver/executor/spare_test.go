package executor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// locked returns what f reads of s with s.mu held. Checks are made on
// what it returns, once the lock is free: a check that fails with the lock
// held ends the test with it held, and the test's cleanup (s.Close) then
// waits for it until the test binary's timeout, instead of the test
// failing.
func locked[T any](s *Spares, f func() T) T {
	s.mu.Lock()
	defer s.mu.Unlock()
	return f()
}

// waitSpare waits until s has a spare of binary ready and returns its pid.
func waitSpare(t *testing.T, s *Spares, binary string) int {
	t.Helper()
	var pid int
	waitFor(t, "a spare supervisor", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		if sp := s.spares[binary]; sp != nil && sp.cmd != nil {
			pid = sp.cmd.Process.Pid
			return true
		}
		return false
	})
	return pid
}

// readySpare gives a test (root) its Spares with one spare of the
// supervisor ready, and that spare's pid.
func readySpare(t *testing.T) (*Spares, int) {
	t.Helper()
	requireTaskRoot(t)
	s := &Spares{}
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	return s, waitSpare(t, s, "")
}

func alive(pid int) bool {
	_, err := os.Stat("/proc/" + strconv.Itoa(pid))
	return err == nil
}

// A spare supervisor takes the next task, with its late mounts, logs into
// the task's state directory, and is replaced by a new spare afterwards.
func TestSpares_StartUsesSpare_Root(t *testing.T) {
	s, spare := readySpare(t)

	tt := newTestSpec(t, "/bin/sh", "-c", "cat /late/data/f")
	vol := t.TempDir()
	must.NoError(t, os.WriteFile(vol+"/f", []byte("through a spare\n"), 0o644))
	tt.spec.LateMounts = []Mount{{Target: "/late/data"}}
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: "/late/data", ReadOnly: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, spare, p.State().SupervisorPID)
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "through a spare\n", readFile(t, tt.stdout))
	must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+wire.SupervisorLogFile), "task started")

	next := waitSpare(t, s, "")
	must.NotEq(t, spare, next)
	s.Close()
	waitFor(t, "the spare to exit", func() bool { return !alive(next) })
	// Closed: no more spares.
	s.Fill("", hclog.NewNullLogger())
	time.Sleep(50 * time.Millisecond)
	must.Nil(t, s.spares)
}

// A spare catches every signal while it waits, as the supervisor of a task
// does (the work is done before its task comes): SIGTERM, SIGINT and
// SIGHUP leave it alive and able to take the next task.
func TestSpares_WaitingSpareCatchesSignals_Root(t *testing.T) {
	s, spare := readySpare(t)
	// The handlers come before the spare opens its handle on the host's
	// root (runSupervisor): once that is open, a signal finds them. (The
	// Go runtime catches SIGTERM from the start, to die of it: SigCgt
	// cannot tell.)
	waitFor(t, "the spare's handle on the host's root", func() bool {
		fds, err := os.ReadDir("/proc/" + strconv.Itoa(spare) + "/fd")
		must.NoError(t, err)
		for _, fd := range fds {
			if l, err := os.Readlink("/proc/" + strconv.Itoa(spare) + "/fd/" + fd.Name()); err == nil && l == "/" {
				return true
			}
		}
		return false
	})
	for _, sig := range []unix.Signal{unix.SIGTERM, unix.SIGINT, unix.SIGHUP} {
		must.NoError(t, unix.Kill(spare, sig))
	}
	time.Sleep(100 * time.Millisecond)
	must.True(t, alive(spare), must.Sprint("a signal ended the waiting spare"))

	tt := newTestSpec(t, "/bin/true")
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, spare, p.State().SupervisorPID)
	must.Eq(t, 0, waitExit(t, p).ExitCode)
}

// A spare that died meanwhile is not used: the task gets a supervisor of
// its own, and a failing task through a spare leaves nothing behind.
func TestSpares_DeadSpareAndErrors_Root(t *testing.T) {
	requireTaskRoot(t)
	// The dead spare's refill is held back, so that the start below finds
	// the dead spare itself, as one does that takes it between its death
	// and its reaper.
	refills := make(chan func(), 1)
	var extraRefill atomic.Bool
	s := &Spares{died: map[string]int{"": 1}, after: func(_ time.Duration, f func()) {
		// Never blocks the pool's goroutine that waits: a second refill
		// while the first is held is recorded, and checked below.
		select {
		case refills <- f:
		default:
			extraRefill.Store(true)
		}
	}}
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	dead := waitSpare(t, s, "")
	s.mu.Lock()
	sp := s.spares[""]
	s.mu.Unlock()
	must.NoError(t, syscallKill(dead))
	<-sp.reaped
	waitFor(t, "the dead spare to leave the pool", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.spares[""] != nil {
			return false
		}
		s.spares[""] = sp
		return true
	})
	tt := newTestSpec(t, "/bin/sh", "-c", "echo own")
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.NotEq(t, dead, p.State().SupervisorPID)
	must.Eq(t, 0, waitExit(t, p).ExitCode)
	must.Eq(t, "own\n", readFile(t, tt.stdout))

	// The start's own fill waits for the back-off, as the pool does.
	must.Nil(t, locked(s, func() *spare { return s.spares[""] }), must.Sprint("a spare started during the back-off"))
	var refill func()
	select {
	case refill = <-refills:
	case <-time.After(10 * time.Second):
		t.Fatal("the dead spare's refill was never waited for: no spare is started after its back-off")
	}
	must.False(t, extraRefill.Load(), must.Sprint("a second refill was waited for while the dead spare's one waited"))
	refill()
	spare := waitSpare(t, s, "")
	tt = newTestSpec(t, "definitely-not-a-command")
	failed, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.Nil(t, failed)
	must.ErrorContains(t, err, `command "definitely-not-a-command" not found in PATH`)
	waitFor(t, "the failed spare to exit", func() bool { return !alive(spare) })
	must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
}

// A spare killed while it waits (out of memory, an operator's kill)
// leaves the pool as it is reaped, and another takes its place: the next
// start gets a spare, without waiting for the dead one's age.
func TestSpares_DeadWaitingSpareIsReplaced_Root(t *testing.T) {
	s, dead := readySpare(t)
	must.NoError(t, syscallKill(dead))
	var next int
	waitFor(t, "a new spare in the dead one's place", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		sp := s.spares[""]
		if sp == nil || sp.cmd == nil || sp.cmd.Process.Pid == dead {
			return false
		}
		next = sp.cmd.Process.Pid
		return true
	})
	must.Eq(t, 1, locked(s, func() int { return s.died[""] }))

	tt := newTestSpec(t, "/bin/true")
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, next, p.State().SupervisorPID)
	must.Eq(t, 0, waitExit(t, p).ExitCode)
	// A task took a spare: the next death starts another at once again.
	must.Eq(t, 0, locked(s, func() int { return s.died[""] }))
}

// A spare that dies at once every time (here a binary that exits at
// once) is not started again in a loop: the first one dead is replaced at
// once, each later one after twice as long as the one before, up to the
// spares' age; nothing is started while the pool waits, and a pool
// closed meanwhile starts nothing.
func TestSpares_SpareDyingAtOnceBacksOff(t *testing.T) {
	type refill struct {
		delay time.Duration
		f     func()
	}
	refills := make(chan refill, 1)
	const binary = "/bin/true"
	s := &Spares{after: func(d time.Duration, f func()) { refills <- refill{d, f} }}
	t.Cleanup(s.Close)
	next := func() refill {
		t.Helper()
		select {
		case r := <-refills:
			return r
		case <-time.After(10 * time.Second):
			t.Fatal("no refill waited for: the dying spare is started again and again, or never")
			return refill{}
		}
	}
	s.Fill(binary, hclog.NewNullLogger())
	var got []time.Duration
	for range 9 {
		r := next()
		got = append(got, r.delay)
		s.mu.Lock()
		held := s.spares[binary]
		s.mu.Unlock()
		must.Nil(t, held, must.Sprint("a spare started while the pool waited"))
		r.f()
	}
	must.Eq(t, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second,
		32 * time.Second, time.Minute, time.Minute, time.Minute}, got)

	r := next()
	s.Close()
	r.f()
	must.Nil(t, s.spares)
}

// While the pool waits out a dying spare's back-off, a start's own Fill
// (each Start fills after it) starts no spare: a spare binary that dies at
// once would otherwise cost every start one more fork, and double the
// back-off each time. The wait's end starts one.
func TestSpares_FillWaitsOutBackOff(t *testing.T) {
	type refill struct {
		delay time.Duration
		f     func()
	}
	refills := make(chan refill, 1)
	const binary = "/bin/true"
	s := &Spares{after: func(d time.Duration, f func()) { refills <- refill{d, f} }}
	t.Cleanup(s.Close)
	next := func() refill {
		t.Helper()
		select {
		case r := <-refills:
			return r
		case <-time.After(10 * time.Second):
			t.Fatal("no refill waited for")
			return refill{}
		}
	}
	s.Fill(binary, hclog.NewNullLogger())
	r := next()
	must.Eq(t, time.Second, r.delay)
	for range 3 {
		// What Start runs after it, spare or not.
		s.Fill(binary, hclog.NewNullLogger())
		s.mu.Lock()
		started := s.spares[binary] != nil
		s.mu.Unlock()
		must.False(t, started, must.Sprint("a start's fill started a spare during the back-off"))
	}
	must.Eq(t, 2, locked(s, func() int { return s.died[binary] }))
	// The wait ends: a spare is started, dies, and the next wait doubles.
	r.f()
	must.Eq(t, 2*time.Second, next().delay)
}

func syscallKill(pid int) error {
	p, err := os.FindProcess(pid)
	if err != nil {
		return err
	}
	return p.Kill()
}

// A spare with a directory prepares the task's root ahead: a task whose
// mounts all come late runs in it (the directory is gone once entered),
// with its mounts and a sealed root; a task with other mounts gets a root
// made for it, and the prepared one is let go.
func TestSpares_PreparedRoot_Root(t *testing.T) {
	requireTaskRoot(t)
	dir := t.TempDir()
	s := &Spares{}
	s.SetDir(dir, nil)
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	waitSpare(t, s, "")
	// The spare made its directory and removed it once it entered the
	// root it prepared there.
	waitFor(t, "the spare to enter its prepared root", func() bool {
		entries, err := os.ReadDir(dir)
		return err == nil && len(entries) == 0
	})

	vol := t.TempDir()
	must.NoError(t, os.WriteFile(vol+"/f", []byte("prepared\n"), 0o644))
	top := "/ncsi-prepared-" + strconv.Itoa(os.Getpid())
	tt := newTestSpec(t, "/bin/sh", "-c", `cat "$TOP/f"
if touch /top-level-file 2>/dev/null; then echo root-writable; else echo root-read-only; fi`)
	tt.spec.Env = append(tt.spec.Env, "TOP="+top)
	tt.spec.LateMounts = []Mount{{Target: top}}
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: top, ReadOnly: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "prepared\nroot-read-only\n", readFile(t, tt.stdout))
	must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+wire.SupervisorLogFile), "root_prepared_ahead=true")
	_, err = os.Stat(top)
	must.True(t, os.IsNotExist(err))

	// Early mounts: the prepared root does not serve.
	waitSpare(t, s, "")
	src := t.TempDir()
	must.NoError(t, os.WriteFile(src+"/g", []byte("early\n"), 0o644))
	tt = newTestSpec(t, "/bin/cat", "/early/g")
	tt.spec.Mounts = []Mount{{Source: src, Target: "/early"}}
	p2, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	t.Cleanup(func() { _ = p2.Kill(); _ = p2.Destroy() })
	must.Eq(t, 0, waitExit(t, p2).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "early\n", readFile(t, tt.stdout))
	must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+wire.SupervisorLogFile), "root_prepared_ahead=false")

	// Spares are replaced when they get old, and leave no directory.
	// Under s.mu, which Fill holds when it reads it.
	s.mu.Lock()
	old := spareMaxAge
	spareMaxAge = 50 * time.Millisecond
	s.mu.Unlock()
	t.Cleanup(func() {
		s.mu.Lock()
		spareMaxAge = old
		s.mu.Unlock()
	})
	first := waitSpare(t, s, "")
	s.mu.Lock()
	sp := s.spares[""]
	s.mu.Unlock()
	s.replace("", sp, hclog.NewNullLogger())
	waitFor(t, "a new spare", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		sp := s.spares[""]
		return sp != nil && sp.cmd != nil && sp.cmd.Process.Pid != first
	})
	s.Close()
	waitFor(t, "no spare directories", func() bool {
		entries, err := os.ReadDir(dir)
		must.NoError(t, err)
		return len(entries) == 0
	})
}

// The driver never removes a spare's root directory while the spare lives,
// not even once a task took the spare without the root prepared there: the
// spare may still be preparing it, and the removal would detach the tmpfs
// it prepares in (see the supervisor's mountRootTmpfs). The directory goes
// once the spare is reaped, and nothing else in the spares directory with
// it. The spare is a script that reports a started task and then waits to
// be killed, so that the driver's side is seen without a race.
func TestSpares_RootRemovedOnlyOnceReaped_Root(t *testing.T) {
	requireTaskRoot(t)
	bin := filepath.Join(t.TempDir(), "spare")
	must.NoError(t, os.WriteFile(bin, []byte(`#!/bin/sh
printf '{"task_pid":%d}\n' $$ >&3
exec sleep 600
`), 0o755))
	dir := t.TempDir()
	other := filepath.Join(dir, "not-a-spare")
	must.NoError(t, os.Mkdir(other, 0o700))
	s := &Spares{}
	s.SetDir(dir, nil)
	t.Cleanup(s.Close)
	s.Fill(bin, hclog.NewNullLogger())
	pid := waitSpare(t, s, bin)
	t.Cleanup(func() { _ = unix.Kill(pid, unix.SIGKILL) })
	s.mu.Lock()
	root := s.spares[bin].root
	s.mu.Unlock()
	must.StrHasPrefix(t, dir+"/spare-", root)

	tt := newTestSpec(t, "/bin/true")
	tt.spec.Supervisor = bin
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	must.Eq(t, pid, p.State().SupervisorPID)
	_, err = os.Lstat(root)
	must.NoError(t, err, must.Sprint("the spare's directory went while the spare lives"))

	must.NoError(t, unix.Kill(pid, unix.SIGKILL))
	waitFor(t, "the spare's directory to go", func() bool {
		_, err := os.Lstat(root)
		return errors.Is(err, fs.ErrNotExist)
	})
	// The spare started after the task goes with Close.
	s.Close()
	waitFor(t, "only what is not a spare's to stay", func() bool {
		entries, err := os.ReadDir(dir)
		must.NoError(t, err)
		return len(entries) == 1 && entries[0].Name() == "not-a-spare"
	})
}

// A spare prepares an isolated root ahead in a PID namespace of its own:
// an isolated task with only late mounts runs in it; a task that wants the
// host's PID namespace does not take that spare.
func TestSpares_PreparedIsolatedRoot_Root(t *testing.T) {
	requireTaskRoot(t)
	dir := t.TempDir()
	iso := &Isolation{ChrootEnv: DefaultChrootEnv, PrivatePID: true, PrivateIPC: true}
	s := &Spares{}
	s.SetDir(dir, iso)
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	waitSpare(t, s, "")

	vol := t.TempDir()
	must.NoError(t, os.WriteFile(vol+"/f", []byte("prepared\n"), 0o644))
	tt := isolatedSpec(t, `cat /data/f; echo "root=$(ls / | tr '\n' ' ')"; echo "procs=$(ls /proc | grep -c '^[0-9]')"
if touch /data/x 2>/dev/null; then echo vol=writable; else echo vol=read-only; fi`)
	tt.spec.LateMounts = []Mount{{Target: "/data"}}
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: "/data", ReadOnly: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	out := readFile(t, tt.stdout)
	must.StrHasPrefix(t, "prepared\n", out)
	must.StrContains(t, outputLines(out)["root"], "data")
	must.StrNotContains(t, outputLines(out)["root"], "home")
	must.Eq(t, "read-only", outputLines(out)["vol"])
	_, err = os.Stat(vol + "/x")
	must.True(t, os.IsNotExist(err))
	must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+wire.SupervisorLogFile), "root_prepared_ahead=true")

	// pid_mode host: the spare (in a PID namespace of its own) cannot
	// serve; the task gets a supervisor of its own and sees the host's
	// processes.
	waitSpare(t, s, "")
	tt = isolatedSpec(t, `echo "procs=$(ls /proc | grep -c '^[0-9]')"`)
	tt.spec.Isolation = &Isolation{ChrootEnv: DefaultChrootEnv, PrivateIPC: true}
	p2, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
	must.NoError(t, err)
	t.Cleanup(func() { _ = p2.Kill(); _ = p2.Destroy() })
	must.Eq(t, 0, waitExit(t, p2).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	procs, err := strconv.Atoi(outputLines(readFile(t, tt.stdout))["procs"])
	must.NoError(t, err)
	must.Greater(t, 10, procs, must.Sprint("pid_mode host sees the host's processes"))
	must.True(t, s.Waiting(""), must.Sprint("the spare is still there for the next isolated task"))
}

// aheadGroups lists the groups made ahead under parent, in any hierarchy.
func aheadGroups(t *testing.T, parent string) []string {
	t.Helper()
	var out []string
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, root := range roots {
		dirs, err := filepath.Glob(filepath.Join(root, parent, wire.SpareGroupPrefix+"*"))
		must.NoError(t, err)
		out = append(out, dirs...)
	}
	return out
}

// On cgroup v1 a spare that prepares an isolated root makes its task's
// cgroup ahead: the task runs in a group of its own name with its own
// limits, the spare's name is gone, and a spare killed before any task
// leaves no group behind. Groups made ahead by spares that are gone are
// removed when the spares are set up again.
func TestSpares_GroupMadeAhead_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/sys/fs/cgroup/pids"); err != nil {
		t.Skip("groups are made ahead on cgroup v1 only")
	}
	tt := isolatedSpec(t, `cat /proc/self/cgroup`)
	parent := tt.spec.CgroupParent
	// Groups left by spares of a driver that was killed with them (one of
	// them named as a driver that still runs names them, by a PID whose
	// start time is not that process's), and one of a driver that runs.
	init1, err := wire.ProcStartTime(1)
	must.NoError(t, err)
	var left []string
	for _, name := range []string{"left", fmt.Sprintf("1-%d-3-4", init1+1), fmt.Sprintf("1-%d-3-4", init1)} {
		dir := filepath.Join("/sys/fs/cgroup/pids", parent, wire.SpareGroupPrefix+name)
		must.NoError(t, os.MkdirAll(dir, 0o755))
		t.Cleanup(func() { _ = unix.Rmdir(dir) })
		left = append(left, dir)
	}

	s := &Spares{}
	s.SetDir(t.TempDir(), tt.spec.Isolation)
	s.SetGroup(parent, cgroups.Limits{Devices: cgroups.DefaultDevices}, hclog.NewNullLogger())
	for _, dir := range left[:2] {
		_, err := os.Stat(dir)
		must.True(t, os.IsNotExist(err), must.Sprintf("the group %s a gone spare left is removed", dir))
	}
	must.DirExists(t, left[2], must.Sprint("a running driver's spare keeps its group"))
	must.NoError(t, unix.Rmdir(left[2]))
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	waitSpare(t, s, "")
	waitFor(t, "the spare's group", func() bool { return len(aheadGroups(t, parent)) > 0 })
	made := aheadGroups(t, parent)
	// Set up again (a second SetConfig): the waiting spare keeps its group.
	s.SetGroup(parent, cgroups.Limits{Devices: cgroups.DefaultDevices}, hclog.NewNullLogger())
	must.Eq(t, made, aheadGroups(t, parent))

	vol := t.TempDir()
	tt.spec.Limits = cgroups.Limits{Devices: cgroups.DefaultDevices, MemoryBytes: 96 << 20, CPUShares: 300}
	tt.spec.LateMounts = []Mount{{Target: "/data"}}
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: "/data"}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.StrContains(t, readFile(t, tt.stdout), ":pids:/"+parent+"/"+tt.spec.TaskID+"\n")
	must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+wire.SupervisorLogFile), "the task took the cgroup made ahead")
	for _, dir := range made {
		_, err := os.Stat(dir)
		must.True(t, os.IsNotExist(err), must.Sprintf("%s is left after its task took it", dir))
	}
	mem := filepath.Join("/sys/fs/cgroup/memory", parent, tt.spec.TaskID)
	must.Eq(t, strconv.Itoa(96<<20)+"\n", readFile(t, filepath.Join(mem, "memory.limit_in_bytes")))
	must.Eq(t, "300\n", readFile(t, filepath.Join("/sys/fs/cgroup/cpu", parent, tt.spec.TaskID, "cpu.shares")))

	// The next spare's group is made with the limits the task had. Its
	// directories appear before their limits are written: the files are
	// read once they hold what they should, or the wait ends the test.
	waitSpare(t, s, "")
	waitFor(t, "the next spare's group", func() bool { return len(aheadGroups(t, parent)) > 0 })
	waitFor(t, "the next spare's group to have the last task's limits", func() bool {
		for file, want := range map[string]string{
			"cpu/" + parent + "/" + wire.SpareGroupPrefix + "*/cpu.shares":               "300\n",
			"memory/" + parent + "/" + wire.SpareGroupPrefix + "*/memory.limit_in_bytes": strconv.Itoa(96<<20) + "\n",
		} {
			files, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", file))
			if len(files) != 1 {
				return false
			}
			if b, err := os.ReadFile(files[0]); err != nil || string(b) != want {
				return false
			}
		}
		return true
	})
	next := aheadGroup(t, parent, "memory")
	must.Eq(t, strconv.Itoa(96<<20)+"\n", readFile(t, filepath.Join(next, "memory.limit_in_bytes")))
	must.Eq(t, "300\n", readFile(t, filepath.Join(aheadGroup(t, parent, "cpu"), "cpu.shares")))

	// A task unlike the last one gets its own limits, every one that
	// differs written as it claims the group: the same files a group
	// made for it has.
	second := isolatedSpec(t, `cat /proc/self/cgroup`)
	second.spec.CgroupParent = parent
	second.spec.Limits = cgroups.Limits{Devices: cgroups.DefaultDevices, MemoryBytes: 64 << 20, MemoryReservationBytes: 32 << 20, CPUQuota: 50000, CPUPeriod: 100000}
	second.spec.LateMounts = []Mount{{Target: "/data"}}
	p2, err := s.Start(hclog.NewNullLogger(), second.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: "/data"}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p2.Kill(); _ = p2.Destroy() })
	must.Eq(t, 0, waitExit(t, p2).ExitCode, must.Sprintf("stderr: %s", readFile(t, second.stderr)))
	must.StrContains(t, readFile(t, second.spec.StateDir+"/"+wire.SupervisorLogFile), "the task took the cgroup made ahead")
	made2, err := cgroups.Create(parent, "made-"+second.spec.TaskID, second.spec.Limits)
	must.NoError(t, err)
	t.Cleanup(func() { _ = made2.Destroy() })
	for ctrl, files := range map[string][]string{
		"memory": {"memory.limit_in_bytes", "memory.soft_limit_in_bytes", "memory.memsw.limit_in_bytes"},
		"cpu":    {"cpu.shares", "cpu.cfs_quota_us", "cpu.cfs_period_us"},
		"pids":   {"pids.max"},
	} {
		for _, file := range files {
			want, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", ctrl, parent, "made-"+second.spec.TaskID, file))
			if os.IsNotExist(err) {
				continue // no swap accounting on this kernel
			}
			must.NoError(t, err)
			must.Eq(t, string(want), readFile(t, filepath.Join("/sys/fs/cgroup", ctrl, parent, second.spec.TaskID, file)),
				must.Sprintf("%s of the task unlike the last one", file))
		}
	}
	must.NoError(t, made2.Destroy())

	// The next spare's group, until the spares are stopped (SIGKILL).
	waitSpare(t, s, "")
	waitFor(t, "the next spare's group", func() bool { return len(aheadGroups(t, parent)) > 0 })
	s.Close()
	must.Eq(t, []string(nil), aheadGroups(t, parent))
}

// Later spares make their group with the limits of the last isolated task
// that started under their parent, its cpuset left out (Nomad's group,
// joined at the start), in a copy of its own: not those of a privileged
// task (no device filter: its group could not serve an isolated task), of
// a task with the host's view, of a task under another parent, or of a
// task that did not start; and none when no group is made ahead (cgroup
// v2).
func TestSpares_LearnLimits(t *testing.T) {
	base := cgroups.Limits{Devices: cgroups.DefaultDevices, PidsMax: 100}
	own := cgroups.Limits{MemoryBytes: 96 << 20, MemoryReservationBytes: 64 << 20, CPUShares: 300, CPUQuota: 50000, CPUPeriod: 100000,
		PidsMax: 100, Devices: append(slices.Clone(cgroups.DefaultDevices), cgroups.DeviceRule{Type: 'b', Major: 8, Minor: 0, Access: "r"}),
		CpusetCpus: "0", CpusetCgroupPath: "/sys/fs/cgroup/cpuset/nomad/shared"}
	learned := own
	learned.CpusetCpus, learned.CpusetCgroupPath = "", ""
	cases := []struct {
		name  string
		group *wire.SpareGroup
		spec  func(spec *Spec)
		want  *wire.SpareGroup
	}{
		{name: "an isolated task", group: &wire.SpareGroup{Parent: "p", Limits: base},
			want: &wire.SpareGroup{Parent: "p", Limits: learned}},
		{name: "a privileged task", group: &wire.SpareGroup{Parent: "p", Limits: base},
			spec: func(spec *Spec) { spec.Privileged, spec.Isolation, spec.Limits.Devices = true, nil, nil },
			want: &wire.SpareGroup{Parent: "p", Limits: base}},
		{name: "a task with the host's view", group: &wire.SpareGroup{Parent: "p", Limits: base},
			spec: func(spec *Spec) { spec.Isolation = nil },
			want: &wire.SpareGroup{Parent: "p", Limits: base}},
		{name: "a task without a device filter", group: &wire.SpareGroup{Parent: "p", Limits: base},
			spec: func(spec *Spec) { spec.Limits.Devices = nil },
			want: &wire.SpareGroup{Parent: "p", Limits: base}},
		{name: "a task under another parent", group: &wire.SpareGroup{Parent: "p", Limits: base},
			spec: func(spec *Spec) { spec.CgroupParent = "q" },
			want: &wire.SpareGroup{Parent: "p", Limits: base}},
		{name: "no group made ahead", spec: func(*Spec) {}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			spec := &Spec{CgroupParent: "p", Isolation: &Isolation{PrivatePID: true}, Limits: own}
			spec.Limits.Devices = slices.Clone(own.Devices)
			if tc.spec != nil {
				tc.spec(spec)
			}
			s := &Spares{group: tc.group}
			s.learnLimits(spec)
			must.Eq(t, tc.want, s.group)
			if spec.Limits.Devices != nil {
				// The task's rules are its own: a change to them is not
				// the spares'.
				spec.Limits.Devices[0].Access = "rwm"
				must.Eq(t, tc.want, s.group)
			}
		})
	}

	t.Run("a task that did not start", func(t *testing.T) {
		s := &Spares{group: &wire.SpareGroup{Parent: "p", Limits: base}}
		s.Close() // no spare is started for the next task
		spec := &Spec{TaskID: "t", Command: "/bin/true", StateDir: filepath.Join(t.TempDir(), "gone"), CgroupParent: "p",
			Isolation: &Isolation{PrivatePID: true}, Limits: own}
		_, err := s.Start(hclog.NewNullLogger(), spec, nil)
		must.ErrorContains(t, err, "state_dir")
		must.Eq(t, &wire.SpareGroup{Parent: "p", Limits: base}, s.group)
	})
}

// Tasks that start at once teach the spares their limits while the spares
// are set up again (a second SetConfig) and a spare reads the group it is
// to make (startSpare passes it on as JSON); a task's rules change after
// its start. Run under the race detector.
func TestSpares_LearnLimitsConcurrently(t *testing.T) {
	parent := fmt.Sprintf("nomad-driver-csi-executor-test-learn-%d", os.Getpid())
	s := &Spares{group: &wire.SpareGroup{Parent: parent, Limits: cgroups.Limits{Devices: cgroups.DefaultDevices}}}
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			for j := range 50 {
				spec := &Spec{CgroupParent: parent, Isolation: &Isolation{}, Limits: cgroups.Limits{
					MemoryBytes: int64(i*100+j+1) << 20, Devices: slices.Clone(cgroups.DefaultDevices)}}
				s.learnLimits(spec)
				spec.Limits.Devices[0].Access = "rwm"
			}
		})
	}
	wg.Go(func() {
		for range 20 {
			s.SetGroup(parent, cgroups.Limits{Devices: cgroups.DefaultDevices}, hclog.NewNullLogger())
		}
	})
	wg.Go(func() {
		for range 200 {
			s.mu.Lock()
			group := s.group
			s.mu.Unlock()
			if group != nil {
				_, err := json.Marshal(group)
				must.NoError(t, err)
			}
		}
	})
	wg.Wait()
	must.Eq(t, parent, s.group.Parent)
	must.Eq(t, cgroups.DefaultDevices, s.group.Limits.Devices)
}

// aheadGroup is the one group made ahead under parent in ctrl's
// hierarchy.
func aheadGroup(t *testing.T, parent, ctrl string) string {
	t.Helper()
	dirs, err := filepath.Glob(filepath.Join("/sys/fs/cgroup", ctrl, parent, wire.SpareGroupPrefix+"*"))
	must.NoError(t, err)
	must.SliceLen(t, 1, dirs, must.Sprintf("groups made ahead in the %s hierarchy", ctrl))
	return dirs[0]
}

// aheadHierarchies counts the v1 hierarchies a group made ahead with a
// device filter has a directory in (controllers mounted together share
// one).
func aheadHierarchies(t *testing.T) int {
	t.Helper()
	seen := map[string]bool{}
	for _, ctrl := range []string{"memory", "cpu", "cpuacct", "pids", "freezer", "devices"} {
		if r, err := filepath.EvalSymlinks(filepath.Join("/sys/fs/cgroup", ctrl)); err == nil {
			seen[r] = true
		}
	}
	return len(seen)
}

// A spare taken for a task is still this process's spare until its task
// claims its group: setting the spares up again (a second SetConfig) while
// the task starts must not remove the group the spare is about to claim.
func TestSpares_SetGroupKeepsTakenSpare_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/sys/fs/cgroup/pids"); err != nil {
		t.Skip("groups are made ahead on cgroup v1 only")
	}
	tt := isolatedSpec(t, `true`)
	parent := tt.spec.CgroupParent
	l := cgroups.Limits{Devices: cgroups.DefaultDevices}
	s := &Spares{}
	s.SetDir(t.TempDir(), tt.spec.Isolation)
	s.SetGroup(parent, l, hclog.NewNullLogger())
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	waitSpare(t, s, "")
	n := aheadHierarchies(t)
	waitFor(t, "the spare's group", func() bool { return len(aheadGroups(t, parent)) == n })
	made := aheadGroups(t, parent)

	sp := s.take("", privatePID(tt.spec.Isolation))
	must.NotNil(t, sp)
	t.Cleanup(func() {
		sp.stop()
		must.Eq(t, []string(nil), aheadGroups(t, parent), must.Sprint("the reaper removes a killed spare's group"))
	})
	s.SetGroup(parent, l, hclog.NewNullLogger())
	must.Eq(t, made, aheadGroups(t, parent), must.Sprint("the group of a spare taken for a task is kept"))
}
