//go:build e2e

package e2e

import (
	"strings"
	"testing"
)

// escHostPIDScript looks, from the host's PID namespace, for the victim's
// process ("sleep 302.$1") and reads its root and environment, which a root
// task with the default capabilities could: the victim is root with no
// more capabilities, and dumpable.
const escHostPIDScript = escWho + `for p in /proc/[0-9]*; do
  c=$(tr '\000' ' ' < "$p/cmdline" 2>/dev/null)
  case "$c" in "sleep 302.$1"*)
    echo "RESULT see-victim OK $p"
    echo "victim env: $(tr '\000' ' ' < "$p/environ" 2>&1)"
    echo "victim root: $(ls "$p/root/" 2>&1 | tr '\n' ' ')" ;;
  esac
done
echo DONE
`

// 18. Reach another allocation from the host's PID namespace: a job that
// asks for pid_mode = "host" on a node whose operator neither allowed it
// (allow_host_namespaces) nor made it the default is refused, with a
// reason naming the key, and never sees the victim, a root task of
// another job whose environment holds a secret.
func TestEscapeHostPIDMode(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	a := StartAgent(t, AgentOptions{Drivers: []string{DriverName}})
	nonce, secret := escUniq(), "escape-env-secret-"+escUniq()
	victim := escRun(t, a, escJob{Type: "service", User: "root",
		Script: `export VICTIM_SECRET="$2"; exec sleep "302.$1"`, Args: []string{nonce, secret}})
	a.WaitAlloc(t, victim.ID, escTimeout, StatusRunning)
	job := escRun(t, a, escJob{User: "root", PidMode: "host", Script: escHostPIDScript, Args: []string{nonce}})
	al := a.WaitAlloc(t, job.ID, escTimeout, StatusComplete, StatusFailed)
	desc := al.Describe()
	out := escRead(t, a, al.ID, "t", false)
	t.Logf("the attacker's allocation:\n%s\nit said:\n%s", desc, out)
	if strings.Contains(out, secret) || strings.Contains(out, "see-victim OK") {
		t.Errorf("ESCAPED: a task in the host's PID namespace reached another allocation's process")
	}
	if !strings.Contains(desc, "allow_host_namespaces") {
		t.Errorf("the task was not refused for its pid_mode (no allow_host_namespaces in its events)")
	}
}
