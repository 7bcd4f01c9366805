package executor

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// The kernel's terminals are one pool for the node (kernel.pty.max less
// kernel.pty.reserve, which only the host's own devpts may use): a task
// that opens /dev/ptmx until it fails, as nobody too, must not leave
// another allocation's task without a terminal (each task's devpts holds
// at most the supervisor's taskPtyMax).
func TestIsolation_TerminalsBounded_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/usr/bin/perl"); err != nil {
		t.Skip("test opens its terminals with /usr/bin/perl, which this host lacks")
	}
	hog := isolatedSpec(t, `perl -e '
$| = 1;
my @held;
while (open(my $f, "+<", "/dev/ptmx")) { push @held, $f; }
print "held=", scalar(@held), "\n", "err=", ($!+0), "\n";
sleep 600;
'`)
	hog.spec.User = "nobody"
	p := startTest(t, hog)
	waitFor(t, "the task to take every terminal it can", func() bool {
		return strings.Contains(readFile(t, hog.stdout), "err=")
	})
	held := outputLines(readFile(t, hog.stdout))
	t.Log(held)
	n, err := strconv.Atoi(held["held"])
	must.NoError(t, err)
	must.Positive(t, n, must.Sprint("the task could open no terminal at all"))
	// Its own devpts stopped it (ENOSPC), at the supervisor's taskPtyMax:
	// not its open-file limit (EMFILE at 1024 by default), which would let
	// this pass with no bound while still leaving the pool of 3072 to two
	// such tasks.
	must.Eq(t, strconv.Itoa(int(unix.ENOSPC)), held["err"], must.Sprint("the task's terminals were not bounded by its devpts"))
	must.LessEq(t, 128, n, must.Sprintf("the task held %d terminals", n))

	other := isolatedSpec(t, `perl -e 'print "other=", (open(my $f, "+<", "/dev/ptmx") ? "ok" : ($!+0)), "\n"'`)
	got := runLines(t, other)
	must.Eq(t, "ok", got["other"], must.Sprintf("another task got no terminal while one task holds %d", n))
	must.NoError(t, p.Kill())
}
