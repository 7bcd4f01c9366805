package executor

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// A command exec'd without a stdin, stdout or stderr gets none of the
// host's /dev/null for them, which os/exec opens on the host's own mount
// of /dev for a nil one: through /proc/self/fd a root task would chmod or
// chown the node's /dev/null there (mode 000 breaks every program on the
// node), as the supervisor's task stdio never lets it (openNull).
func TestProcess_ExecWithoutStdioHoldsNoHostFile_Root(t *testing.T) {
	requireTaskRoot(t)
	hostDev := map[string]bool{}
	f, err := os.Open("/proc/self/mountinfo")
	must.NoError(t, err)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) > 4 && fields[4] == "/dev" {
			hostDev[fields[0]] = true
		}
	}
	must.NoError(t, sc.Err())
	_ = f.Close()
	must.MapNotEmpty(t, hostDev)

	tt := isolatedSpec(t, "exec sleep 100")
	p := startTest(t, tt)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	// Each of fds with its mount's id, on the descriptor report.
	const script = `for fd in %s; do echo "$fd $(sed -n 's/^mnt_id:[[:space:]]*//p' /proc/self/fdinfo/$fd)" >&%s; done`
	for _, tc := range []struct {
		name   string
		fds    string
		report string
	}{
		{"stdin and stdout", "0 1", "2"},
		{"stderr", "2", "1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			opts := ExecOptions{Command: []string{"/bin/sh", "-c", fmt.Sprintf(script, tc.fds, tc.report)}}
			if tc.report == "2" {
				opts.Stderr = &out
			} else {
				opts.Stdout = &out
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			code, err := p.Exec(ctx, opts)
			must.NoError(t, err)
			must.Eq(t, 0, code, must.Sprint(out.String()))
			lines := strings.Split(strings.TrimSpace(out.String()), "\n")
			must.Len(t, len(strings.Fields(tc.fds)), lines, must.Sprint(out.String()))
			for _, l := range lines {
				fd, mnt, _ := strings.Cut(l, " ")
				must.NotEq(t, "", mnt, must.Sprintf("fd %s: no mount id", fd))
				must.False(t, hostDev[mnt], must.Sprintf("fd %s of the exec'd command is a file of the host's /dev (mount %s)", fd, mnt))
			}
		})
	}
}
