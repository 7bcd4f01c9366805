//go:build e2e

package e2e

import (
	"fmt"
	"strings"
	"testing"

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
		if _, err := unix.KeyctlInt(unix.KEYCTL_INVALIDATE, id, 0, 0, 0); err != nil {
			t.Errorf("failed to invalidate key %d: %v", id, err)
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
