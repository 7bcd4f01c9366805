//go:build e2e

package e2e

import (
	"regexp"
	"strconv"
	"testing"
)

// escForkScript forks up to $1 children (perl, in /usr), each sleeping,
// stops at the first fork the kernel refuses, kills them all and prints
// "FORKED <n> REFUSED <0|1> <why>". Bounded: at most $1 processes, gone
// before the task ends.
const escForkScript = escWho + `/usr/bin/perl -e '
  my ($n, @kids, $why) = (0);
  for (1 .. $ARGV[0]) {
    my $p = fork;
    if (!defined $p) { $why = "$!"; last }
    if ($p == 0) { sleep 60; exit 0 }
    push @kids, $p; $n++;
  }
  kill 9, @kids; waitpid($_, 0) for @kids;
  printf "FORKED %d REFUSED %d %s\n", $n, defined $why ? 1 : 0, $why // "";' "$1"
echo DONE
`

// 24. A fork bomb: a task that is not privileged, as nobody too, could
// take every PID of the host (pid_max is 32768 here): the driver, Nomad
// and every other allocation could then start no process or thread, and
// so tear no volume down. The operator's pids_limit (here 64; 4096 by
// default) caps the task's cgroup: the task's fork past it is refused
// with EAGAIN ("Resource temporarily unavailable").
func TestEscapeForkBound(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	const limit = 64
	a := StartAgent(t, AgentOptions{Drivers: []string{DriverName}, DriverConfig: "    pids_limit = " + strconv.Itoa(limit)})
	for _, user := range []string{"", "root"} {
		t.Run("user_"+map[string]string{"": "unset", "root": "root"}[user], func(t *testing.T) {
			job := escRun(t, a, escJob{User: user, Script: escForkScript, Args: []string{strconv.Itoa(2 * limit)}})
			al := a.WaitAlloc(t, job.ID, escTimeout, StatusComplete, StatusFailed)
			out := escRead(t, a, al.ID, "t", false)
			t.Logf("the task said:\n%s", out)
			m := regexp.MustCompile(`FORKED (\d+) REFUSED (\d) (.*)`).FindStringSubmatch(out)
			if m == nil {
				t.Fatalf("the task did not report its forks:\n%s", al.Describe())
			}
			forked, _ := strconv.Atoi(m[1])
			if m[2] != "1" || forked >= limit {
				t.Fatalf("ESCAPED: the task forked %d processes with pids_limit = %d, none refused", forked, limit)
			}
			if m[3] != "Resource temporarily unavailable" {
				t.Errorf("the fork was refused with %q, not the pids controller's EAGAIN", m[3])
			}
			t.Logf("contained: %d forks, then %q", forked, m[3])
		})
	}
}
