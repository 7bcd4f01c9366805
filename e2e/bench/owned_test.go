//go:build e2e

package bench

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

// An OwnedTempDir's end kills the processes of its own run that name it,
// its children and those that outlived their parent (a driver whose agent
// died), and never another's: go test runs packages side by side, and a
// CI job may run beside another; a process of theirs that merely has the
// path on its command line is not this test's to kill.
func TestOwnedTempDir_KillsOnlyItsRunsProcesses(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("this test reads other processes' environments in /proc and must run as root")
	}
	// orphan starts sh -c script from a shell that exits at once, so that
	// it is no descendant of this process, with env (nil: this process's)
	// and the path on its command line; it returns its pid.
	orphan := func(t *testing.T, env []string, path string) int {
		t.Helper()
		cmd := exec.Command("sh", "-c", `sh -c 'while :; do sleep 1; done' "$1" </dev/null >/dev/null 2>&1 & echo $!`, "sh", path)
		cmd.Env = env
		out, err := cmd.Output()
		must.NoError(t, err)
		pid, err := strconv.Atoi(string(bytes.TrimSpace(out)))
		must.NoError(t, err)
		return pid
	}
	alive := func(pid int) bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return false
		}
		fields := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		return fields[0] != "Z"
	}
	var (
		dir           string
		child         *exec.Cmd
		ours, another int
	)
	t.Cleanup(func() {
		for _, pid := range []int{ours, another} {
			if pid > 0 && alive(pid) {
				_ = unix.Kill(pid, unix.SIGKILL)
			}
		}
		if child != nil && child.ProcessState == nil {
			_ = child.Process.Kill()
			_ = child.Wait()
		}
		if dir != "" {
			_ = os.RemoveAll(dir)
		}
	})
	t.Run("test", func(t *testing.T) {
		dir = e2e.OwnedTempDir(t, "ncsb-")
		child = exec.Command("sleep", "1000")
		child.Dir = dir
		must.NoError(t, child.Start())
		ours = orphan(t, nil, filepath.Join(dir, "stats.json"))
		// Another run's: its environment is not this run's.
		another = orphan(t, []string{"PATH=" + os.Getenv("PATH")}, filepath.Join(dir, "stats.json"))
		must.True(t, alive(ours) && alive(another))
	})
	if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("%s is still there (stat: %v)", dir, err)
	}
	must.False(t, alive(ours), must.Sprint("a process of this run that outlived its parent still runs"))
	_ = child.Wait()
	ws := child.ProcessState.Sys().(syscall.WaitStatus)
	must.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, must.Sprintf("child ended: %v", child.ProcessState))
	must.True(t, alive(another), must.Sprint("a process of another run that names the directory was killed"))
}
