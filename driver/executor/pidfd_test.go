package executor

import (
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// threads is this process's OS thread count.
func threads(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	must.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			must.NoError(t, err)
			return n
		}
	}
	t.Fatal("no Threads line in /proc/self/status")
	return 0
}

// Waiting for many processes costs no thread each: the waits sit in the
// runtime's poller. With a blocking poll(2) or waitid(2) per wait, as the
// driver had, its threads grew with its tasks (a thread per task for its
// whole life, two with the supervisor's reaping). Each wait returns once
// its process exits, child or not.
func TestWaitExited_NoThreadPerWait(t *testing.T) {
	const n = 64
	cmds := startSleepers(t, n)
	// Settle the runtime's own threads first.
	time.Sleep(100 * time.Millisecond)
	before := threads(t)
	done := make(chan int, n)
	for i, c := range cmds {
		fd, err := unix.PidfdOpen(c.Process.Pid, 0)
		must.NoError(t, err)
		t.Cleanup(func() { _ = unix.Close(fd) })
		go func() {
			must.NoError(t, waitExited(fd))
			done <- i
		}()
	}
	time.Sleep(500 * time.Millisecond)
	during := threads(t)
	must.Less(t, before+n/4, during, must.Sprintf("%d waits took %d threads (from %d to %d)", n, during-before, before, during))
	select {
	case i := <-done:
		t.Fatalf("wait %d returned while its process runs", i)
	default:
	}

	endSleepers(t, cmds, done)
}

// startSleepers starts n processes that sleep for a minute, killed and
// reaped at the test's end.
func startSleepers(t *testing.T, n int) []*exec.Cmd {
	t.Helper()
	var cmds []*exec.Cmd
	t.Cleanup(func() {
		for _, c := range cmds {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	})
	for range n {
		c := exec.Command("/bin/sleep", "60")
		must.NoError(t, c.Start())
		cmds = append(cmds, c)
	}
	return cmds
}

// endSleepers kills cmds and checks that each one's wait tells done its
// index once, once its process is gone: half are reaped here, the other
// half only killed (exited, still zombies of this process).
func endSleepers(t *testing.T, cmds []*exec.Cmd, done <-chan int) {
	t.Helper()
	for i, c := range cmds {
		must.NoError(t, c.Process.Kill())
		if i%2 == 0 {
			_ = c.Wait()
		}
	}
	seen := map[int]bool{}
	timeout := time.After(30 * time.Second)
	for len(seen) < len(cmds) {
		select {
		case i := <-done:
			must.False(t, seen[i], must.Sprintf("wait %d returned twice", i))
			seen[i] = true
		case <-timeout:
			t.Fatalf("%d of %d waits returned after their processes were killed", len(seen), len(cmds))
		}
	}
}

// Waiting for many processes' exits costs neither a goroutine nor a
// thread each: one goroutine waits on all their pidfds. Each wait's
// function runs once its process has exited, child or not, and at once
// for a process that had exited before the wait began; a closed pidfd of
// the caller's does not end its wait.
func TestOnExited_NoGoroutinePerWait(t *testing.T) {
	const n = 64
	cmds := startSleepers(t, n)
	// One wait first, so that the set's own goroutine is there before.
	early := exec.Command("/bin/true")
	must.NoError(t, early.Start())
	efd, err := unix.PidfdOpen(early.Process.Pid, 0)
	must.NoError(t, err)
	done := make(chan int, n+1)
	onExited(efd, func() { done <- -2 }, nil)
	_ = unix.Close(efd)
	must.NoError(t, early.Wait())
	must.Eq(t, -2, recvWait(t, done, "the first wait"))
	time.Sleep(100 * time.Millisecond)
	beforeThreads, beforeG := threads(t), settledGoroutines()
	for i, c := range cmds {
		fd, err := unix.PidfdOpen(c.Process.Pid, 0)
		must.NoError(t, err)
		onExited(fd, func() { done <- i }, nil)
		// The set holds its own descriptor.
		must.NoError(t, unix.Close(fd))
	}
	time.Sleep(300 * time.Millisecond)
	duringThreads, duringG := threads(t), settledGoroutines()
	must.Less(t, beforeThreads+n/4, duringThreads, must.Sprintf("%d waits took %d threads", n, duringThreads-beforeThreads))
	must.Less(t, beforeG+n/8, duringG, must.Sprintf("%d waits took %d goroutines", n, duringG-beforeG))
	select {
	case i := <-done:
		t.Fatalf("wait %d returned while its process runs", i)
	default:
	}

	endSleepers(t, cmds, done)
	// A process that exited before its wait began: at once.
	exited := exec.Command("/bin/true")
	must.NoError(t, exited.Start())
	fd, err := unix.PidfdOpen(exited.Process.Pid, 0)
	must.NoError(t, err)
	must.NoError(t, exited.Wait())
	onExited(fd, func() { done <- -1 }, nil)
	_ = unix.Close(fd)
	must.Eq(t, -1, recvWait(t, done, "the wait for a process gone before it began"))
	select {
	case i := <-done:
		t.Fatalf("wait %d ran again", i)
	case <-time.After(100 * time.Millisecond):
	}
}

// A wait that can be neither put in the set nor waited on alone says why
// before its function runs (the driver logs it, and takes the supervisor
// as exited, as it must not wait forever).
func TestOnExited_SaysWhyItCouldNotWait(t *testing.T) {
	// A descriptor number past any open file limit, which nothing can have
	// open (a closed one could be taken again, by the set's own epoll
	// descriptor): epoll_ctl and the duplicate both fail with EBADF.
	const bad = 1 << 30
	done := make(chan int, 1)
	why := make(chan error, 1)
	onExited(bad, func() { done <- -3 }, func(err error) { why <- err })
	must.Eq(t, -3, recvWait(t, done, "the wait that could not be made"))
	select {
	case err := <-why:
		must.ErrorIs(t, err, unix.EBADF)
	default:
		t.Fatal("the function ran, but the failed wait was not reported before it")
	}
}

// recvWait is the next wait's index on done, failing the test when none
// comes within 30 s.
func recvWait(t *testing.T, done <-chan int, what string) int {
	t.Helper()
	select {
	case i := <-done:
		return i
	case <-time.After(30 * time.Second):
		t.Fatalf("%s never returned", what)
		return 0
	}
}

// When the exit set can no longer be waited on, the failure is not
// silent: the set's failure function is called (in the driver, one that
// ends it, for Nomad to start it again and recover its tasks), rather than
// the set closed and every wait left hanging for good.
func TestExitSet_FailureIsLoud(t *testing.T) {
	failed := make(chan error, 1)
	s := &exitSet{fail: func(err error) { failed <- err }}
	s.once.Do(s.start)
	must.NoError(t, s.startErr)
	t.Cleanup(func() { _ = s.file.Close() })
	cmds := startSleepers(t, 1)
	fd, err := unix.PidfdOpen(cmds[0].Process.Pid, 0)
	must.NoError(t, err)
	defer unix.Close(fd)
	must.NoError(t, s.add(fd, func() {}))
	select {
	case err := <-failed:
		t.Fatalf("the set failed while its waits run: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	// A deadline passed ends the poller's read, as a bug would.
	must.NoError(t, s.file.SetReadDeadline(time.Now()))
	select {
	case err := <-failed:
		must.ErrorIs(t, err, os.ErrDeadlineExceeded)
	case <-time.After(30 * time.Second):
		t.Fatal("the exit set stopped waiting without a word")
	}
}

// onChildExited runs its function once the child has exited, for it to
// reap the child.
func TestOnChildExited(t *testing.T) {
	c := exec.Command("/bin/sh", "-c", "exit 3")
	must.NoError(t, c.Start())
	errs := make(chan error, 1)
	onChildExited(c.Process, func() { errs <- c.Wait() })
	select {
	case err := <-errs:
		must.Error(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the child's exit was not seen")
	}
	must.Eq(t, 3, c.ProcessState.ExitCode())
}

// settledGoroutines is the goroutine count once it stops moving.
func settledGoroutines() int {
	g := runtime.NumGoroutine()
	for range 50 {
		time.Sleep(20 * time.Millisecond)
		if h := runtime.NumGoroutine(); h == g {
			return g
		} else {
			g = h
		}
	}
	return g
}

// A running task costs the driver no goroutine of its own: its
// supervisor's exit is waited for in the shared exit set, whose goroutine
// then reaps it and records the task's end (OnExit callers are called back
// from it). One goroutine per task reaping its supervisor, as before, was
// 500 goroutines and their stacks at 500 tasks. Every task's end is still
// seen.
func TestStart_NoGoroutinePerTask_Root(t *testing.T) {
	requireTaskRoot(t)
	const n = 8
	settle := settledGoroutines
	// A task first, so that the exit set's goroutine and the spare are
	// there before.
	first := startTest(t, newTestSpec(t, "/bin/sleep", "60"))
	t.Cleanup(func() { _ = first.Kill() })
	before := settle()
	var procs []*Process
	for range n {
		procs = append(procs, startTest(t, newTestSpec(t, "/bin/sleep", "60")))
	}
	during := settle()
	must.Less(t, before+n/2, during, must.Sprintf("%d tasks took %d goroutines", n, during-before))
	ended := make(chan struct{}, n)
	for _, p := range procs {
		p.OnExit(func() { ended <- struct{}{} })
		must.NoError(t, p.Kill())
	}
	for i := range n {
		select {
		case <-ended:
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d tasks seen to end", i, n)
		}
	}
}

// Many supervisors exiting at once (a node's tasks killed together, a
// cgroup OOM) leave more exits ready on the set than one epoll_wait(2)
// takes: every one of them still runs its function, none waits for a
// later exit to be noticed. The set's goroutine is held while they all
// exit, so that they are all ready together.
func TestOnExited_ManyExitsAtOnce(t *testing.T) {
	const n = 200
	cmds := startSleepers(t, n)
	s := &exitSet{}
	// The set's own descriptor first, so that only the waits' are counted.
	s.once.Do(s.start)
	must.NoError(t, s.startErr)
	fdsBefore := openFDs(t)
	done := make(chan int, n)
	watch := make([]int, n)
	for i, c := range cmds {
		fd, err := unix.PidfdOpen(c.Process.Pid, 0)
		must.NoError(t, err)
		must.NoError(t, s.add(fd, func() { done <- i }))
		// A pidfd of the test's own, to see the process gone.
		watch[i] = fd
	}
	t.Cleanup(func() {
		for _, fd := range watch {
			_ = unix.Close(fd)
		}
	})
	s.mu.Lock()
	for _, c := range cmds {
		must.NoError(t, c.Process.Kill())
	}
	for i, fd := range watch {
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
			if ready, err := pidfdReady(fd, 0); err == nil && ready {
				break
			}
			if time.Now().After(deadline) {
				s.mu.Unlock()
				t.Fatalf("sleeper %d did not die", i)
			}
		}
	}
	s.mu.Unlock()
	seen := map[int]bool{}
	timeout := time.After(30 * time.Second)
	for len(seen) < n {
		select {
		case i := <-done:
			must.False(t, seen[i], must.Sprintf("wait %d returned twice", i))
			seen[i] = true
		case <-timeout:
			t.Fatalf("%d of %d waits returned after their processes all exited at once", len(seen), n)
		}
	}
	s.mu.Lock()
	left := len(s.waiting)
	s.mu.Unlock()
	must.Eq(t, 0, left, must.Sprint("waits left in the set after every process exited"))
	// The set closed its duplicates: only the test's own pidfds are left.
	must.Eq(t, fdsBefore+n, openFDs(t), must.Sprint("descriptors left open by the set after every wait ended"))
}

// openFDs is this process's count of open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	must.NoError(t, err)
	return len(ents)
}
