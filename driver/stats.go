package driver

import (
	"container/heap"
	"context"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	cstructs "github.com/hashicorp/nomad/client/structs"
	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
)

// TaskStats sends the task's cpu and memory usage every interval until the
// task exits or ctx ends. The samples of every task come from one goroutine
// (statsSchedule), not one per task: Nomad keeps a TaskStats stream open
// for each running task, and a goroutine each was 500 goroutines and their
// stacks at 500 tasks (which the GC's heap goal grows with too).
func (d *Driver) TaskStats(ctx context.Context, taskID string, interval time.Duration) (<-chan *cstructs.TaskResourceUsage, error) {
	h, ok := d.tasks.Get(taskID)
	if !ok {
		return nil, drivers.ErrTaskNotFound
	}
	if interval <= 0 {
		interval = time.Second
	}
	d.mu.RLock()
	mhz := d.mhzPerCore
	d.mu.RUnlock()
	return d.stats.add(h.logger, h.process, interval, mhz, h.onExit, ctx, d.ctx), nil
}

// statsSchedule takes the samples of every TaskStats stream on one
// goroutine, which runs while any stream is open, each stream at its own
// interval. A sample waits in its stream's channel (of one) for Nomad to
// take it; a newer one replaces it, so that a stream Nomad reads slowly
// never holds up the others.
type statsSchedule struct {
	mu      sync.Mutex
	streams statsQueue
	running bool
	// wake tells the goroutine that the first stream due changed.
	wake chan struct{}
}

// statsStream is one TaskStats call.
type statsStream struct {
	logger   hclog.Logger
	process  taskProcess
	interval time.Duration
	calc     cpuCalc
	ch       chan *cstructs.TaskResourceUsage
	next     time.Time
	// index is the stream's place in the queue, -1 while the goroutine
	// samples it.
	index  int
	closed bool
	// stops forget the callbacks that end the stream.
	stops []func()
}

func newStatsSchedule() *statsSchedule {
	return &statsSchedule{wake: make(chan struct{}, 1)}
}

// add opens a stream of process's samples every interval, the first now,
// which ends (its channel closed) once onExit calls back or any of ctxs
// ends.
func (s *statsSchedule) add(logger hclog.Logger, p taskProcess, interval time.Duration, mhzPerCore float64,
	onExit func(func()) func(), ctxs ...context.Context) <-chan *cstructs.TaskResourceUsage {
	st := &statsStream{logger: logger, process: p, interval: interval, calc: cpuCalc{mhzPerCore: mhzPerCore},
		ch: make(chan *cstructs.TaskResourceUsage, 1), next: time.Now(), index: -1}
	// Each may call back at once (the task has exited, a context has
	// ended), which closes the stream before it is queued.
	end := func() { s.end(st) }
	var stops []func()
	for _, ctx := range ctxs {
		stop := context.AfterFunc(ctx, end)
		stops = append(stops, func() { stop() })
	}
	stops = append(stops, onExit(end))
	s.mu.Lock()
	if st.closed {
		s.mu.Unlock()
		for _, stop := range stops {
			stop()
		}
		return st.ch
	}
	st.stops = stops
	heap.Push(&s.streams, st)
	first := st.index == 0
	start := !s.running
	s.running = true
	s.mu.Unlock()
	if start {
		go s.run()
	} else if first {
		s.poke()
	}
	return st.ch
}

// poke tells the goroutine that the first stream due changed, without
// waiting: a wake it has not taken yet says as much.
func (s *statsSchedule) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// end closes st's channel and takes it out of the queue, once. When st
// was the first due, the goroutine sleeping until its next sample is
// woken: it goes on to the next stream due, or ends with the last one
// rather than sleeping on for the ended stream's interval (an hour, at a
// collection_interval of an hour).
func (s *statsSchedule) end(st *statsStream) {
	s.mu.Lock()
	if st.closed {
		s.mu.Unlock()
		return
	}
	st.closed = true
	if st.index >= 0 {
		if st.index == 0 {
			s.poke()
		}
		heap.Remove(&s.streams, st.index)
	}
	stops := st.stops
	st.stops = nil
	s.mu.Unlock()
	for _, stop := range stops {
		stop()
	}
	// Closed last: a stream Nomad sees closed holds nothing of its task
	// any more. Nothing sends on it once closed is set.
	close(st.ch)
}

// run samples the streams as they come due, until none is left.
func (s *statsSchedule) run() {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		s.mu.Lock()
		if len(s.streams) == 0 {
			s.running = false
			s.mu.Unlock()
			return
		}
		st := s.streams[0]
		if wait := time.Until(st.next); wait > 0 {
			s.mu.Unlock()
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-s.wake:
			}
			continue
		}
		heap.Pop(&s.streams)
		s.mu.Unlock()

		stats, err := st.process.Stats()
		now := time.Now()
		if err != nil {
			st.logger.Debug("failed to read task stats", "error", err)
		}

		s.mu.Lock()
		if !st.closed {
			if err == nil {
				st.send(st.calc.usage(stats, now))
			}
			st.next = st.next.Add(st.interval)
			if st.next.Before(now) {
				st.next = now.Add(st.interval)
			}
			heap.Push(&s.streams, st)
		}
		s.mu.Unlock()
	}
}

// send puts u in the stream's channel, in place of a sample Nomad has not
// taken yet. The schedule's lock is held: the channel is not closed.
func (st *statsStream) send(u *cstructs.TaskResourceUsage) {
	for {
		select {
		case st.ch <- u:
			return
		default:
		}
		select {
		case <-st.ch:
		default:
		}
	}
}

// statsQueue orders the streams by when each is due (container/heap).
type statsQueue []*statsStream

func (q statsQueue) Len() int           { return len(q) }
func (q statsQueue) Less(i, j int) bool { return q[i].next.Before(q[j].next) }
func (q statsQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = i, j
}
func (q *statsQueue) Push(x any) {
	st := x.(*statsStream)
	st.index = len(*q)
	*q = append(*q, st)
}
func (q *statsQueue) Pop() any {
	old := *q
	st := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	st.index = -1
	return st
}

// cpuCalc turns cumulative cpu times into the percentages Nomad shows.
type cpuCalc struct {
	mhzPerCore float64

	have                bool
	prevAt              time.Time
	prevTotal, prevUser uint64
	prevSystem          uint64
}

func (c *cpuCalc) usage(s *cgroups.Stats, now time.Time) *cstructs.TaskResourceUsage {
	cpu := &cstructs.CpuStats{
		ThrottledPeriods: s.ThrottledPeriods,
		ThrottledTime:    s.ThrottledNanos,
		// Percent and TotalTicks are computed here from the total,
		// which every sample has. Nomad lists what it measured, and
		// nomad alloc status -stats prints only those fields.
		Measured: append(slices.Clip(s.CPUMeasured), "Percent"),
	}
	if c.have {
		wall := float64(now.Sub(c.prevAt).Nanoseconds())
		if wall > 0 {
			cpu.Percent = percent(s.CPUTotalNanos, c.prevTotal, wall)
			cpu.UserMode = percent(s.CPUUserNanos, c.prevUser, wall)
			cpu.SystemMode = percent(s.CPUSystemNanos, c.prevSystem, wall)
			cpu.TotalTicks = cpu.Percent / 100 * c.mhzPerCore
		}
	}
	c.have = true
	c.prevAt = now
	c.prevTotal, c.prevUser, c.prevSystem = s.CPUTotalNanos, s.CPUUserNanos, s.CPUSystemNanos

	ru := &cstructs.ResourceUsage{
		CpuStats: cpu,
		MemoryStats: &cstructs.MemoryStats{
			RSS:      s.MemoryRSS,
			Cache:    s.MemoryCache,
			Swap:     s.MemorySwap,
			Usage:    s.MemoryUsage,
			MaxUsage: s.MemoryMaxUsage,
			Measured: s.MemoryMeasured,
		},
	}
	return &cstructs.TaskResourceUsage{ResourceUsage: ru, Timestamp: now.UnixNano()}
}

// percent is the share of one core used between two cumulative readings.
func percent(cur, prev uint64, wallNanos float64) float64 {
	if cur < prev {
		return 0
	}
	return float64(cur-prev) / wallNanos * 100
}
