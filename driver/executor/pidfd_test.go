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

	// Each returns once its process is gone: half are reaped here, the
	// other half only killed (exited, still zombies of this process).
	for i, c := range cmds {
		must.NoError(t, c.Process.Kill())
		if i%2 == 0 {
			_ = c.Wait()
		}
	}
	seen := map[int]bool{}
	timeout := time.After(30 * time.Second)
	for len(seen) < n {
		select {
		case i := <-done:
			seen[i] = true
		case <-timeout:
			t.Fatalf("%d of %d waits returned after their processes were killed", len(seen), n)
		}
	}
}

// waitChild reaps the child once it exits, without a thread blocked in
// waitid(2) meanwhile.
func TestWaitChild(t *testing.T) {
	c := exec.Command("/bin/sh", "-c", "exit 3")
	must.NoError(t, c.Start())
	err := waitChild(c.Process, c.Wait)
	must.Error(t, err)
	must.Eq(t, 3, c.ProcessState.ExitCode())
}

// A running task costs the driver one goroutine, the one that reaps its
// supervisor and then records the task's end (OnExit callers are called
// back from it): a second one waiting on a pidfd, as before, made two per
// task for the task's life. Every task's end is still seen.
func TestStart_OneGoroutinePerTask_Root(t *testing.T) {
	requireTaskRoot(t)
	const n = 8
	settle := func() int {
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
	before := settle()
	var procs []*Process
	for range n {
		procs = append(procs, startTest(t, newTestSpec(t, "/bin/sleep", "60")))
	}
	during := settle()
	must.LessEq(t, before+n+n/2, during, must.Sprintf("%d tasks took %d goroutines", n, during-before))
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
