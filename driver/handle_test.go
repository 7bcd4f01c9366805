package driver

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// settledGoroutines is the goroutine count once it stops moving.
func settledGoroutines() int {
	n := runtime.NumGoroutine()
	for range 50 {
		time.Sleep(10 * time.Millisecond)
		m := runtime.NumGoroutine()
		if m == n {
			return n
		}
		n = m
	}
	return n
}

// A running task costs the driver no goroutine of its own to follow its
// process, and Nomad's WaitTask on it none either: the process calls back
// when it exits. A goroutine each, as before, made 500 tasks 1000
// goroutines (with TaskStats' and Nomad's own, the driver held 7 per
// task). Each WaitTask still gets its task's result, or an empty closed
// channel when its context or the driver ends first. The calls go through
// the Boundary, as Nomad's do: its cleaning of the result costs no
// goroutine either.
func TestWaitTask_NoGoroutinePerTask(t *testing.T) {
	td := newTestDriver(t, Config{})
	b := td.Driver.Boundary()
	const n = 200
	procs := make([]*fakeProcess, n)
	before := settledGoroutines()
	chans := make([]<-chan *drivers.ExitResult, n)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for i := range procs {
		procs[i] = newFakeProcess(1000 + i)
		cfg := &drivers.TaskConfig{ID: fmt.Sprintf("task-%d", i), AllocID: "alloc", Name: "t"}
		td.tasks.Set(cfg.ID, newTaskHandle(hclog.NewNullLogger(), cfg, procs[i], time.Now()))
		ch, err := b.WaitTask(ctx, cfg.ID)
		must.NoError(t, err)
		chans[i] = ch
	}
	during := settledGoroutines()
	must.Less(t, before+n/10, during, must.Sprintf("%d tasks and their WaitTask calls took %d goroutines", n, during-before))

	// Half exit: their waiters get the result.
	for i := 0; i < n/2; i++ {
		procs[i].exit(executor.ExitStatus{ExitCode: i % 7})
	}
	for i := 0; i < n/2; i++ {
		select {
		case r, ok := <-chans[i]:
			must.True(t, ok)
			must.Eq(t, i%7, r.ExitCode)
		case <-time.After(5 * time.Second):
			t.Fatalf("no exit result for task %d", i)
		}
		_, ok := <-chans[i]
		must.False(t, ok, must.Sprint("the channel is closed after the result"))
	}
	// The other half's context ends first: closed, empty.
	cancel()
	for i := n / 2; i < n; i++ {
		select {
		case r, ok := <-chans[i]:
			must.False(t, ok, must.Sprintf("task %d: got %v after its context ended", i, r))
		case <-time.After(5 * time.Second):
			t.Fatalf("WaitTask of task %d not closed after its context ended", i)
		}
	}
	// A WaitTask after the exit answers at once.
	ch, err := b.WaitTask(context.Background(), "task-3")
	must.NoError(t, err)
	r := <-ch
	must.Eq(t, 3, r.ExitCode)
	must.Less(t, before+n/10, settledGoroutines())
}
