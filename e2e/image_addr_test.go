//go:build e2e

package e2e

// A job that names its image on an address no pull may reach (a
// link-local one: the cloud metadata service lives at 169.254.169.254; an
// unspecified or "this network" one, which reaches the node itself; the
// same written as NAT64 or IPv4-mapped IPv6) gets a failed allocation at
// once: one driver failure that names the image and the address and says
// why, no retry of the pull, no restart (the error is unrecoverable,
// though the job allows one), and no connection to the address.
//
// Connections are counted where a listener can take them without
// touching 169.254.169.254: a link-local address of the test's own on the
// loopback interface (removed when the test ends), and 127.0.0.1, which a
// connection to 0.0.0.0 reaches. 169.254.169.254 itself answers on this
// kind of machine and is never connected to from here, so its case is
// judged by the error: the refusal before the dial, not a TLS or network
// error, which only a connection would give.

import (
	"fmt"
	"net"
	"os/exec"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
)

// testLinkLocal is the link-local address the test listens on; not the
// metadata service's, not in the ranges RFC 3927 reserves.
const testLinkLocal = "169.254.77.77"

// countingListener accepts connections on addr and counts them.
type countingListener struct {
	ln    net.Listener
	count atomic.Int64
}

func listenCounting(t *testing.T, addr string) *countingListener {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	must.NoError(t, err)
	l := &countingListener{ln: ln}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			l.count.Add(1)
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return l
}

func (l *countingListener) port() int { return l.ln.Addr().(*net.TCPAddr).Port }

// mark connects to the listener through dial (the address a pull would
// connect to) and waits until it was accepted: the connections made
// before it, accepted in order, are all counted then. It returns the
// count with the mark.
func (l *countingListener) mark(t *testing.T, dial string) int64 {
	t.Helper()
	before := l.count.Load()
	c, err := net.Dial("tcp", dial)
	must.NoError(t, err, must.Sprintf("the test's own connection to %s", dial))
	c.Close()
	var got int64
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		got = l.count.Load()
		return got > before
	}), wait.Timeout(time.Minute), wait.Gap(10*time.Millisecond)), must.Sprintf("the connection to %s was not accepted", dial))
	return got
}

// addLoopbackAddr puts addr/32 on the loopback interface until the test
// ends (after a dead run's is removed).
func addLoopbackAddr(t *testing.T, addr string) {
	t.Helper()
	_ = exec.Command("ip", "addr", "del", addr+"/32", "dev", "lo").Run()
	out, err := exec.Command("ip", "addr", "add", addr+"/32", "dev", "lo").CombinedOutput()
	must.NoError(t, err, must.Sprintf("ip addr add %s/32 dev lo: %s", addr, out))
	t.Cleanup(func() {
		out, err := exec.Command("ip", "addr", "del", addr+"/32", "dev", "lo").CombinedOutput()
		must.NoError(t, err, must.Sprintf("ip addr del %s/32 dev lo: %s", addr, out))
	})
}

func TestImagePullNeverReachesLinkLocal(t *testing.T) {
	requireCSI(t)
	addLoopbackAddr(t, testLinkLocal)
	linkLocal := listenCounting(t, net.JoinHostPort(testLinkLocal, "0"))
	loopback := listenCounting(t, "127.0.0.1:0")
	a := StartAgent(t, AgentOptions{Drivers: []string{DriverName}})

	for _, tc := range []struct {
		name string
		// ref is the job's image; refused is what the error says was
		// refused and why.
		ref, refused string
		// ln counts the connections to the address, dialed as dial
		// (nil: the address is never connected to by the test).
		ln   *countingListener
		dial string
	}{
		{
			name:    "test link-local address",
			ref:     fmt.Sprintf("%s:%d/x/app:1", testLinkLocal, linkLocal.port()),
			refused: fmt.Sprintf("the connection to %s:%d is refused: %s is a link-local address", testLinkLocal, linkLocal.port(), testLinkLocal),
			ln:      linkLocal, dial: fmt.Sprintf("%s:%d", testLinkLocal, linkLocal.port()),
		},
		{
			name:    "unspecified address",
			ref:     fmt.Sprintf("0.0.0.0:%d/x/app:1", loopback.port()),
			refused: fmt.Sprintf("the connection to 0.0.0.0:%d is refused: 0.0.0.0 is an unspecified address", loopback.port()),
			ln:      loopback, dial: fmt.Sprintf("0.0.0.0:%d", loopback.port()),
		},
		{
			name:    "metadata service",
			ref:     "169.254.169.254/x/app:1",
			refused: "the connection to 169.254.169.254:443 is refused: 169.254.169.254 is a link-local address",
		},
		{
			name:    "metadata service through NAT64",
			ref:     "[64:ff9b::a9fe:a9fe]/x/app:1",
			refused: "the connection to [64:ff9b::a9fe:a9fe]:443 is refused: 64:ff9b::a9fe:a9fe (NAT64 for 169.254.169.254) is a link-local address",
		},
		{
			name:    "this network",
			ref:     "0.0.0.1/x/app:1",
			refused: "the connection to 0.0.0.1:443 is refused: 0.0.0.1 is in 0.0.0.0/8",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before int64
			if tc.ln != nil {
				// The address takes connections: a pull that dialed it
				// would be counted.
				before = tc.ln.mark(t, tc.dial)
			}
			// One restart allowed: an error Nomad may try again would
			// restart the task; the driver's is final.
			job := a.RunJob(t, "image", map[string]string{"Image": tc.ref, "Username": "", "Password": "", "Count": "1", "Timeout": "2m",
				"RestartAttempts": "1"})
			al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusFailed)
			all := eventsText(al, "")
			t.Logf("events:\n%s", all)
			if tc.ln != nil {
				// No connection: only the test's own second mark was
				// accepted since the first.
				must.Eq(t, before+1, tc.ln.mark(t, tc.dial), must.Sprintf("connections to %s during the job", tc.dial))
			}

			// One driver failure that names the image, the address and
			// why, and nothing else of the pull.
			var failures []string
			for _, e := range al.Events("") {
				if e.Type == "Driver Failure" {
					failures = append(failures, e.Text())
				}
			}
			must.SliceLen(t, 1, failures, must.Sprintf("driver failures in:\n%s", all))
			must.StrContains(t, failures[0], fmt.Sprintf("failed to pull image %q", tc.ref))
			must.StrContains(t, failures[0], tc.refused)
			must.StrContains(t, failures[0], "a pull never reaches a link-local address")
			// Refused before a connection: no TLS, no network error.
			for _, dialed := range []string{"certificate", "TLS", "tls:", "unreachable", "connection reset", "EOF", "i/o timeout"} {
				must.StrNotContains(t, all, dialed)
			}
			// No retry of the pull, no restart of the task: the error is
			// not one Nomad or the driver tries again.
			must.StrNotContains(t, all, "retrying in")
			must.StrNotContains(t, all, "attempt ")
			must.StrNotContains(t, all, "Downloading image")
			for _, e := range al.Events("") {
				must.NotEq(t, "Restarting", e.Type, must.Sprintf("events:\n%s", all))
			}
			must.StrContains(t, all, "Error was unrecoverable")

			// What the operator reads in nomad alloc status.
			out, err := a.Nomad("alloc", "status", al.ID)
			must.NoError(t, err, must.Sprint(out))
			must.StrContains(t, out, "Driver Failure")
			must.StrContains(t, out, fmt.Sprintf("failed to pull image %q", tc.ref))
			must.StrContains(t, out, tc.refused)

			a.StopJob(t, job.ID)
		})
	}
	// The failed pulls left nothing in the store.
	must.MapEmpty(t, storeState(t, a.DriverRoot))
	must.StrNotContains(t, a.Log(), "retrying in")
}
