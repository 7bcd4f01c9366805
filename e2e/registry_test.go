//go:build e2e

package e2e

import (
	"net"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// onEndingThread runs fn on an OS thread that ends once fn has returned
// (a goroutine locked to its thread returns: the runtime ends the thread),
// as the goroutine of an agent another test stops ends its thread. The
// main thread never ends, so fn runs on another. It returns once the
// thread is gone.
func onEndingThread(t *testing.T, fn func()) {
	t.Helper()
	tid := make(chan int, 1)
	release := make(chan struct{})
	defer close(release)
	var run func()
	run = func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// Keep the main thread busy until fn ran elsewhere.
			go run()
			<-release
			runtime.UnlockOSThread()
			return
		}
		fn()
		tid <- unix.Gettid()
	}
	go run()
	task := "/proc/self/task/" + strconv.Itoa(<-tid)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(task); os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("thread %s did not end", task)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The registry's process outlives the thread that started it: with
// Pdeathsig, the kernel kills a child when the thread that forked it ends,
// not the process. Started from an ordinary goroutine, the registry died
// with any thread the runtime later lent a locked goroutine (an agent's
// startProc) that returned: TestImageTasks' registry cases then failed
// with 502 from the proxy while its archive case passed.
func TestRegistryOutlivesItsStartersThread(t *testing.T) {
	reg := StartRegistry(t)
	reg.Stop()
	var err error
	onEndingThread(t, func() { err = reg.Start() })
	must.NoError(t, err)
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", reg.Direct, time.Second)
		must.NoError(t, err, must.Sprint("the registry died with the thread that started it"))
		c.Close()
	}
}
