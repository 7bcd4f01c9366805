// Package threads lets the driver's idle OS threads go after a burst.
//
// The Go runtime starts an OS thread for each goroutine blocked in a system
// call while other goroutines wait to run, and it never lets an idle thread
// exit (golang/go#14592): each keeps 48 KiB of stacks (its scheduler stack
// and its signal stack) and its runtime structures for the process's life.
// A driver that stops hundreds of tasks at once blocks as many goroutines
// in the kernel for a moment (a cgroup's rmdir, an unlink, a read of a
// cgroup file), and kept 38 to 101 threads more after 200 tasks stopped,
// about 200 after 500, for as long as it ran.
//
// The runtime ends a thread when the goroutine locked to it
// (runtime.LockOSThread) exits without unlocking it. A Trimmer's Pass, run
// at a steady interval, counts the threads and, when more than are busy
// (GOMAXPROCS, those in a system call and Headroom) have been there since
// the pass before, has as many goroutines lock a thread each and exit. Such a goroutine runs on
// a thread that was free to run it, so the threads that end are idle ones;
// the runtime starts new ones when a burst needs them again.
package threads

import (
	"runtime"
	"runtime/metrics"
	"sync"
)

// Metrics the counts come from.
const (
	threadsMetric = "/sched/threads/total:threads"
	syscallMetric = "/sched/goroutines/not-in-go:goroutines"
	procsMetric   = "/sched/gomaxprocs:threads"
)

// Counts are what a Trimmer reads of the runtime.
type Counts struct {
	// Threads is the runtime's live OS threads.
	Threads int
	// Busy is how many it needs now: one per processor (GOMAXPROCS) and
	// one per goroutine in a system call.
	Busy int
}

// Read reads the runtime's counts.
func Read() Counts {
	s := []metrics.Sample{{Name: threadsMetric}, {Name: syscallMetric}, {Name: procsMetric}}
	metrics.Read(s)
	v := func(i int) int {
		if s[i].Value.Kind() != metrics.KindUint64 {
			return 0
		}
		return int(s[i].Value.Uint64())
	}
	return Counts{Threads: v(0), Busy: v(2) + v(1)}
}

// End has n goroutines each lock an OS thread and exit, which ends n
// threads, and returns once they have exited.
func End(n int) {
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			// Not unlocked: the runtime ends the thread with the
			// goroutine.
			runtime.LockOSThread()
		})
	}
	wg.Wait()
}

// Trimmer ends idle threads (see the package's doc). Its caller runs a
// Pass at a steady interval.
type Trimmer struct {
	// Headroom is how many idle threads it keeps, ready for the next
	// burst.
	Headroom int
	// read counts (Read; tests give their own).
	read func() Counts
	// end ends threads (End; tests give their own).
	end func(int)
}

// Pass counts the idle threads beyond the headroom and ends as many of them
// as there were at the pass before, prev (they have been idle since). It
// returns the count for the next pass and how many it ended.
func (t *Trimmer) Pass(prev int) (next, ended int) {
	read, end := t.read, t.end
	if read == nil {
		read = Read
	}
	if end == nil {
		end = End
	}
	c := read()
	idle := c.Threads - c.Busy - t.Headroom
	if n := min(idle, prev); n > 0 {
		end(n)
		idle -= n
		ended = n
	}
	return max(idle, 0), ended
}
