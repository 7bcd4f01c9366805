package executor

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
)

// openFiles counts this process's open files.
func openFiles(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	must.NoError(t, err)
	return len(entries)
}

// Waiting spares that prepare an isolated root and make their group ahead,
// killed one after the other twenty times (an operator's kill, the OOM
// killer), are each replaced, and none leaves anything: its root directory
// under the spares' directory, its groups made ahead in any hierarchy, its
// pipe and control socket in the driver. Once the pool is closed no spare
// runs.
func TestSpares_KilledWaitingSparesLeaveNothing_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := isolatedSpec(t, "true")
	parent := tt.spec.CgroupParent
	dir := t.TempDir()
	// Refills run without their back-off wait: twenty deaths would
	// otherwise take minutes.
	s := &Spares{after: func(_ time.Duration, f func()) { go f() }}
	t.Cleanup(s.Close)
	s.SetDir(dir, tt.spec.Isolation)
	s.SetGroup(parent, cgroups.Limits{Devices: cgroups.DefaultDevices}, hclog.NewNullLogger())
	aheadBefore := aheadGroups(t, parent)
	_, err := os.Stat("/sys/fs/cgroup/pids")
	v1 := err == nil && cgroups.AheadAvailable()

	s.Fill("", hclog.NewNullLogger())
	// Counted with a spare waiting, as at the end (the process's set of
	// exit waits is made with the first spare, and stays).
	waitSpare(t, s, "")
	filesBefore := openFiles(t)
	var pids []int
	for range 20 {
		var pid int
		var group string
		waitFor(t, "a new waiting spare", func() bool {
			s.mu.Lock()
			defer s.mu.Unlock()
			sp := s.spares[""]
			if sp == nil || sp.cmd == nil || (len(pids) > 0 && sp.cmd.Process.Pid == pids[len(pids)-1]) {
				return false
			}
			pid = sp.cmd.Process.Pid
			if sp.group != nil {
				group = filepath.Join("/sys/fs/cgroup/pids", parent, sp.group.Name)
			}
			return true
		})
		if v1 {
			must.NotEq(t, "", group, must.Sprint("the spare makes no group ahead"))
			waitFor(t, "the spare's group", func() bool {
				_, err := os.Stat(group)
				return err == nil
			})
		}
		// Not through os.FindProcess, which holds a pidfd of its own.
		must.NoError(t, unix.Kill(pid, unix.SIGKILL))
		pids = append(pids, pid)
	}
	waitFor(t, "a spare after the last one killed", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		sp := s.spares[""]
		return sp != nil && sp.cmd != nil && sp.cmd.Process.Pid != pids[len(pids)-1]
	})
	s.mu.Lock()
	died := s.died[""]
	last := s.spares[""].cmd.Process.Pid
	s.mu.Unlock()
	must.Eq(t, 20, died, must.Sprint("every kill is counted once"))
	must.Eq(t, filesBefore, openFiles(t), must.Sprint("files of dead spares left open"))
	s.Close()

	for _, pid := range append(pids, last) {
		must.False(t, alive(pid), must.Sprintf("spare %d runs after the pool closed", pid))
	}
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	must.SliceEmpty(t, entries, must.Sprint("spares' root directories left"))
	must.Eq(t, aheadBefore, aheadGroups(t, parent), must.Sprint("groups made ahead left"))
}
