package executor

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

func TestProcess_Exec_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "sleep", "100")
	tt.spec.User, tt.spec.Dir = "nobody", "/"
	p := startTest(t, tt)

	taskNS, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", p.Pid()))
	must.NoError(t, err)
	hostNS, err := os.Readlink("/proc/self/ns/mnt")
	must.NoError(t, err)
	must.NotEq(t, hostNS, taskNS)

	run := func(t *testing.T, opts ExecOptions) (int, string, string) {
		t.Helper()
		var stdout, stderr bytes.Buffer
		opts.Stdout, opts.Stderr = &stdout, &stderr
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		code, err := p.Exec(ctx, opts)
		must.NoError(t, err)
		return code, stdout.String(), stderr.String()
	}

	t.Run("same mount namespace, user, env and cgroup", func(t *testing.T) {
		code, out, errOut := run(t, ExecOptions{Command: []string{"/bin/sh", "-c",
			"readlink /proc/self/ns/mnt; id -u; pwd; echo $SECRET_TOKEN; grep CapEff /proc/self/status; cat /proc/self/cgroup"}})
		must.Eq(t, 0, code, must.Sprintf("stderr: %s", errOut))
		lines := strings.Split(out, "\n")
		must.Eq(t, taskNS, lines[0])
		must.Eq(t, "65534", lines[1])
		must.Eq(t, "/", lines[2])
		must.Eq(t, "hunter2", lines[3])
		must.Eq(t, uint64(0), capEff(t, lines[4]))
		must.StrContains(t, out, tt.spec.CgroupParent+"/"+tt.spec.TaskID)
	})

	t.Run("exit code", func(t *testing.T) {
		code, _, _ := run(t, ExecOptions{Command: []string{"sh", "-c", "exit 4"}})
		must.Eq(t, 4, code)
	})

	t.Run("killed by signal", func(t *testing.T) {
		code, _, _ := run(t, ExecOptions{Command: []string{"sh", "-c", "kill -USR1 $$"}})
		must.Eq(t, 128+10, code)
	})

	t.Run("stdin", func(t *testing.T) {
		code, out, _ := run(t, ExecOptions{Command: []string{"cat"}, Stdin: strings.NewReader("piped\n")})
		must.Eq(t, 0, code)
		must.Eq(t, "piped\n", out)
	})

	t.Run("tty", func(t *testing.T) {
		resize := make(chan TerminalSize, 1)
		resize <- TerminalSize{Height: 33, Width: 111}
		code, out, _ := run(t, ExecOptions{
			Command: []string{"sh", "-c", "sleep 0.2; tty; stty size"},
			Tty:     true,
			Resize:  resize,
		})
		must.Eq(t, 0, code)
		must.StrContains(t, out, "/dev/pts/")
		must.StrContains(t, out, "33 111")
	})

	t.Run("command not found", func(t *testing.T) {
		_, err := p.Exec(context.Background(), ExecOptions{Command: []string{"no-such-command-xyz"}})
		must.ErrorContains(t, err, `command "no-such-command-xyz" not found in PATH`)
	})

	t.Run("context cancel kills", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		begin := time.Now()
		code, err := p.Exec(ctx, ExecOptions{Command: []string{"sleep", "100"}})
		must.NoError(t, err)
		must.Eq(t, 128+9, code)
		must.Less(t, 10*time.Second, time.Since(begin))
	})

	// The task itself is untouched by all this.
	must.NoError(t, p.Signal(0))
	must.NoError(t, p.Kill())
	waitExit(t, p)
	_, err = p.Exec(context.Background(), ExecOptions{Command: []string{"true"}})
	must.ErrorContains(t, err, "not running")
}
