//go:build e2e

package bench

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/debugstats"
)

// The many-tasks benchmark's debug-stats directory (/tmp/ncsb-*) is gone
// once the benchmark ends, passed or failed, with whatever still wrote
// there: a driver that outlived its agent rewrites stats.json every second
// (a temporary file renamed over it), and a bare RemoveAll beside it either
// left it running or met the directory refilled between its reads and its
// rmdir (ENOTEMPTY), which left the directory behind.
func TestManyStatsFile_RemovedWithItsWriter(t *testing.T) {
	var (
		stats  string
		writer *exec.Cmd
	)
	t.Cleanup(func() {
		// Should a check below fail, nothing stays running or behind.
		if writer != nil && writer.ProcessState == nil {
			_ = writer.Process.Kill()
			_ = writer.Wait()
		}
		if stats != "" {
			_ = os.RemoveAll(filepath.Dir(stats))
		}
	})
	// The benchmark: its cleanups run, as on failure, when it returns.
	t.Run("bench", func(t *testing.T) {
		stats = manyStatsFile(t)
		// A writer as the driver's debug stats are: named in its
		// environment, a temporary file renamed over stats.json.
		writer = exec.Command("sh", "-c", `while :; do echo '{}' > "$1.tmp" && mv -f "$1.tmp" "$1"; sleep 0.01; done`, "sh", stats)
		writer.Env = append(os.Environ(), debugstats.Env+"="+stats)
		must.NoError(t, writer.Start())
		for {
			if _, err := os.Stat(stats); err == nil {
				break
			}
			time.Sleep(time.Millisecond)
		}
	})
	if _, err := os.Stat(filepath.Dir(stats)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("%s is still there (stat: %v)", filepath.Dir(stats), err)
	}
	// Killed by the cleanup: a zombie, our child, until we wait for it.
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", writer.Process.Pid))
	must.NoError(t, err)
	fields := strings.Fields(string(st[strings.LastIndexByte(string(st), ')')+1:]))
	must.Eq(t, "Z", fields[0], must.Sprint("the process writing there still runs"))
	_ = writer.Wait()
	ws := writer.ProcessState.Sys().(syscall.WaitStatus)
	must.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, must.Sprintf("writer ended: %v", writer.ProcessState))
}
