//go:build e2e

package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// 10. Read a secret the host's root keeps in its user keyring. The kernel's
// keyrings are per user ID, not per namespace: without the seccomp filter
// a task running as root searches root's user keyring and reads the key
// (its session keyring, inherited from the agent, links it). The test adds
// a "user" key with a unique description and payload to the test
// process's user keyring (root's); the task searches for it
// (KEYCTL_SEARCH) and reads it (KEYCTL_READ) with perl's syscall(), and the
// payload must not appear in its output. The key is invalidated afterwards.
const escKeyringScript = escWho + `perl -e '
my ($nr, $desc) = @ARGV;
my $type = "user";
my $id = syscall($nr + 0, 10, -4, $type, $desc, 0);
if ($id < 0) { print "RESULT keyring FAILED search: errno ", $!+0, "\n"; }
else {
  my $buf = "\0" x 256;
  my $n = syscall($nr + 0, 11, $id, $buf, 256);
  if ($n < 0) { print "RESULT keyring FAILED read: errno ", $!+0, "\n"; }
  else { print "RESULT keyring OK read: ", substr($buf, 0, $n), "\n"; }
}' "$1" "$2"
echo DONE
`

func escKeyring(t *testing.T, e *escEnv, user string) {
	u := escUniq()
	desc, payload := "ncsi-escape-"+u, "keyring-secret-"+u
	id, err := unix.AddKey("user", desc, []byte(payload), unix.KEY_SPEC_USER_KEYRING)
	if err != nil {
		t.Fatalf("failed to add a key to the test's user keyring: %v", err)
	}
	t.Cleanup(func() {
		// Invalidating needs the key's search permission, which root's
		// user keyring grants only to a possessor: under systemd (the
		// guest of make e2e-vm) a unit's session keyring does not link the
		// user keyring, and EACCES comes back. Unlinking it from the user
		// keyring, its only link, needs write on the keyring, which its
		// owner has: the kernel then collects the key.
		_, err := unix.KeyctlInt(unix.KEYCTL_INVALIDATE, id, 0, 0, 0)
		if errors.Is(err, unix.EACCES) {
			_, err = unix.KeyctlInt(unix.KEYCTL_UNLINK, id, unix.KEY_SPEC_USER_KEYRING, 0, 0)
		}
		if err != nil {
			t.Errorf("failed to remove key %d: %v", id, err)
		}
	})
	job := escRun(t, e.a, escJob{User: user, Script: escKeyringScript, Args: []string{fmt.Sprint(unix.SYS_KEYCTL), desc}})
	al, res := escFinished(t, e.a, job, "t")
	r, ok := res["keyring"]
	if !ok {
		t.Fatalf("the task did not try the keyring:\n%s", al.Describe())
	}
	if r.OK || strings.Contains(escLogs(t, e.a, al.ID, "t"), payload) {
		t.Errorf("a task read the host root's key %q: %s", desc, r.Why)
	}
}

// 11. Make a user namespace: with one, a task holds every capability over
// the mounts it makes there, and on a hybrid host it can mount the unified
// cgroup hierarchy (whose root it is in) and move itself in it. The task
// tries unshare(1) -U, then -Urm with a cgroup2 mount, and a raw
// unshare(CLONE_NEWUSER) and clone3 through perl; each must fail (the
// calls' own return codes, not a message, say so).
const escUserNSScript = escTry + escWho + `try unshare-user unshare -U true
mkdir -p /tmp/cg
try cgroup2-in-userns unshare -Urm sh -c 'mount -t cgroup2 none /tmp/cg && ls /tmp/cg | head -3'
perl -e '
my ($unshare, $clone3, $flag) = @ARGV;
my $r = syscall($unshare + 0, $flag + 0);
print "RESULT raw-unshare ", ($r < 0 ? "FAILED errno " . ($!+0) : "OK"), "\n";
my $args = "\0" x 88;
$r = syscall($clone3 + 0, $args, 88);
print "RESULT raw-clone3 ", ($r < 0 ? "FAILED errno " . ($!+0) : "OK"), "\n";
exit 0 if $r == 0;' "$1" "$2" "$3"
echo DONE
`

func escUserNamespace(t *testing.T, e *escEnv, user string) {
	job := escRun(t, e.a, escJob{User: user, Script: escUserNSScript,
		Args: []string{fmt.Sprint(unix.SYS_UNSHARE), fmt.Sprint(unix.SYS_CLONE3), fmt.Sprint(unix.CLONE_NEWUSER)}})
	al, res := escFinished(t, e.a, job, "t")
	for _, name := range []string{"unshare-user", "cgroup2-in-userns", "raw-unshare", "raw-clone3"} {
		r, ok := res[name]
		if !ok {
			t.Errorf("the task did not try %s:\n%s", name, al.Describe())
			continue
		}
		if r.OK {
			t.Errorf("the task made a user namespace (%s): %s", name, r.Why)
		}
	}
}

// 12. Join a user namespace that exists: a task that sees the host's
// processes (pid_mode = "host", which a job may ask for) finds one in a
// user namespace its own user owns and joins it with setns, which would
// give it every capability there. The test starts such a process on the
// host (unshare -U --map-user=0, owned by root) and the task tries to join
// its user namespace through /proc/<pid>/ns/user; setns must fail.
const escJoinUserNSScript = escWho + `perl -e '
my ($setns, $pid) = @ARGV;
if (!open(my $ns, "<", "/proc/$pid/ns/user")) { print "RESULT join FAILED open: $!\n"; }
else {
  my $r = syscall($setns + 0, fileno($ns), 0);
  print "RESULT join ", ($r < 0 ? "FAILED errno " . ($!+0) : "OK"), "\n";
}' "$1" "$2"
echo DONE
`

func escJoinUserNamespace(t *testing.T, e *escEnv, user string) {
	holder := exec.Command("unshare", "-U", "--map-user=0", "sleep", "300")
	holder.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := holder.Start(); err != nil {
		t.Fatalf("failed to start a process in a user namespace of its own on the host: %v", err)
	}
	t.Cleanup(func() {
		_ = holder.Process.Kill()
		_ = holder.Wait()
	})
	// unshare execs sleep once the namespace is made.
	self, err := os.Readlink("/proc/self/ns/user")
	if err != nil {
		t.Fatalf("failed to read the test's user namespace: %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/user", holder.Process.Pid)); err == nil && ns != self {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the holder process never entered a user namespace of its own")
		}
		time.Sleep(20 * time.Millisecond)
	}
	job := escRun(t, e.a, escJob{User: user, Script: escJoinUserNSScript, PidMode: "host",
		Args: []string{fmt.Sprint(unix.SYS_SETNS), fmt.Sprint(holder.Process.Pid)}})
	al, res := escFinished(t, e.a, job, "t")
	r, ok := res["join"]
	if !ok {
		t.Fatalf("the task did not try to join:\n%s", al.Describe())
	}
	if r.OK {
		t.Errorf("the task joined the host's user namespace of pid %d", holder.Process.Pid)
	}
}
