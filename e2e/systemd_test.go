//go:build e2e

package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// The systemd mode's unit is the example's with only ExecStart and the
// output replaced: Delegate, KillMode and the rest are the operator's.
func TestRenderUnit(t *testing.T) {
	root, err := RepoRoot()
	must.NoError(t, err)
	example, err := os.ReadFile(filepath.Join(root, exampleUnit))
	must.NoError(t, err)
	got, err := renderUnit(example, []string{"/opt/nomad", "agent", "-config=/tmp/a 100%.hcl"}, "/tmp/d", "/tmp/d/agent.log", []string{`K="v"`})
	must.NoError(t, err)
	s := string(got)
	must.StrContains(t, s, "\nExecStart=\"/opt/nomad\" \"agent\" \"-config=/tmp/a 100%%.hcl\"\n")
	must.StrContains(t, s, "\nStandardOutput=append:/tmp/d/agent.log\n")
	must.StrContains(t, s, "\nEnvironment=\"K=\\\"v\\\"\"\n")
	for _, line := range strings.Split(string(example), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "ExecStart="):
			must.StrNotContains(t, s, line+"\n")
		case line == "[Install]" || strings.HasPrefix(line, "WantedBy="):
			must.StrNotContains(t, s, line)
		case strings.Contains(line, "="):
			must.StrContains(t, s, line+"\n", must.Sprintf("the example's %q is not in the unit", line))
		}
	}
	must.StrContains(t, s, "\nDelegate=yes\n")
	must.StrContains(t, s, "\nKillMode=process\n")
	_, err = renderUnit([]byte("[Service]\nUser=root\n"), []string{"x"}, "/", "/l", nil)
	must.ErrorContains(t, err, "no ExecStart")
}
