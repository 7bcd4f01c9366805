//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"github.com/shoenig/test/must"
)

// 5c. "nomad alloc exec" from a terminal (-t, the CLI's default there)
// gives the command a terminal of the task's own /dev/pts: tty names it,
// it is the controlling terminal, and the CLI's window size reaches it.
func TestAllocExecTty(t *testing.T) {
	t.Parallel()
	a := shared(t)

	job := a.RunJob(t, "exec", vars())
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "mntns=", 20*time.Second)

	ptmx, tty, err := pty.Open()
	must.NoError(t, err)
	defer ptmx.Close()
	must.NoError(t, pty.Setsize(ptmx, &pty.Winsize{Rows: 31, Cols: 97}))

	ctx, cancel := context.WithTimeout(context.Background(), Scaled(2*time.Minute))
	defer cancel()
	script := `echo "tty=$(tty)"; ( exec 3<>/dev/tty ) 2>/dev/null && echo "ctty=yes"; echo "size=$(stty size)"; ` +
		`echo "fs=$(stat -L -c %d /proc/self/fd/0) pts=$(stat -c %d /dev/pts)"`
	cmd := exec.CommandContext(ctx, NomadBinary(a.Root), "alloc", "exec", "-task", "t", al.ID, "/bin/sh", "-c", script)
	cmd.Env = append(cleanEnv(), "NOMAD_ADDR="+a.Addr, "NOMAD_CLI_NO_COLOR=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	must.NoError(t, cmd.Start())
	_ = tty.Close()
	// Read until the CLI has gone (EIO once no process holds the terminal).
	var out bytes.Buffer
	read := make(chan error, 1)
	go func() {
		_, err := io.Copy(&out, ptmx)
		read <- err
	}()
	werr := cmd.Wait()
	select {
	case <-read:
	case <-ctx.Done():
	}
	got := strings.ReplaceAll(out.String(), "\r", "")
	t.Logf("nomad alloc exec -t: %v\n%s", werr, got)
	must.NoError(t, werr)
	lines := map[string]string{}
	for _, f := range strings.Fields(got) {
		if k, v, ok := strings.Cut(f, "="); ok {
			lines[k] = v
		}
	}
	must.StrHasPrefix(t, "/dev/pts/", lines["tty"], must.Sprint("the command's terminal is not in the task's /dev/pts"))
	must.Eq(t, "yes", lines["ctty"], must.Sprint("the terminal is not the command's controlling terminal"))
	must.StrContains(t, got, "size=31 97")
	must.NotEq(t, "", lines["pts"])
	must.Eq(t, lines["pts"], lines["fs"], must.Sprint("the terminal is not on the task's devpts"))
	must.False(t, errors.Is(ctx.Err(), context.DeadlineExceeded))
}
