package executor

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// A command run with `nomad alloc exec -t` is confined exactly as one run
// without a terminal: the terminal changes its stdio and controlling
// terminal, nothing else. In particular it holds no descriptor but its
// stdio: not the socket the stage sent the terminal on.
func TestProcess_ExecTty_SameConfinementAsTask_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, user := range []string{"root", "nobody"} {
		t.Run(user, func(t *testing.T) {
			tt := isolatedSpec(t, "exec sleep 100")
			tt.spec.User = user
			p := startTest(t, tt)
			t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
			want := hostView(t, p.Pid())
			var out bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			code, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c", execConfinementScript}, Tty: true, Stdout: &out})
			must.NoError(t, err)
			must.Eq(t, 0, code, must.Sprintf("output: %s", out.String()))
			got := outputLines(strings.ReplaceAll(out.String(), "\r", ""))
			t.Log(got)
			for k, v := range want {
				must.Eq(t, v, got[k], must.Sprintf("%s of the command exec'd with a terminal differs from the task's (task: %q, exec: %q)", k, v, got[k]))
			}
			must.Eq(t, "0 1 2 3", strings.TrimSpace(got["fds"]), must.Sprint("the command exec'd with a terminal holds descriptors beyond its stdio"))
			must.Eq(t, got["pid"], got["sid"])
			must.NotEq(t, "0", got["tty_nr"], must.Sprint("the terminal is not the command's controlling terminal"))
		})
	}
}

// What a command exec'd with a terminal prints just before it exits all
// reaches the caller.
func TestProcess_ExecTty_OutputAtExit_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := isolatedSpec(t, "exec sleep 100")
	p := startTest(t, tt)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	const size = 100 << 10
	for i := 0; i < 3; i++ {
		var out bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		code, err := p.Exec(ctx, ExecOptions{
			Command: []string{"/bin/sh", "-c", "head -c 102400 /dev/zero | tr '\\0' x; echo; echo end"},
			Tty:     true,
			Stdout:  &out,
		})
		cancel()
		must.NoError(t, err)
		must.Eq(t, 0, code)
		must.Eq(t, size, bytes.Count(out.Bytes(), []byte("x")), must.Sprint("output of the command was lost"))
		must.StrContains(t, out.String(), "end")
	}
}

// A failed `alloc exec -t` leaves the driver no descriptor and no
// goroutine: a task that makes every exec fail cannot exhaust the driver.
func TestProcess_ExecTty_FailuresLeakNothing_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := isolatedSpec(t, "exec sleep 100")
	p := startTest(t, tt)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	countFDs := func() int {
		e, err := os.ReadDir("/proc/self/fd")
		must.NoError(t, err)
		return len(e)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// One first, so that whatever is made once per process is there.
	_, err := p.Exec(ctx, ExecOptions{Command: []string{"/no/such/command"}, Tty: true})
	must.Error(t, err)
	fds, gs := countFDs(), runtime.NumGoroutine()
	for i := 0; i < 50; i++ {
		// Fails after the stage took the terminal and sent it.
		_, err := p.Exec(ctx, ExecOptions{Command: []string{"/no/such/command"}, Tty: true})
		must.ErrorContains(t, err, "/no/such/command")
	}
	must.Eq(t, fds, countFDs(), must.Sprint("failed execs leaked descriptors"))
	waitFor(t, "goroutines of the failed execs to end", func() bool { return runtime.NumGoroutine() <= gs })
}

// A root task allowed CAP_SYS_ADMIN may remount or cover its devpts: what
// it put over /dev/pts/ptmx is never taken for the multiplexer, and a
// devpts it mounted itself, with whatever options, gives a terminal of
// that devpts (the task's own) or a clear error, never a hang.
func TestProcess_ExecTtyRemountedDevpts_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, c := range []struct {
		name, script string
		err          string // "" for a terminal
	}{
		{"/dev/null bound over /dev/pts/ptmx", "mount --bind /dev/null /dev/pts/ptmx", "cross-device link"},
		{"another devpts's ptmx bound over /dev/pts/ptmx", "mkdir -p /tmp/pts && mount -t devpts -o newinstance devpts /tmp/pts && mount --bind /tmp/pts/ptmx /dev/pts/ptmx", "cross-device link"},
		{"a devpts of its own, closed to all", "mount -t devpts -o newinstance,ptmxmode=000,mode=000,max=4 devpts /dev/pts", ""},
		// The command's user (root) has the terminal already: nothing
		// to change on the read-only devpts.
		{"its devpts remounted read-only", "mount -o remount,ro /dev/pts", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			tt := isolatedSpec(t, c.script+" && echo ready; sleep 100")
			tt.spec.Capabilities = append(append([]string(nil), DefaultCapabilities...), "CAP_SYS_ADMIN")
			p := startTest(t, tt)
			t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
			waitFor(t, "the task to change its devpts", func() bool {
				return strings.Contains(readFile(t, tt.stdout), "ready") || readFile(t, tt.stderr) != ""
			})
			must.Eq(t, "", readFile(t, tt.stderr))
			if c.err == "" {
				requireTaskTerminal(t, execTty(t, p, ttyScript))
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var out bytes.Buffer
			_, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c", "tty"}, Tty: true, Stdout: &out})
			t.Log(err, out.String())
			must.ErrorContains(t, err, c.err, must.Sprintf("output: %q", out.String()))
			must.NoError(t, ctx.Err())
		})
	}
}

// receiveTerminal takes at most one descriptor and one message, and
// closes whatever it was handed when it refuses the message.
func TestReceiveTerminal_Bounded(t *testing.T) {
	ptmx, err := os.OpenFile("/dev/pts/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("cannot open /dev/pts/ptmx: %v", err)
	}
	defer ptmx.Close()
	countFDs := func() int {
		e, err := os.ReadDir("/proc/self/fd")
		must.NoError(t, err)
		return len(e)
	}
	receive := func(t *testing.T, data []byte, fds ...int) (*os.File, error) {
		t.Helper()
		pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		must.NoError(t, err)
		a, b := os.NewFile(uintptr(pair[0]), "a"), os.NewFile(uintptr(pair[1]), "b")
		defer a.Close()
		defer b.Close()
		must.NoError(t, unix.Sendmsg(int(b.Fd()), data, unix.UnixRights(fds...), nil, 0))
		return receiveTerminal(a)
	}
	before := countFDs()
	t.Run("many descriptors", func(t *testing.T) {
		many := make([]int, 200)
		for i := range many {
			many[i] = int(ptmx.Fd())
		}
		_, err := receive(t, []byte{0}, many...)
		must.ErrorContains(t, err, "malformed terminal message")
	})
	t.Run("a large message", func(t *testing.T) {
		f, err := receive(t, make([]byte, 100<<10), int(ptmx.Fd()))
		must.NoError(t, err)
		must.NoError(t, f.Close())
	})
	must.Eq(t, before, countFDs(), must.Sprint("receiveTerminal kept descriptors it was handed"))
}

// mountStalledFuse mounts, in the mount namespace of pid, a FUSE file
// system at target whose server never answers: every request to it waits
// until the returned connection is closed (which aborts them) or the
// waiter is killed.
func mountStalledFuse(t *testing.T, pid int, target string) *os.File {
	t.Helper()
	conn, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("cannot open /dev/fuse: %v", err)
	}
	errc := make(chan error, 1)
	go func() {
		// The thread is left locked: it is in the task's mount namespace
		// and the runtime throws it away.
		runtime.LockOSThread()
		ns, err := os.Open(fmt.Sprintf("/proc/%d/ns/mnt", pid))
		if err != nil {
			errc <- err
			return
		}
		defer ns.Close()
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			errc <- err
			return
		}
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNS); err != nil {
			errc <- err
			return
		}
		errc <- unix.Mount("stalled", target, "fuse", unix.MS_NOSUID|unix.MS_NODEV,
			fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", conn.Fd()))
	}()
	if err := <-errc; err != nil {
		_ = conn.Close()
		t.Fatalf("failed to mount a FUSE file system at %s in the task: %v", target, err)
	}
	return conn
}

// A stage that never answers (here one stuck on a FUSE file system at the
// task's /dev/pts, as a third-party volume at /dev may be) does not hold
// `alloc exec` past its context: the caller gets an error and the stage
// is killed.
func TestProcess_ExecStalledStage_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := isolatedSpec(t, "exec sleep 100")
	p := startTest(t, tt)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	conn := mountStalledFuse(t, p.Pid(), "/dev/pts")
	defer conn.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c", "tty"}, Tty: true})
		done <- err
	}()
	select {
	case err := <-done:
		t.Log(err)
		must.ErrorIs(t, err, context.DeadlineExceeded)
	case <-time.After(time.Minute):
		_ = conn.Close() // aborts the stage's request: the exec ends
		<-done
		t.Fatal("alloc exec -t did not end when its context did")
	}
}
