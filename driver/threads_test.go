package driver

import (
	"sync"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/threads"
)

// The driver lets go of the OS threads a burst of blocked goroutines left,
// as a stop of hundreds of tasks leaves them: the runtime itself keeps
// them for the process's life.
func TestSetConfig_StartsThreadTrimmer(t *testing.T) {
	old := threadTrimInterval
	threadTrimInterval = 20 * time.Millisecond
	t.Cleanup(func() { threadTrimInterval = old })
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
}
