package driver

import (
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/threads"
)

// What a burst of task starts or stops leaves the driver, it gives back
// once the burst is over (idleLoop):
//
//   - OS threads: the runtime starts one for each goroutine blocked in a
//     system call while others wait to run, and never ends one. A stop of
//     500 tasks at once left the driver 239 threads, 48 KiB of stacks
//     each, for as long as it ran (driver/threads).
//   - The heap the ended tasks used: the runtime returns freed heap to the
//     kernel only down to what its last collection's goal allows, and a
//     collection comes only with new allocation; after a mass stop the
//     driver allocates little, and kept the stop's heap (its RSS after 500
//     tasks stopped was above its RSS with them running). Once tasks have
//     ended and the driver has been quiet for a whole interval (see
//     idlePass), it collects and returns the free heap
//     (debug.FreeOSMemory): one collection of a heap of a few MiB per
//     burst.
const (
	// idleInterval is how often idleLoop looks, and how long the driver
	// must have been quiet (no task start, recovery, stop or destroy under way,
	// begun or ended) before it returns the heap.
	idleInterval = 10 * time.Second
	// threadHeadroom is how many idle threads stay, ready for the next
	// burst.
	threadHeadroom = 8
	// releaseAfterTasks is how many tasks must have ended since the last
	// return of the heap for the next.
	releaseAfterTasks = 16
)

// Variables for tests.
var (
	idleEvery    = idleInterval
	freeOSMemory = debug.FreeOSMemory
)

// taskChurn follows the starts and ends of tasks for idleLoop.
type taskChurn struct {
	// ended counts the tasks destroyed since the heap was last returned.
	ended atomic.Int64
	// last is when a task start, recovery, stop or destroy last began or
	// ended (unix ns).
	last atomic.Int64
	// busy counts the task starts, recoveries, stops and destroys under way.
	busy atomic.Int64
}

// begin marks a task start, recovery, stop or destroy under way until the
// function it returns is called: a start that takes longer than the
// interval (an image pulled, a slow NodeStage) is not quiet however long
// ago it began.
func (c *taskChurn) begin() (done func()) {
	c.busy.Add(1)
	c.stamp()
	return func() {
		// Stamped first: once busy reads 0, last is this end.
		c.stamp()
		c.busy.Add(-1)
	}
}

func (c *taskChurn) stamp()     { c.last.Store(time.Now().UnixNano()) }
func (c *taskChurn) destroyed() { c.ended.Add(1) }

// quiet says whether no task start, recovery, stop or destroy is under way and
// none began or ended within d before now.
func (c *taskChurn) quiet(now time.Time, d time.Duration) bool {
	return c.busy.Load() == 0 && now.Sub(time.Unix(0, c.last.Load())) >= d
}

// idleLoop ends the threads a burst left idle and returns the heap of the
// tasks that ended, every idleEvery, until the driver shuts down.
func (d *Driver) idleLoop() {
	trim := &threads.Trimmer{Headroom: threadHeadroom}
	ticker := time.NewTicker(idleEvery)
	defer ticker.Stop()
	var st idleState
	for {
		select {
		case <-d.ctx.Done():
			return
		case <-ticker.C:
		}
		st = d.idlePass(trim, st, time.Now())
	}
}

// trimmer is a threads.Trimmer (tests give their own).
type trimmer interface {
	Pass(prev int) (next, ended int)
}

// idleState is what one pass of idleLoop leaves the next.
type idleState struct {
	// idle is what the trimmer's last pass returned.
	idle int
	// stacks says threads were ended since the heap was last returned:
	// their stacks are free heap.
	stacks bool
}

// idlePass is one pass of idleLoop at now, after the pass that left st.
// The heap goes back (a collection, with its stop-the-world pauses, and
// the scavenge of every free page) only once the driver is quiet, never
// while a task starts: when releaseAfterTasks tasks have ended since the
// last time, or threads were ended, whose stacks are free heap now.
// Threads are ended whenever they have been idle since the pass before: a
// long burst leaves some idle between its passes, and ending one has no
// pause.
func (d *Driver) idlePass(trim trimmer, st idleState, now time.Time) idleState {
	var ended int
	st.idle, ended = trim.Pass(st.idle)
	st.stacks = st.stacks || ended > 0
	if !d.churn.quiet(now, idleEvery) {
		return st
	}
	if d.churn.ended.Load() >= releaseAfterTasks || st.stacks {
		d.churn.ended.Store(0)
		st.stacks = false
		freeOSMemory()
	}
	return st
}
