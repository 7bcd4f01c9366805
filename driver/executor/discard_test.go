package executor

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// startOrphan starts tt's spec from a throw-away driver process and kills
// that driver once the task runs, as a driver dies before StartTask
// returns: the supervisor and the task live on with nobody to end them.
func startOrphan(t *testing.T, tt *testTask) State {
	t.Helper()
	specPath := filepath.Join(t.TempDir(), "spec.json")
	must.NoError(t, wire.WriteJSONAtomic(specPath, tt.spec, 0o600))
	driver := exec.Command("/proc/self/exe", "-test.run=^$")
	driver.Env = append(os.Environ(), envStartHelper+"="+specPath)
	out, err := driver.StdoutPipe()
	must.NoError(t, err)
	must.NoError(t, driver.Start())
	t.Cleanup(func() { _ = driver.Process.Kill(); _ = driver.Wait() })
	line, err := bufio.NewReader(out).ReadBytes('\n')
	must.NoError(t, err)
	var st State
	must.NoError(t, json.Unmarshal(line, &st))
	must.NoError(t, driver.Process.Signal(syscall.SIGKILL))
	_ = driver.Wait()
	must.NoError(t, unix.Kill(st.TaskPID, 0))
	return st
}

func TestDiscard_StartCutShort_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, tc := range []struct {
		name     string
		isolated bool
	}{
		// The task outlives its supervisor: only the cgroup ends it.
		{"host pid namespace", false},
		// The supervisor is the task's init: killing it ends the task.
		{"private pid namespace", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tt := newTestSpec(t, "sleep", "1000")
			if tc.isolated {
				tt = isolatedSpec(t, "exec sleep 1000")
			}
			st := startOrphan(t, tt)

			// Discard says what it did, not why: the dangling-task
			// reconciler ends through it tasks that ran for days.
			var logs strings.Builder
			must.NoError(t, Discard(hclog.New(&hclog.LoggerOptions{Output: &logs}), tt.spec.StateDir))
			must.StrContains(t, logs.String(), "ended the processes of a task Nomad has no handle for")
			must.StrNotContains(t, logs.String(), "cut short")
			for _, pid := range []int{st.TaskPID, st.SupervisorPID} {
				// Dead, or a zombie nobody of ours reaps yet.
				if err := unix.Kill(pid, 0); err == nil {
					stat := readFile(t, fmt.Sprintf("/proc/%d/stat", pid))
					must.StrContains(t, stat, ") Z ", must.Sprintf("pid %d still runs", pid))
				}
			}
			must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
			_, err := os.Stat(tt.spec.StateDir)
			must.True(t, os.IsNotExist(err))

			// Again: nothing left to do is not an error.
			must.NoError(t, Discard(hclog.NewNullLogger(), tt.spec.StateDir))
		})
	}
}

func TestDiscard_NothingStarted(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	must.NoError(t, os.Mkdir(dir, 0o700))
	must.NoError(t, os.WriteFile(filepath.Join(dir, "other"), nil, 0o600))
	must.NoError(t, Discard(hclog.NewNullLogger(), dir))
	_, err := os.Stat(dir)
	must.True(t, os.IsNotExist(err))

	// A spec that cannot be read is an error, not a guess.
	must.NoError(t, os.Mkdir(dir, 0o700))
	must.NoError(t, os.WriteFile(filepath.Join(dir, wire.SpecFile), []byte("{"), 0o600))
	must.Error(t, Discard(hclog.NewNullLogger(), dir))
	// Unless a crash of the host cut it: the spec, not synced, was written
	// before the host booted, and nothing of it runs. The supervisor
	// record is not read: its pid is another process's since the boot.
	for _, spec := range [][]byte{{}, []byte(`{"task_id":"a/t/`), make([]byte, 300)} {
		must.NoError(t, os.MkdirAll(dir, 0o700))
		must.NoError(t, os.WriteFile(filepath.Join(dir, wire.SpecFile), spec, 0o600))
		must.NoError(t, wire.WriteJSONAtomic(filepath.Join(dir, wire.SupervisorFile), wire.SupervisorRecord{PID: os.Getpid(), Start: 1}, 0o600))
		must.Error(t, Discard(hclog.NewNullLogger(), dir), must.Sprint("a spec cut during this boot"))
		must.NoError(t, os.Chtimes(filepath.Join(dir, wire.SpecFile), time.Unix(86400, 0), time.Unix(86400, 0)))
		must.NoError(t, Discard(hclog.NewNullLogger(), dir))
		_, err = os.Stat(dir)
		must.True(t, os.IsNotExist(err))
	}
	// A supervisor record cut likewise, beside a whole spec whose cgroup
	// went with the host.
	must.NoError(t, os.Mkdir(dir, 0o700))
	must.NoError(t, os.WriteFile(filepath.Join(dir, wire.SpecFile),
		[]byte(`{"task_id":"a/t/1","cgroup_parent":"nomad-driver-csi-test-gone","cgroup_name":"gone"}`), 0o600))
	must.NoError(t, os.WriteFile(filepath.Join(dir, wire.SupervisorFile), []byte(`{"pid":`), 0o600))
	must.Error(t, Discard(hclog.NewNullLogger(), dir), must.Sprint("a supervisor record cut during this boot"))
	must.NoError(t, os.Chtimes(filepath.Join(dir, wire.SupervisorFile), time.Unix(86400, 0), time.Unix(86400, 0)))
	must.NoError(t, Discard(hclog.NewNullLogger(), dir))
	_, err = os.Stat(dir)
	must.True(t, os.IsNotExist(err))
	// A spec that decodes as something else is no crash's: refused.
	must.NoError(t, os.Mkdir(dir, 0o700))
	must.NoError(t, os.WriteFile(filepath.Join(dir, wire.SpecFile), []byte(`{"task_id":7}`), 0o600))
	must.NoError(t, os.Chtimes(filepath.Join(dir, wire.SpecFile), time.Unix(86400, 0), time.Unix(86400, 0)))
	must.Error(t, Discard(hclog.NewNullLogger(), dir))
}
