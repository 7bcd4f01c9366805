//go:build e2e

package e2e

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// TestSweepStale_OwnedDirs: SweepStale takes an OwnedTempDir only once
// the process holding its owner lock is gone, and then kills the
// processes left in it, unmounts what is mounted under it and removes
// it. A live one (of this process, or of another) and one without an
// owner file (an older harness) are left alone. Root: it mounts.
func TestSweepStale_OwnedDirs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("this test mounts tmpfs and must run as root")
	}
	// It checks the removal that E2E_KEEP (set in make e2e-vm's guest, to
	// bring the agents' logs back) turns off.
	t.Setenv("E2E_KEEP", "")
	mountTmpfs := func(dir string) string {
		t.Helper()
		mnt := filepath.Join(dir, "mnt")
		must.NoError(t, os.Mkdir(mnt, 0o700))
		must.NoError(t, unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"))
		return mnt
	}
	mounted := func(path string) bool {
		t.Helper()
		ok, err := mounter.New().IsMountPoint(path)
		if errors.Is(err, fs.ErrNotExist) {
			return false
		}
		must.NoError(t, err)
		return ok
	}
	start := func(dir string, args ...string) *exec.Cmd {
		t.Helper()
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir = dir
		must.NoError(t, cmd.Start())
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	cleanup := func(dir string) {
		t.Cleanup(func() {
			if err := UnmountUnder(dir); err != nil {
				t.Errorf("cleanup: %v", err)
				return
			}
			os.RemoveAll(dir)
		})
	}

	// Alive in this process.
	mine := OwnedTempDir(t, "ncsp-")
	cleanup(mine)
	mineMnt := mountTmpfs(mine)

	// Made by another process that still holds its lock, then dies.
	other, err := os.MkdirTemp("/tmp", "ncsb-")
	must.NoError(t, err)
	cleanup(other)
	owner := filepath.Join(other, ownerFile)
	must.NoError(t, os.WriteFile(owner, nil, 0o600))
	// One process that holds the lock itself (flock(1) with a command
	// would leave the lock with its child).
	holder := start("/", "sh", "-c", `exec 9>"$1" && flock -n 9 && exec sleep 1000`, "sh", owner)
	deadline := time.Now().Add(30 * time.Second)
	for ownerGone(other) {
		if time.Now().After(deadline) {
			t.Fatal("the holder did not take the owner lock within 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	otherMnt := mountTmpfs(other)
	orphan := start(other, "sleep", "1000")

	// Made by an older harness: no owner file.
	legacy, err := os.MkdirTemp("/tmp", "ncsp-")
	must.NoError(t, err)
	cleanup(legacy)

	SweepStale(t.Logf)
	must.True(t, mounted(mineMnt), must.Sprint("a directory of this process was unmounted"))
	must.True(t, mounted(otherMnt), must.Sprint("a directory whose maker holds its lock was unmounted"))
	must.DirExists(t, legacy)

	must.NoError(t, holder.Process.Kill())
	holder.Wait()
	SweepStale(t.Logf)
	must.True(t, mounted(mineMnt), must.Sprint("a directory of this process was unmounted"))
	must.DirExists(t, legacy)
	if _, err := os.Stat(other); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the directory of a dead maker is still there (stat: %v)", err)
	}
	must.False(t, mounted(otherMnt))
	// The orphan was killed: Wait returns once it is (the test's own
	// cleanup would kill it too, so this checks the state it saw).
	done := make(chan error, 1)
	go func() { done <- orphan.Wait() }()
	select {
	case err := <-done:
		var exit *exec.ExitError
		must.True(t, errors.As(err, &exit), must.Sprintf("orphan exited with %v", err))
	case <-time.After(30 * time.Second):
		t.Fatal("the process left in a dead maker's directory was not killed")
	}
}
