//go:build e2e

package e2e

import (
	"strings"
	"testing"
)

// 17. Make Nomad write a host file through the task's secrets directory.
// With identity { file = true }, Nomad (root, on the host) writes the
// task's workload identity to secrets/nomad_token before each run, with
// os.WriteFile and os.Chown, both following symlinks. On its first run the
// task replaces the file with a symlink to a host path ($1) and fails; on
// its restart Nomad would create (or truncate) that host file as root and
// chown it to the task's user.
const escIdentityScript = escWho + `if [ -e "$NOMAD_SECRETS_DIR/escape-first-run-done" ]; then
  echo "second run: $(ls -l "$NOMAD_SECRETS_DIR/nomad_token")"
  echo DONE
  exit 0
fi
touch "$NOMAD_SECRETS_DIR/escape-first-run-done"
ls -l "$NOMAD_SECRETS_DIR/"
if rm -f "$NOMAD_SECRETS_DIR/nomad_token" && ln -s "$1" "$NOMAD_SECRETS_DIR/nomad_token"; then
  echo "RESULT plant OK $(ls -l "$NOMAD_SECRETS_DIR/nomad_token")"
else
  echo "RESULT plant FAILED"
fi
exit 1
`

func escIdentityToken(t *testing.T, e *escEnv, user string) {
	requireCSI(t)
	target := "/etc/escape-token-" + escUniq()
	t.Cleanup(func() { escRemove(t, target) })
	vars := escJob{User: user, Script: escIdentityScript, Args: []string{target}}.vars()
	job := e.a.RunJob(t, "escape-identity", vars)
	t.Cleanup(func() { e.a.stopJobs([]string{job.ID}, escTimeout) })
	al := e.a.WaitAlloc(t, job.ID, escTimeout, StatusComplete, StatusFailed)
	out := escLogs(t, e.a, al.ID, "t")
	if !strings.Contains(out, "uid=") {
		t.Fatalf("the attack did not run:\n%s", al.Describe())
	}
	if !strings.Contains(out, "second run") {
		t.Fatalf("the task did not run again, so Nomad did not write its token again: the attack proves nothing\n%s", al.Describe())
	}
	escMustNotExist(t, target, "a host file written by Nomad through the task's secrets/nomad_token")
}
