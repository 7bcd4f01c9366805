package executor

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// A command exec'd into a task (nomad alloc exec, or a script check the
// job itself defines) runs as the user the task was started as, resolved
// on the host, never looked up again in the task's root: a task whose /etc
// is a volume it writes (any job may mount one there) rewrites its passwd
// and group files, and a `nobody` task would have its execs run as root,
// with every capability the driver keeps for a root task.
func TestProcess_Exec_UserNotFromTaskRoot_Root(t *testing.T) {
	requireTaskRoot(t)
	vol := t.TempDir()
	must.NoError(t, os.Chmod(vol, 0o777))
	// ld.so's cache, so that the task's programs find their libraries with
	// this volume over /etc.
	if b, err := os.ReadFile("/etc/ld.so.cache"); err == nil {
		must.NoError(t, os.WriteFile(vol+"/ld.so.cache", b, 0o644))
	}
	tt := isolatedSpec(t, `
echo 'root:x:0:0:root:/:/bin/sh' > /etc/passwd &&
echo 'nobody:x:0:0:nobody:/:/bin/sh' >> /etc/passwd &&
echo 'root:x:0:nobody' > /etc/group &&
echo 'disk:x:6:nobody' >> /etc/group &&
echo ready=yes; exec sleep 100`)
	tt.spec.User = "nobody"
	p, err := startWithLateMount(tt, vol, "/etc")
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); waitExit(t, p); _ = p.Destroy() })
	waitFor(t, "the task to rewrite its passwd", func() bool { return strings.Contains(readFile(t, tt.stdout), "ready=yes") })

	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	code, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c",
		`echo "uid=$(id -u)"; echo "gid=$(id -g)"; echo "groups=$(id -G)"; grep CapEff /proc/self/status | tr -d '\t' | tr : =`},
		Stdout: &stdout, Stderr: &stderr})
	must.NoError(t, err)
	must.Eq(t, 0, code, must.Sprintf("stderr: %s", stderr.String()))
	got := outputLines(stdout.String())
	t.Log(got)
	must.Eq(t, "65534", got["uid"], must.Sprint("the exec'd command took its uid from the task's own /etc/passwd"))
	must.Eq(t, "65534", got["gid"], must.Sprint("the exec'd command took its gid from the task's own /etc/passwd"))
	must.Eq(t, "65534", got["groups"], must.Sprint("the exec'd command took its groups from the task's own /etc/group"))
	must.Eq(t, "0000000000000000", got["CapEff"])
}
