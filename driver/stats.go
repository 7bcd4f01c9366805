package driver

import (
	"context"
	"time"

	cstructs "github.com/hashicorp/nomad/client/structs"
	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
)

// TaskStats sends the task's cpu and memory usage every interval until the
// task exits or ctx ends.
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

	ch := make(chan *cstructs.TaskResourceUsage)
	go func() {
		defer close(ch)
		calc := &cpuCalc{mhzPerCore: mhz}
		timer := time.NewTimer(0)
		defer timer.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-d.ctx.Done():
				return
			case <-h.done:
				return
			case <-timer.C:
				timer.Reset(interval)
			}
			s, err := h.process.Stats()
			if err != nil {
				h.logger.Debug("failed to read task stats", "error", err)
				continue
			}
			usage := calc.usage(s, time.Now())
			select {
			case ch <- usage:
			case <-ctx.Done():
				return
			case <-h.done:
				return
			}
		}
	}()
	return ch, nil
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
		Measured:         s.CPUMeasured,
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
