package driver

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// A root task in the host's PID namespace that stops its supervisor (its
// parent) is still stopped and destroyed by Nomad's StopTask and
// DestroyTask, its processes and supervisor gone. The task stops its
// supervisor only once the start has returned (the test's /local/go): a
// supervisor stopped before it reports the start is a failed start, the
// case of the executor's TestStart_SupervisorSilent_Root.
func TestDriver_supervisorStoppedByTask_Root(t *testing.T) {
	requireRoot(t)
	parent := fmt.Sprintf("ncsi-life-lss-%d", os.Getpid())
	root := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })
	h, d := harnessDriver(t, Config{RootDir: root, CgroupParent: parent, AllowHostNamespaces: true})
	cfg := realTask(t, "stopper", TaskConfig{Command: "/bin/sh", PIDMode: "host",
		Args: []string{"-c", "sleep 1000 & while [ ! -e /local/go ]; do sleep 0.05; done; kill -STOP $PPID; exec sleep 1000"}})
	cfg.User = "root"
	cleanup := mkAllocDir(t, h, cfg, true)
	t.Cleanup(cleanup)
	startTask(t, h, cfg)
	must.NoError(t, h.WaitUntilStarted(cfg.ID, 10*time.Second))
	sup, task := supervisorOf(t, d, cfg.ID)
	must.NoError(t, os.WriteFile(filepath.Join(cfg.TaskDir().LocalDir, "go"), nil, 0o644))
	// A supervisor left stopped by a failure ends with the test.
	supFD, err := unix.PidfdOpen(sup, 0)
	must.NoError(t, err)
	t.Cleanup(func() {
		_ = unix.PidfdSendSignal(supFD, unix.SIGKILL, nil, 0)
		_ = unix.Close(supFD)
	})
	eventually(t, 10*time.Second, func() error {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", sup))
		if err != nil {
			return err
		}
		if !strings.Contains(string(b), ") T ") {
			return errors.New("supervisor not stopped yet")
		}
		return nil
	})

	must.NoError(t, h.StopTask(cfg.ID, time.Second, "SIGTERM"))
	res := waitExit(t, h, cfg.ID, 20*time.Second)
	t.Logf("exit: %+v", res)
	must.Eq(t, int(unix.SIGTERM), res.Signal)
	must.NoError(t, h.DestroyTask(cfg.ID, false))
	must.False(t, alive(task))
	must.False(t, alive(sup))
}
