package executor

import (
	"os"
	"testing"

	"github.com/shoenig/test/must"
)

// The host's interrupt counts are masked from a task, as Docker and the
// kubelet mask them: /proc/interrupts counts every interrupt of every
// device on every CPU of the node (keystrokes, another allocation's
// network and disk traffic), which a task sampling it would time.
func TestIsolation_InterruptsMasked_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/proc/interrupts"); err != nil {
		t.Skip("this kernel has no /proc/interrupts")
	}
	got := runLines(t, isolatedSpec(t, `echo "interrupts=$(head -c 64 /proc/interrupts | wc -c)"`))
	must.Eq(t, "0", got["interrupts"], must.Sprint("a task read the host's /proc/interrupts"))
}
