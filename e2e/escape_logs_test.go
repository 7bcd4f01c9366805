//go:build e2e

package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// 16. Make Nomad's log rotation write a host file. The task's stdout goes
// to a FIFO that Nomad's logmon (root, on the host) copies into
// <alloc>/alloc/logs/t.stdout.<n>, opening the next file by name, symlinks
// followed, each time the current one is full (10 MiB by default). The
// task plants t.stdout.1 (and .2) in its /alloc/logs as symlinks to a host
// path ($1) and writes past the first file's size: were logs/ writable in
// the task, logmon would create the host file as root, with whatever the
// task printed in it.
const escLogsScript = escTry + escWho + `for n in 1 2; do try "plant:$n" ln -sfn "$1" "$NOMAD_ALLOC_DIR/logs/t.stdout.$n"; done
ls -l "$NOMAD_ALLOC_DIR/logs/" >&2
echo "DONE (planting)" >&2
head -c 11000000 /dev/zero | tr '\0' 'A'
echo
echo "written by a task through a log symlink"
sleep 2
`

func escLogRotation(t *testing.T, e *escEnv, user string) {
	target := "/etc/escape-log-" + escUniq()
	t.Cleanup(func() { escRemove(t, target) })
	job := escRun(t, e.a, escJob{User: user, Script: escLogsScript, Args: []string{target}})
	al := e.a.WaitAlloc(t, job.ID, escTimeout, StatusComplete, StatusFailed)
	stderr := escRead(t, e.a, al.ID, "t", true)
	t.Logf("the task said on stderr:\n%s", stderr)
	if !strings.Contains(stderr, "DONE (planting)") {
		t.Fatalf("the attack did not run:\n%s", al.Describe())
	}
	escMustNotExist(t, target, "a host file made by log rotation through a symlink the task planted")
	// The rotation happened: logmon made the next file itself.
	next := filepath.Join(e.a.DataDir, "alloc", al.ID, "alloc", "logs", "t.stdout.1")
	if fi, err := os.Lstat(next); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("no rotated log file %s on the host (%v): the attack proves nothing", next, err)
	}
}
