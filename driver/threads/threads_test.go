package threads

import (
	"fmt"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// burst blocks n goroutines in the kernel at once for a moment, which has
// the runtime start a thread for most of them, and returns once they are
// back.
func burst(n int) {
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			ts := unix.Timespec{Nsec: int64(100 * time.Millisecond)}
			_ = unix.Nanosleep(&ts, nil)
		})
	}
	wg.Wait()
}

// threadsWithin waits up to a few seconds for the runtime's thread count
// to be at most want, and returns the last count.
func threadsWithin(want int) int {
	var n int
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if n = Read().Threads; n <= want {
			break
		}
	}
	return n
}

// The threads a burst made stay after it (the runtime lets none go), and
// End ends as many as it is asked to.
func TestEnd(t *testing.T) {
	before := Read().Threads
	burst(40)
	after := Read().Threads
	must.Greater(t, before+10, after, must.Sprintf("a burst of 40 blocked goroutines took %d threads more", after-before))
	time.Sleep(200 * time.Millisecond)
	must.Eq(t, after, Read().Threads, must.Sprint("the runtime keeps a burst's threads"))
	End(10)
	// One may be started meanwhile for what waits to run.
	n := threadsWithin(after - 10)
	must.LessEq(t, after-9, n, must.Sprintf("End(10) left %d of %d threads", n, after))
}

// A Trimmer ends the threads a burst left once they have been idle for an
// Interval, and keeps the headroom.
func TestTrimmer_EndsWhatABurstLeft(t *testing.T) {
	burst(40)
	c := Read()
	must.Greater(t, c.Busy+4+10, c.Threads, must.Sprintf("%d threads after a burst, %d busy", c.Threads, c.Busy))
	tr := &Trimmer{Headroom: 4}
	prev, ended := tr.Pass(0)
	must.Positive(t, prev, must.Sprint("the first pass counts the idle threads"))
	must.Zero(t, ended, must.Sprint("the first pass ends none"))
	_, ended = tr.Pass(prev)
	must.Positive(t, ended)
	c = Read()
	n := threadsWithin(c.Busy + 4 + 2)
	must.LessEq(t, c.Busy+4+2, n, must.Sprintf("%d threads left, %d busy", n, c.Busy))
}

// A pass ends only threads that were idle at the pass before too, never
// more than are idle beyond the headroom now.
func TestTrimmer_Pass(t *testing.T) {
	cases := []struct {
		name            string
		threads, busy   int
		prev            int
		wantEnd, wantTo int
	}{
		{name: "idle for the first time: none ends", threads: 30, busy: 4, prev: 0, wantEnd: 0, wantTo: 18},
		{name: "idle since the last pass: they end", threads: 30, busy: 4, prev: 18, wantEnd: 18, wantTo: 0},
		{name: "fewer idle now than before: those end", threads: 20, busy: 4, prev: 18, wantEnd: 8, wantTo: 0},
		{name: "a burst under way: none ends", threads: 30, busy: 26, prev: 18, wantEnd: 0, wantTo: 0},
		{name: "within the headroom: none ends", threads: 12, busy: 4, prev: 3, wantEnd: 0, wantTo: 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ended := 0
			tr := &Trimmer{Headroom: 8,
				read: func() Counts { return Counts{Threads: tc.threads, Busy: tc.busy} },
				end:  func(n int) { ended += n }}
			next, n := tr.Pass(tc.prev)
			must.Eq(t, tc.wantTo, next)
			must.Eq(t, tc.wantEnd, n)
			must.Eq(t, tc.wantEnd, ended)
		})
	}
}

// End ends only threads free to run a new goroutine: a thread locked to a
// goroutine, as the driver's namespace work is (setns(2) and unshare(2)
// on a thread never unlocked, in executor's attach and exec), keeps its
// goroutine and its per-thread state however many threads End ends.
func TestEnd_SparesLockedThreads(t *testing.T) {
	const locked = 8
	ready := make(chan error, locked)
	check := make(chan struct{})
	results := make(chan error, locked)
	for range locked {
		dir, err := filepath.EvalSymlinks(t.TempDir())
		must.NoError(t, err)
		go func() {
			// Never unlocked: the runtime ends the thread with the
			// goroutine, as the driver's do.
			runtime.LockOSThread()
			tid := unix.Gettid()
			// A working directory of this thread's own.
			if err := unix.Unshare(unix.CLONE_FS); err != nil {
				ready <- err
				return
			}
			if err := unix.Chdir(dir); err != nil {
				ready <- err
				return
			}
			ready <- nil
			<-check
			wd, err := unix.Getwd()
			switch {
			case unix.Gettid() != tid:
				results <- fmt.Errorf("the goroutine moved from thread %d to %d", tid, unix.Gettid())
			case err != nil || wd != dir:
				results <- fmt.Errorf("the thread's working directory is %q (%v), not %q", wd, err, dir)
			default:
				results <- nil
			}
		}()
	}
	for range locked {
		must.NoError(t, <-ready)
	}
	burst(40)
	End(Read().Threads)
	close(check)
	for range locked {
		select {
		case err := <-results:
			must.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Fatal("a goroutine locked to its thread never ran again")
		}
	}
}
