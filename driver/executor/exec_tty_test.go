package executor

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// ttyScript says what a command run with `nomad alloc exec -t` sees of its
// terminal, as key=value lines: its name (ttyname, which finds it only in
// the command's own /dev), whether stdin is a terminal, its size, whether
// it is the controlling terminal (/dev/tty opens), which devpts it is on
// (st_dev against the task's /dev/pts) and who owns it.
const ttyScript = `sleep 0.2
echo "tty=$(tty)"
test -t 0 && echo "term=yes"
echo "size=$(stty size)"
( exec 3<>/dev/tty ) 2>/dev/null && echo "ctty=yes"
echo "fs=$(stat -L -c %d /proc/self/fd/0)"
echo "pts=$(stat -c %d /dev/pts)"
echo "owner=$(stat -L -c %u /proc/self/fd/0)"
echo "group=$(stat -L -c %g /proc/self/fd/0)"
echo "uid=$(id -u)"
`

// execTty runs script in p with a terminal (and a resize to 33x111), and
// returns the key=value lines it printed.
func execTty(t *testing.T, p *Process, script string) map[string]string {
	t.Helper()
	resize := make(chan TerminalSize, 1)
	resize <- TerminalSize{Height: 33, Width: 111}
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	code, err := p.Exec(ctx, ExecOptions{
		Command: []string{"/bin/sh", "-c", script},
		Tty:     true,
		Stdout:  &out,
		Resize:  resize,
	})
	must.NoError(t, err)
	must.Eq(t, 0, code, must.Sprintf("output: %s", out.String()))
	got := outputLines(strings.ReplaceAll(out.String(), "\r", ""))
	t.Log(got)
	return got
}

// requireTaskTerminal checks that got (from ttyScript) shows a terminal of
// the task's own devpts that is the command's controlling terminal, owned
// by the command's user, and resized.
func requireTaskTerminal(t *testing.T, got map[string]string) {
	t.Helper()
	must.StrHasPrefix(t, "/dev/pts/", got["tty"], must.Sprint("the command's terminal is not in its /dev/pts"))
	must.Eq(t, "yes", got["term"])
	must.Eq(t, "33 111", got["size"])
	must.Eq(t, "yes", got["ctty"], must.Sprint("the terminal is not the command's controlling terminal"))
	must.NotEq(t, "", got["pts"])
	must.Eq(t, got["pts"], got["fs"], must.Sprint("the terminal is not on the task's devpts"))
	must.Eq(t, got["uid"], got["owner"], must.Sprint("the terminal is not the command's user's"))
}

// `nomad alloc exec -t` gives the command a terminal of the task's own
// devpts, as its controlling terminal: in an isolated task one of the
// host's is invisible (tty says "not a tty"), and would take from the
// host's pool instead of the task's.
func TestProcess_ExecTty_Root(t *testing.T) {
	requireTaskRoot(t)
	t.Run("isolated", func(t *testing.T) {
		tt := isolatedSpec(t, "sleep 100")
		p := startTest(t, tt)
		t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
		got := execTty(t, p, ttyScript)
		requireTaskTerminal(t, got)
		must.Eq(t, "5", got["group"], must.Sprint("the terminal is not of the tty group"))
		// As another user, whose terminal it is.
		prof := *p.state.Profile
		prof.User, prof.Credential = "nobody", &Credential{UID: 65534, GID: 65534}
		p.state.Profile = &prof
		got = execTty(t, p, ttyScript)
		must.Eq(t, "65534", got["uid"])
		requireTaskTerminal(t, got)
		must.Eq(t, "5", got["group"], must.Sprint("the terminal is not of the tty group"))
	})
	t.Run("not isolated", func(t *testing.T) {
		tt := newTestSpec(t, "sleep", "100")
		tt.spec.User, tt.spec.Dir = "nobody", "/"
		p := startTest(t, tt)
		t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
		requireTaskTerminal(t, execTty(t, p, ttyScript))
	})
	t.Run("isolated image", func(t *testing.T) {
		tt := imageSpec(t, "sleep 100", false)
		p := startTest(t, tt)
		t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
		requireTaskTerminal(t, execTty(t, p, ttyScript))
	})
	t.Run("privileged", func(t *testing.T) {
		tt := newTestSpec(t, "sleep", "100")
		tt.spec.Privileged, tt.spec.Dir = true, "/"
		p := startTest(t, tt)
		t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
		requireTaskTerminal(t, execTty(t, p, ttyScript))
	})
}

// A task's root is hostile: whatever it put at /dev/ptmx or /dev/pts (a
// symlink to a file of the host's it can name, a FIFO, whose open blocks, a
// regular file) must give `alloc exec -t` neither a host file nor a hang:
// the exec gets a terminal of the task's devpts or a clear error.
func TestProcess_ExecTtyHostileDev_Root(t *testing.T) {
	requireTaskRoot(t)
	// What the task's root (or its volume at /dev) may hold instead of a
	// terminal multiplexer.
	hostile := map[string]string{
		// The task's own stdout: a host file (its log) that a driver
		// opening by path through the task's root would write the
		// terminal to, or hand to the command as its terminal.
		"symlink to a host file": "ln -s /proc/1/fd/1 $P",
		"fifo":                   "mkfifo $P",
		"regular file":           "echo x > $P",
		"directory":              "mkdir $P",
		// A magic link: a directory of the task's own
		// descriptors.
		"symlink to a magic link": "ln -s /proc/1/fd $P",
	}
	for name, make := range hostile {
		for _, layout := range []struct{ name, script string }{
			{"/dev/pts is a ", "P=/dev/pts; " + make},
			{"/dev/pts/ptmx is a ", "mkdir /dev/pts; P=/dev/pts/ptmx; " + make},
		} {
			t.Run("dev volume, "+layout.name+name, func(t *testing.T) {
				// A volume at /dev: the task writes it, and no devpts
				// is there.
				vol := t.TempDir()
				tt := isolatedSpec(t, layout.script+"; P=/dev/ptmx; "+make+"; echo ready; sleep 100")
				tt.spec.Mounts = []Mount{{Source: vol, Target: "/dev"}}
				p := startTest(t, tt)
				t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
				waitFor(t, "the task to make its /dev", func() bool {
					return strings.Contains(readFile(t, tt.stdout), "ready")
				})
				before := readFile(t, tt.stdout)
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				var out bytes.Buffer
				_, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c", "echo from-exec"}, Tty: true, Stdout: &out})
				t.Log(err)
				must.ErrorContains(t, err, "devpts", must.Sprintf("output: %q", out.String()))
				must.NoError(t, ctx.Err(), must.Sprint("the exec hung on the task's /dev"))
				must.Eq(t, before, readFile(t, tt.stdout), must.Sprint("the exec wrote to the host file the task named"))
				// The task is untouched, and exec without a terminal
				// works.
				must.NoError(t, p.Signal(0))
				code, err := p.Exec(ctx, ExecOptions{Command: []string{"true"}})
				must.NoError(t, err)
				must.Eq(t, 0, code)
			})
		}
		t.Run("devpts kept, /dev/ptmx is a "+name, func(t *testing.T) {
			// The task's devpts is there, but a root task allowed
			// CAP_SYS_ADMIN has made its /dev writable and replaced
			// /dev/ptmx: it is never used.
			tt := isolatedSpec(t, "mount -o remount,rw /dev && rm /dev/ptmx && P=/dev/ptmx && "+make+" && echo ready; sleep 100")
			tt.spec.Capabilities = append(append([]string(nil), DefaultCapabilities...), "CAP_SYS_ADMIN")
			p := startTest(t, tt)
			t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
			waitFor(t, "the task to replace its /dev/ptmx", func() bool {
				return strings.Contains(readFile(t, tt.stdout), "ready") || readFile(t, tt.stderr) != ""
			})
			must.Eq(t, "", readFile(t, tt.stderr))
			before := readFile(t, tt.stdout)
			requireTaskTerminal(t, execTty(t, p, ttyScript))
			must.Eq(t, before, readFile(t, tt.stdout), must.Sprint("the exec wrote to the host file the task named"))
		})
	}
}

// A task that holds every terminal of its devpts leaves `alloc exec -t` a
// clear error, not a terminal of the host's (whose pool it would then
// drain through exec) nor a hang.
func TestProcess_ExecTtyTaskOutOfTerminals_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/usr/bin/perl"); err != nil {
		t.Skip("test opens its terminals with /usr/bin/perl, which this host lacks")
	}
	tt := isolatedSpec(t, `perl -e '
$| = 1;
my @held;
while (open(my $f, "+<", "/dev/ptmx")) { push @held, $f; }
print "held=", scalar(@held), "\n";
sleep 600;
'`)
	p := startTest(t, tt)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	waitFor(t, "the task to take every terminal it can", func() bool {
		return strings.Contains(readFile(t, tt.stdout), "held=")
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c", "tty"}, Tty: true})
	// The bound read on the host: the task's own devpts's max=, which the
	// supervisor set to its taskPtyMax.
	must.ErrorContains(t, err, "the task has no terminal left in its /dev/pts: its own devpts holds at most 128 terminals (its max=128): no space left on device")
	must.NoError(t, ctx.Err())
}

// The driver takes from the exec stage nothing but a devpts's multiplexer
// as the terminal it serves.
func TestReceiveTerminal(t *testing.T) {
	send := func(t *testing.T, f *os.File) (*os.File, error) {
		t.Helper()
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		must.NoError(t, err)
		a, b := os.NewFile(uintptr(fds[0]), "a"), os.NewFile(uintptr(fds[1]), "b")
		defer a.Close()
		defer b.Close()
		var rights []byte
		if f != nil {
			rights = unix.UnixRights(int(f.Fd()))
		}
		must.NoError(t, unix.Sendmsg(int(b.Fd()), []byte{0}, rights, nil, 0))
		return receiveTerminal(a)
	}
	t.Run("a regular file", func(t *testing.T) {
		f, err := os.CreateTemp(t.TempDir(), "ptmx")
		must.NoError(t, err)
		defer f.Close()
		_, err = send(t, f)
		must.ErrorContains(t, err, "the task stage sent no terminal multiplexer")
	})
	t.Run("the host's /dev/ptmx node", func(t *testing.T) {
		// 5:2 too, but not on a devpts.
		f, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
		if err != nil {
			t.Skipf("cannot open /dev/ptmx: %v", err)
		}
		defer f.Close()
		var fs unix.Statfs_t
		must.NoError(t, unix.Fstatfs(int(f.Fd()), &fs))
		if fs.Type == unix.DEVPTS_SUPER_MAGIC {
			t.Skip("this host's /dev/ptmx is on its devpts")
		}
		_, err = send(t, f)
		must.ErrorContains(t, err, "the task stage sent no terminal multiplexer")
	})
	t.Run("no descriptor", func(t *testing.T) {
		_, err := send(t, nil)
		must.ErrorContains(t, err, "malformed terminal message")
	})
	t.Run("a devpts's multiplexer", func(t *testing.T) {
		f, err := os.OpenFile("/dev/pts/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
		if err != nil {
			t.Skipf("cannot open /dev/pts/ptmx: %v", err)
		}
		defer f.Close()
		got, err := send(t, f)
		must.NoError(t, err)
		must.NoError(t, got.Close())
	})
}
