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
//     ended and none started or ended for a whole interval, the driver
//     collects and returns the free heap (debug.FreeOSMemory): one
//     collection of a heap of a few MiB per burst.
const (
	// idleInterval is how often idleLoop looks, and how long the driver
	// must have been quiet (no task started or destroyed) before it
	// returns the heap.
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
	// last is when a task last started or was destroyed (unix ns).
	last atomic.Int64
}

func (c *taskChurn) started()   { c.last.Store(time.Now().UnixNano()) }
func (c *taskChurn) destroyed() { c.ended.Add(1); c.last.Store(time.Now().UnixNano()) }

// releaseDue says whether the heap should go back now: at least
// releaseAfterTasks tasks ended since the last time and none started or
// ended for quiet. It restarts the count when it says so.
func (c *taskChurn) releaseDue(now time.Time, quiet time.Duration) bool {
	if c.ended.Load() < releaseAfterTasks || now.Sub(time.Unix(0, c.last.Load())) < quiet {
		return false
	}
	c.ended.Store(0)
	return true
}

// idleLoop ends the threads a burst left idle and returns the heap of the
// tasks that ended, every idleEvery, until the driver shuts down.
func (d *Driver) idleLoop() {
	trim := &threads.Trimmer{Headroom: threadHeadroom}
	ticker := time.NewTicker(idleEvery)
	defer ticker.Stop()
	idle := 0
	for {
		select {
		case <-d.ctx.Done():
			return
		case <-ticker.C:
		}
		idle = d.idlePass(trim, idle, time.Now())
	}
}

// idlePass is one pass of idleLoop at now; idle is what trim's last pass
// returned, and it returns this pass's.
func (d *Driver) idlePass(trim *threads.Trimmer, idle int, now time.Time) int {
	idle, ended := trim.Pass(idle)
	// The ended threads' stacks are free heap now: they go back too.
	if d.churn.releaseDue(now, idleEvery) || ended > 0 {
		freeOSMemory()
	}
	return idle
}
