package executor

import (
	"os"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// A task running as root (with exec's default kill) may signal the init
// of its PID namespace, its supervisor, as often as it likes: the
// supervisor drops every signal, and logs each kind once, never one line
// per signal, for its log is in the driver's root_dir and a task must not
// be able to fill that file system (where the volumes' journal lives).
// Before, a task sending signals in a loop grew the log by about 400 KB a
// second, for good.
func TestProcess_SignalFloodOnSupervisor_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/usr/bin/perl"); err != nil {
		t.Skip("test sends its signals with /usr/bin/perl, which this host lacks")
	}
	tt := isolatedSpec(t, `perl -e 'for (1..20000) { kill "USR1", 1; kill "USR2", 1; kill "HUP", 1 }' && echo sent=yes; exec sleep 100`)
	tt.spec.User = "root"
	p := startTest(t, tt)
	waitFor(t, "the signals to be sent", func() bool { return strings.Contains(readFile(t, tt.stdout), "sent=yes") })
	// The supervisor lives on, its task too, and its log holds a line for
	// each of the three kinds at most.
	must.NoError(t, p.Signal(0))
	must.False(t, p.exited())
	log := readFile(t, tt.spec.StateDir+"/supervisor.log")
	lines := strings.Count(log, "ignoring signal")
	t.Logf("supervisor log: %d bytes, %d lines about ignored signals", len(log), lines)
	must.LessEq(t, 3, lines, must.Sprintf("the supervisor logged %d lines for the task's signals", lines))
}
