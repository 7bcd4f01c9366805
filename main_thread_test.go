package main

import (
	"os"
	"runtime"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// No goroutine but main ever runs on the process's main thread. The
// driver's namespace work (a volume re-attached in a task's mount
// namespace, `nomad alloc exec` joining its PID, IPC and network ones)
// runs on a goroutine that locks its thread and ends without unlocking
// it, for the runtime to end the thread with whatever it joined. The
// runtime cannot end the main thread and parks it instead, still in the
// task's namespaces, for the life of the driver: the task's mounts (a
// FUSE volume's connection, a loop device) would be held past its end.
func TestMainThreadIsMains(t *testing.T) {
	pid := unix.Getpid()
	var (
		mu     sync.Mutex
		onMain int
		wg     sync.WaitGroup
	)
	for range 2000 {
		wg.Go(func() {
			runtime.LockOSThread()
			if unix.Gettid() == pid {
				mu.Lock()
				onMain++
				mu.Unlock()
			}
			// Not unlocked: the thread ends with the goroutine, as the
			// driver's namespace goroutines do.
		})
	}
	wg.Wait()
	if onMain > 0 {
		t.Fatalf("%d of 2000 locked goroutines ran on the main thread (pid %d): main (%s) does not hold it", onMain, pid, os.Args[0])
	}
}
