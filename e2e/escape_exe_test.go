//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// 13. Reach the driver's own binary on the host through /proc/<pid>/exe
// (the runc CVE-2019-5736 class). The driver starts "nomad alloc exec"
// commands (and template change scripts) from a stage that runs its own
// binary, and a task that is not privileged from the supervisor's binary
// (the seccomp stage): a command named /proc/self/exe (or a script whose
// interpreter is /proc/self/exe) then runs that host binary again, as the
// task and dumpable, so any process of the task may open it through
// /proc/<pid>/exe. Opened through that magic link, the file is the host's,
// on the host's (writable) mount, whatever the task's root: a root task
// could chmod it (setuid, or mode 0 so that no task starts), give it file
// capabilities, or write it once no process runs it.
//
// The service task watches its /proc for a process whose executable is not
// one of its own programs (sh, perl, sleep; busybox in an image) for $1
// seconds, opens that
// executable, and tries to open it for writing and to set its sticky bit; meanwhile the test runs "/proc/self/exe help" with
// "nomad alloc exec" until the task says it tried. The host's driver
// binary and supervisor shims must keep their modes.
const escExeScript = escWho + `echo READY
perl -e '
$| = 1;
my ($secs) = @ARGV;
my $deadline = time + $secs;
my ($got, $pid, $link);
while (!$got && time < $deadline) {
  opendir(my $d, "/proc") or die "opendir /proc: $!";
  for my $p (readdir $d) {
    next unless $p =~ /^\d+$/ && $p != $$;
    my $l = readlink("/proc/$p/exe");
    next unless defined $l && $l !~ m{/(sh|dash|bash|perl[0-9.]*|sleep|busybox)$};
    open(my $f, "<", "/proc/$p/exe") or next;
    ($got, $pid, $link) = ($f, $p, $l);
    last;
  }
  closedir $d;
}
if (!$got) { print "RESULT grab FAILED no process but its own seen in $secs s\n"; exit 0; }
my $n = fileno($got);
my @st = stat($got);
printf "RESULT grab OK pid %d exe %s mode %o\n", $pid, $link, $st[2];
if (open(my $w, "+<", "/proc/self/fd/$n")) { print "RESULT write-exe OK opened for writing\n"; }
else { print "RESULT write-exe FAILED ", $!+0, " $!\n"; }
if (chmod(($st[2] & 07777) | 01000, "/proc/self/fd/$n")) { print "RESULT chmod-exe OK sticky bit set\n"; }
else { print "RESULT chmod-exe FAILED ", $!+0, " $!\n"; }
' "$1"
echo DONE
exec sleep 3600
`

// escExeMu runs one variant of the case at a time: they look at the same
// binaries on the host.
var escExeMu sync.Mutex

func escExe(t *testing.T, e *escEnv, user string) {
	requireCSI(t) // the binaries at stake are the csi driver's
	escExeMu.Lock()
	t.Cleanup(escExeMu.Unlock) // last: after the modes are restored
	// The binaries a task could reach: the driver's (the alloc exec
	// stage) and the supervisor shims (the seccomp stage).
	const binary = "nomad-driver-csi"
	bins := []string{filepath.Join(PluginDir(e.a.Root), binary)}
	shims, _ := filepath.Glob(filepath.Join(e.a.DriverRoot, "bin", "*"))
	bins = append(bins, shims...)
	modes := map[string]os.FileMode{}
	for _, b := range bins {
		fi, err := os.Stat(b)
		if err != nil {
			t.Fatalf("%v", err)
		}
		modes[b] = fi.Mode()
	}
	t.Cleanup(func() {
		for b, m := range modes {
			if fi, err := os.Stat(b); err == nil && fi.Mode() != m {
				if err := os.Chmod(b, m); err != nil {
					t.Errorf("failed to restore the mode of %s: %v", b, err)
				}
			}
		}
	})
	const secs = 60
	job := escRun(t, e.a, escJob{Type: "service", User: user, Script: escExeScript, Args: []string{fmt.Sprint(secs)}})
	al := e.a.WaitAlloc(t, job.ID, escTimeout, StatusRunning)
	e.a.WaitLogs(t, al.ID, "t", "READY", escTimeout)
	// Until the task has tried: each command lives for the tens of
	// milliseconds the driver's binary takes to start and print its
	// usage, which the task's watcher polls for.
	runs := 0
	for deadline := time.Now().Add(secs * time.Second); time.Now().Before(deadline); runs++ {
		if out, _ := e.a.Nomad("alloc", "logs", al.ID, "t"); strings.Contains(out, "DONE") {
			break
		}
		_, _ = e.a.AllocExec(al.ID, "t", "/proc/self/exe", "help")
	}
	e.a.WaitLogs(t, al.ID, "t", "DONE", escTimeout)
	res := escParse(escLogs(t, e.a, al.ID, "t"))
	t.Logf("%d alloc exec runs of /proc/self/exe", runs)
	if r := res["grab"]; r.OK {
		t.Logf("the task holds the executable of a process it saw: %s", r.Why)
		res.mustFail(t, "write-exe", "chmod-exe")
	} else {
		t.Logf("contained: the task found no process of the driver's binary: %s", r.Why)
	}
	for b, m := range modes {
		fi, err := os.Stat(b)
		if err != nil {
			t.Errorf("the driver's binary %s is gone: %v", b, err)
			continue
		}
		if fi.Mode() != m {
			t.Errorf("ESCAPED: a task changed the mode of the host's %s from %v to %v", b, m, fi.Mode())
		}
	}
}
