package executor

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// A task whose state directory's file system fills up while it runs
// (another task took every inode and block of the disk they share) still
// has its exit status recorded: the supervisor writes it into the file
// the start reserved. The status made a new file before, which failed
// with ENOSPC, and the task's exit code was lost (-1).
func TestStart_ExitRecordedOnFullStateDir_Root(t *testing.T) {
	requireTaskRoot(t)
	release := filepath.Join(t.TempDir(), "release")
	tt := newTestSpec(t, "/bin/sh", "-c", fmt.Sprintf(`while [ ! -e %s ]; do sleep 0.05; done; exit 0`, release))
	must.NoError(t, unix.Mount("tmpfs", tt.spec.StateDir, "tmpfs", 0, "size=4m,nr_inodes=64,mode=0700"))
	t.Cleanup(func() {
		if err := unix.Unmount(tt.spec.StateDir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", tt.spec.StateDir, err)
		}
	})
	p := startTest(t, tt)
	filler := fillDir(t, tt.spec.StateDir)
	must.NoError(t, os.WriteFile(release, nil, 0o600))

	st := waitExit(t, p)
	must.Eq(t, 0, st.ExitCode, must.Sprintf("status: %+v", st))
	must.Eq(t, "", st.Err)

	// After the supervisor, Recover reads the same status from the full
	// file system.
	b, err := json.Marshal(p.State())
	must.NoError(t, err)
	var decoded State
	must.NoError(t, json.Unmarshal(b, &decoded))
	p2, err := Recover(hclog.NewNullLogger(), decoded)
	must.NoError(t, err)
	must.Eq(t, 0, waitExit(t, p2).ExitCode)
	must.NoError(t, os.RemoveAll(filler))
}

// fillDir takes every inode, then every block, of dir's file system, and
// returns the directory of the files it made.
func fillDir(t *testing.T, dir string) string {
	t.Helper()
	fill := filepath.Join(dir, "filler")
	must.NoError(t, os.Mkdir(fill, 0o700))
	var last string
	for i := 0; ; i++ {
		p := filepath.Join(fill, fmt.Sprint(i))
		err := os.WriteFile(p, nil, 0o600)
		if errors.Is(err, unix.ENOSPC) {
			break
		}
		must.NoError(t, err)
		last = p
	}
	f, err := os.OpenFile(last, os.O_WRONLY, 0)
	must.NoError(t, err)
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			must.True(t, errors.Is(err, unix.ENOSPC), must.Sprintf("want ENOSPC: %v", err))
			break
		}
	}
	_, err = os.CreateTemp(dir, "probe-*")
	must.True(t, errors.Is(err, unix.ENOSPC), must.Sprintf("the file system is not full: %v", err))
	return fill
}
