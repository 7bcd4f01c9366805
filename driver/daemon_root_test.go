package driver

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// hostProcsWith lists the host's processes whose command line holds token.
func hostProcsWith(t *testing.T, token string) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	must.NoError(t, err)
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue // gone meanwhile
		}
		if bytes.Contains(b, []byte(token)) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// As with exec, a task's processes all go when it does: a child that
// made itself a daemon (a session of its own, deaf to SIGTERM, SIGHUP and
// SIGINT) outlives neither a stop whose signal the main process obeys nor
// the main process's own exit, privileged (in the host's PID namespace,
// where nothing ends it for us) or not. The exit reported is the main
// process's.
func TestDriver_daemonizedChildrenGoWithTheTask(t *testing.T) {
	requireRoot(t)
	for _, tc := range []struct {
		name       string
		privileged bool
		stop       bool
		wantCode   int
	}{
		{name: "isolated_stopped", stop: true},
		{name: "isolated_exits", wantCode: 7},
		{name: "privileged_stopped", privileged: true, stop: true},
		{name: "privileged_exits", privileged: true, wantCode: 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, _ := harnessDriver(t, Config{AllowPrivileged: true, PrivilegedGrants: grantAll})
			// A number no other process has on its command line.
			token := fmt.Sprintf("4%d", time.Now().UnixNano()%1e9)
			daemon := fmt.Sprintf(`setsid sh -c 'trap "" TERM HUP INT; touch /local/up; exec sleep %s' </dev/null >/dev/null 2>&1 &`, token)
			main := `trap 'exit 0' TERM; ` + daemon + ` while [ ! -e /local/up ]; do sleep 0.05; done; `
			if tc.stop {
				main += `while :; do sleep 0.05; done`
			} else {
				main += `exit 7`
			}
			cfg := realTask(t, "daemon", TaskConfig{Command: "/bin/sh", Args: []string{"-c", main}, Privileged: tc.privileged})
			cleanup := mkAllocDir(t, h, cfg, true)
			defer cleanup()
			t.Cleanup(func() {
				for _, pid := range hostProcsWith(t, token) {
					t.Logf("cleanup: killing leftover pid %d", pid)
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			})
			startTask(t, h, cfg)
			up := filepath.Join(cfg.TaskDir().LocalDir, "up")
			eventually(t, 10*time.Second, func() error {
				_, err := os.Stat(up)
				return err
			})
			if tc.stop {
				eventually(t, 10*time.Second, func() error {
					if len(hostProcsWith(t, "sleep\x00"+token)) == 0 {
						return fmt.Errorf("no daemon with %s runs yet", token)
					}
					return nil
				})
				must.NoError(t, h.StopTask(cfg.ID, 30*time.Second, "SIGTERM"))
			}
			exit := waitExit(t, h, cfg.ID, 30*time.Second)
			must.Eq(t, tc.wantCode, exit.ExitCode)
			must.Eq(t, 0, exit.Signal)
			must.False(t, exit.OOMKilled)
			// Reported once the rest of the task is killed: nothing of it
			// runs, before the task is even destroyed (a killed process
			// not reaped yet has an empty command line).
			must.Eq(t, []int(nil), hostProcsWith(t, token), must.Sprint("processes of the task left after it exited"))
			must.NoError(t, h.DestroyTask(cfg.ID, false))
		})
	}
}

// `logs { disabled = true }`: Nomad runs no logmon for the task and hands
// the driver /dev/null as both outputs (os.DevNull, Nomad's
// newLogMonHookConfig), as exec takes them. The task runs, and what it
// writes goes nowhere.
func TestDriver_logsDisabledRunsTheTask(t *testing.T) {
	requireRoot(t)
	h, _ := harnessDriver(t, Config{})
	cfg := realTask(t, "nologs", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "echo out; echo err >&2; exit 5"}})
	cleanup := mkAllocDir(t, h, cfg, false)
	defer cleanup()
	cfg.StdoutPath, cfg.StderrPath = os.DevNull, os.DevNull
	startTask(t, h, cfg)
	exit := waitExit(t, h, cfg.ID, 20*time.Second)
	must.Eq(t, 5, exit.ExitCode)
	must.NoError(t, exit.Err)
	must.NoError(t, h.DestroyTask(cfg.ID, false))
}
