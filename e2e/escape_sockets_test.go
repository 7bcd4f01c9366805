//go:build e2e

package e2e

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// escSocketsScript connects, with perl (in /usr, which the default
// chroot_env binds), to the plugin's socket by its host path ($1), to the
// same path below the task's own root, and to every listening abstract
// unix socket /proc/net/unix shows (the task shares the host's network
// namespace unless its group asks for one of its own, so it sees them
// all): "RESULT connect:<where> OK|FAILED <why>".
const escSocketsScript = escWho + `conn() {
  if out=$(/usr/bin/perl -MSocket -e '
    my $p = $ARGV[0]; $p =~ s/^@/\0/;
    socket(my $s, AF_UNIX, SOCK_STREAM, 0) or die "socket: $!\n";
    connect($s, pack_sockaddr_un($p)) or die "$!\n";
    print "connected\n";' "$2" 2>&1); then echo "RESULT connect:$1 OK $2"
  else echo "RESULT connect:$1 FAILED $2 $out" | tr '\n' ' '; echo; fi
}
conn plugin-socket "$1"
echo "ABSTRACT-BEGIN"
# Listening (flags 00010000) abstract ("@name") sockets.
awk 'NR > 1 && $4 == "00010000" && $8 ~ /^@/ { print $8 }' /proc/net/unix | sort -u | while read -r a; do
  echo "ABSTRACT $a"
  conn "abstract" "$a"
done
echo DONE
`

// 20. The plugins' sockets: a non-privileged task (which shares the
// host's network namespace by default) cannot reach the operator's
// plugin's socket by its host path (root_dir is not in its view), and
// nothing the driver or its plugins run listens where that namespace
// reaches: no abstract unix socket, no TCP port. Through any of these a
// task could issue NodePublishVolume of another namespace's volume to a
// path it controls, or NodeUnpublishVolume another task's volume.
func TestEscapePluginSockets(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "escsock", VolFixtureOptions{})
	sock := filepath.Join(a.DriverRoot, "plugins", fx.ID, "csi.sock")
	if fi, err := os.Stat(sock); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("no plugin socket at %s on the host (%v): the attack would prove nothing", sock, err)
	}
	// A victim whose volume is published while the attack runs.
	u := escUniq()
	victim := escRun(t, a, escJob{Type: "service", Script: `echo started; exec sleep 3600`,
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: "escape-sock-" + u, Dest: "/data", Create: true, CreateType: "dir"}}})
	val := a.WaitAlloc(t, victim.ID, volTimeout, StatusRunning)
	a.WaitLogs(t, val.ID, "t", "started", escTimeout)

	// What holds the socket, the volumes, the journal (with volume
	// secrets) and the tasks' state is root's alone on the host too: a
	// host user (or a task that some chroot_env gave a path below
	// root_dir) cannot reach what lies beneath.
	for _, c := range []struct {
		path string
		dir  bool
	}{
		{filepath.Join(a.DriverRoot, "plugins", fx.ID), true},
		{filepath.Join(a.DriverRoot, "mnt"), true},
		{filepath.Join(a.DriverRoot, "journal"), true},
		{filepath.Join(a.DriverRoot, "journal", "journal.log"), false},
		{filepath.Join(a.DriverRoot, "tasks"), true},
	} {
		fi, err := os.Stat(c.path)
		if err != nil {
			t.Errorf("%s: %v", c.path, err)
			continue
		}
		t.Logf("%s: %v", c.path, fi.Mode())
		if fi.IsDir() != c.dir || fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s is %v: it must be a %s only root reaches (0700 directory, 0600 file)", c.path, fi.Mode(), map[bool]string{true: "directory", false: "file"}[c.dir])
		}
	}

	ours := escOurListeners(t, a)
	for _, user := range []string{"", "root"} {
		t.Run("user_"+map[string]string{"": "unset", "root": "root"}[user], func(t *testing.T) {
			job := escRun(t, a, escJob{User: user, Script: escSocketsScript, Args: []string{sock}})
			al := a.WaitAlloc(t, job.ID, escTimeout, StatusComplete, StatusFailed)
			out := escRead(t, a, al.ID, "t", false)
			t.Logf("the task said:\n%s", out)
			if !strings.Contains(out, "DONE") {
				t.Fatalf("the task did not finish its script:\n%s", al.Describe())
			}
			escParse(out).mustFail(t, "connect:plugin-socket")
			for _, line := range strings.Split(out, "\n") {
				if name, ok := strings.CutPrefix(line, "ABSTRACT "); ok && ours.abstract[name] != "" {
					t.Errorf("ESCAPED: the task sees the abstract socket %s of %s", name, ours.abstract[name])
				}
			}
		})
	}
	// What the agent's driver, supervisors and plugins listen on, from
	// the host: nothing a task in the host's network namespace reaches.
	ours = escOurListeners(t, a)
	for name, who := range ours.abstract {
		t.Errorf("%s listens on the abstract unix socket %s, which every task in the host's network namespace reaches", who, name)
	}
	for port, who := range ours.tcp {
		t.Errorf("%s listens on TCP %s, which every task in the host's network namespace reaches", who, port)
	}
	t.Logf("the driver's and its plugins' processes listen on no abstract socket and no TCP port (%d processes checked)", ours.procs)
}

// escListeners are the listening abstract unix sockets (by "@name") and
// TCP sockets (by "addr:port" in /proc's hex) of the processes the agent
// runs from this tree's build/ directory or its own directory (the driver,
// supervisors, plugins), each with the process that holds it.
type escListeners struct {
	abstract map[string]string
	tcp      map[string]string
	procs    int
}

func escOurListeners(t *testing.T, a *Agent) escListeners {
	t.Helper()
	build, err := filepath.Abs(filepath.Join("..", "build"))
	if err != nil {
		t.Fatalf("%v", err)
	}
	// Socket inodes of the listening abstract and TCP sockets.
	abstract := map[string]string{} // inode -> @name
	tcp := map[string]string{}      // inode -> local address
	if err := escScan("/proc/net/unix", func(f []string) {
		if len(f) >= 8 && f[3] == "00010000" && strings.HasPrefix(f[7], "@") {
			abstract[f[6]] = f[7]
		}
	}); err != nil {
		t.Fatalf("%v", err)
	}
	for _, p := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		if err := escScan(p, func(f []string) {
			if len(f) >= 10 && f[3] == "0A" { // LISTEN
				tcp[f[9]] = f[1]
			}
		}); err != nil {
			t.Fatalf("%v", err)
		}
	}
	out := escListeners{abstract: map[string]string{}, tcp: map[string]string{}}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	self := strconv.Itoa(os.Getpid())
	for _, p := range procs {
		// The test binary itself is no process of the agent's (make
		// e2e-vm runs it from build/vm/, and its tests listen on
		// loopback: registries, their proxies).
		if filepath.Base(p) == self {
			continue
		}
		exe, err := os.Readlink(filepath.Join(p, "exe"))
		if err != nil {
			continue
		}
		exe = strings.TrimSuffix(exe, " (deleted)")
		if filepath.Base(exe) == "nomad" || (!strings.HasPrefix(exe, build+"/") && !strings.HasPrefix(exe, a.Dir+"/")) {
			continue
		}
		out.procs++
		who := fmt.Sprintf("pid %s (%s)", filepath.Base(p), exe)
		fds, _ := os.ReadDir(filepath.Join(p, "fd"))
		for _, fd := range fds {
			l, err := os.Readlink(filepath.Join(p, "fd", fd.Name()))
			if err != nil {
				continue
			}
			ino, ok := strings.CutPrefix(l, "socket:[")
			if !ok {
				continue
			}
			ino = strings.TrimSuffix(ino, "]")
			if name, ok := abstract[ino]; ok {
				out.abstract[name] = who
			}
			if addr, ok := tcp[ino]; ok {
				out.tcp[addr] = who
			}
		}
	}
	if out.procs == 0 {
		t.Fatalf("found no process of the driver or its plugins running from %s or %s: the check would prove nothing", build, a.Dir)
	}
	return out
}

// escScan calls fn with the fields of each line of a /proc/net table but
// its header.
func escScan(path string, fn func([]string)) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 0; s.Scan(); n++ {
		if n > 0 {
			fn(strings.Fields(s.Text()))
		}
	}
	return s.Err()
}
