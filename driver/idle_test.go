package driver

import (
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/threads"
)

// Once tasks have been stopped and destroyed, and none started or ended for
// a whole interval, the driver gives the heap back to the kernel: once per
// burst, not while the stops go on, and not for a few tasks.
func TestIdlePass_ReturnsHeapOnceStopsAreOver(t *testing.T) {
	calls := countReleases(t)
	d := newTestDriver(t, Config{Enabled: true})
	// No thread is idle beyond this headroom: only the tasks count.
	trim := &threads.Trimmer{Headroom: 1 << 20}
	destroy := func(n int) {
		for range n {
			cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
			_, _, err := d.StartTask(cfg)
			must.NoError(t, err)
			must.NoError(t, d.DestroyTask(cfg.ID, true))
		}
	}
	destroy(releaseAfterTasks)
	d.idlePass(trim, idleState{}, time.Now())
	must.Zero(t, calls.Load(), must.Sprint("not while tasks were destroyed within the interval"))
	later := time.Now().Add(idleEvery)
	d.idlePass(trim, idleState{}, later)
	must.Eq(t, int64(1), calls.Load(), must.Sprint("once the driver was quiet for an interval"))
	d.idlePass(trim, idleState{}, later.Add(idleEvery))
	must.Eq(t, int64(1), calls.Load(), must.Sprint("once per burst"))

	destroy(releaseAfterTasks / 2)
	d.idlePass(trim, idleState{}, time.Now().Add(idleEvery))
	must.Eq(t, int64(1), calls.Load(), must.Sprint("not for a few tasks"))
	// A start is activity too: an interval after the last destroy, but not
	// after the start that followed it, is not quiet.
	destroy(releaseAfterTasks / 2)
	lastDestroy := time.Unix(0, d.churn.last.Load())
	_, _, err := d.StartTask(taskConfig(t, TaskConfig{Command: "/bin/sleep"}))
	must.NoError(t, err)
	d.idlePass(trim, idleState{}, lastDestroy.Add(idleEvery))
	must.Eq(t, int64(1), calls.Load(), must.Sprint("not right after a start"))
	d.idlePass(trim, idleState{}, time.Now().Add(idleEvery))
	must.Eq(t, int64(2), calls.Load())
}

// The driver lets go of the OS threads a burst of blocked goroutines left,
// as a stop of hundreds of tasks leaves them (the runtime itself keeps
// them for the process's life), and gives back their stacks.
func TestIdleLoop_EndsThreadsABurstLeft(t *testing.T) {
	oldEvery := idleEvery
	idleEvery = 20 * time.Millisecond
	t.Cleanup(func() { idleEvery = oldEvery })
	calls := countReleases(t)
	newTestDriver(t, Config{Enabled: true})

	var wg sync.WaitGroup
	for range 40 {
		wg.Go(func() {
			ts := unix.Timespec{Nsec: int64(100 * time.Millisecond)}
			_ = unix.Nanosleep(&ts, nil)
		})
	}
	wg.Wait()
	peak := threads.Read().Threads
	var c threads.Counts
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if c = threads.Read(); c.Threads <= c.Busy+threadHeadroom+2 {
			break
		}
	}
	must.LessEq(t, c.Busy+threadHeadroom+2, c.Threads, must.Sprintf("%d threads left of %d after the burst, %d busy", c.Threads, peak, c.Busy))
	must.Positive(t, calls.Load(), must.Sprint("the ended threads' stacks go back to the kernel"))
}

// The heap goes back only while no task is starting: a start that takes
// longer than the interval (an image pulled, a slow NodeStage) is not
// quiet, however long ago it began, and the collection's pauses wait for
// its end.
func TestIdlePass_NotWhileAStartIsInFlight(t *testing.T) {
	calls := countReleases(t)
	inStart, release := make(chan struct{}), make(chan struct{})
	var hold atomic.Bool
	td := newTestDriver(t, Config{Enabled: true})
	start := td.start
	td.start = func(l hclog.Logger, s *executor.Spec, late func() ([]executor.Mount, error)) (taskProcess, error) {
		if hold.Load() {
			close(inStart)
			<-release
		}
		return start(l, s, late)
	}
	endTasks(t, td, releaseAfterTasks)
	held := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
	hold.Store(true)
	started := make(chan error, 1)
	go func() {
		_, _, err := td.StartTask(held)
		started <- err
	}()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	select {
	case <-inStart:
	case <-time.After(10 * time.Second):
		t.Fatal("the held start never reached the executor")
	}
	trim := fakeTrimmer{}
	var st idleState
	st = td.idlePass(trim, st, time.Now().Add(3*idleEvery))
	must.Zero(t, calls.Load(), must.Sprint("the heap went back while a task was starting"))
	close(release)
	select {
	case err := <-started:
		must.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the held start never returned")
	}
	st = td.idlePass(trim, st, time.Now().Add(idleEvery/2))
	must.Zero(t, calls.Load(), must.Sprint("the heap went back right after a start ended"))
	td.idlePass(trim, st, time.Now().Add(idleEvery))
	must.Eq(t, int64(1), calls.Load(), must.Sprint("once the driver was quiet for an interval after the start"))
}

// fakeTrimmer ends the threads it is told to, without ending any.
type fakeTrimmer struct{ end int }

func (f fakeTrimmer) Pass(int) (next, ended int) { return 0, f.end }

// Threads ended in a burst (as passes during a long burst of starts end
// the ones idle since the pass before) have their stacks returned only
// once the driver is quiet: not with a start just made.
func TestIdlePass_ThreadStacksWaitForQuiet(t *testing.T) {
	calls := countReleases(t)
	td := newTestDriver(t, Config{Enabled: true})
	_, _, err := td.StartTask(taskConfig(t, TaskConfig{Command: "/bin/sleep"}))
	must.NoError(t, err)
	st := td.idlePass(fakeTrimmer{end: 5}, idleState{}, time.Now())
	must.Zero(t, calls.Load(), must.Sprint("the stacks of threads ended went back right after a start"))
	st = td.idlePass(fakeTrimmer{}, st, time.Now().Add(idleEvery))
	must.Eq(t, int64(1), calls.Load(), must.Sprint("the stacks go back once the driver is quiet"))
	td.idlePass(fakeTrimmer{}, st, time.Now().Add(2*idleEvery))
	must.Eq(t, int64(1), calls.Load(), must.Sprint("once"))
}

// countReleases has the driver count its returns of the heap rather than
// make them, for the test.
func countReleases(t *testing.T) *atomic.Int64 {
	var calls atomic.Int64
	old := freeOSMemory
	freeOSMemory = func() { calls.Add(1) }
	t.Cleanup(func() { freeOSMemory = old })
	return &calls
}

// slowStopProcess is a task whose stop takes until release is closed, as
// a task that ignores its kill signal holds StopTask for its kill_timeout.
type slowStopProcess struct {
	*fakeProcess
	inStop, release chan struct{}
}

func (p *slowStopProcess) Shutdown(sig syscall.Signal, grace time.Duration) error {
	close(p.inStop)
	<-p.release
	return p.fakeProcess.Shutdown(sig, grace)
}

// A stop under way is activity too: a burst of stops whose tasks wait out
// their kill_timeout (up to Nomad's max_kill_timeout) runs StopTask for
// longer than the interval, and the heap's collection and scavenge must
// wait for its end as they do for a start's.
func TestIdlePass_NotWhileAStopIsInFlight(t *testing.T) {
	calls := countReleases(t)
	td := newTestDriver(t, Config{Enabled: true})
	endTasks(t, td, releaseAfterTasks)
	p := &slowStopProcess{fakeProcess: newFakeProcess(7000), inStop: make(chan struct{}), release: make(chan struct{})}
	id := td.addTask(99, p)
	stopped := make(chan error, 1)
	go func() { stopped <- td.StopTask(id, 30*time.Second, "SIGTERM") }()
	defer func() {
		close(p.release)
		select {
		case err := <-stopped:
			must.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Fatal("the held stop never returned")
		}
	}()
	select {
	case <-p.inStop:
	case <-time.After(10 * time.Second):
		t.Fatal("the stop never reached the process")
	}
	td.idlePass(fakeTrimmer{}, idleState{}, time.Now().Add(3*idleEvery))
	must.Zero(t, calls.Load(), must.Sprint("the heap went back while a task was stopping"))
}

// endTasks starts and destroys n tasks, enough ends for the heap's return.
func endTasks(t *testing.T, td *testDriver, n int) {
	t.Helper()
	for i := range n {
		cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
		cfg.ID = fmt.Sprintf("task-%d", i)
		_, _, err := td.StartTask(cfg)
		must.NoError(t, err)
		must.NoError(t, td.DestroyTask(cfg.ID, true))
	}
}
