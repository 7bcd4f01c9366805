package mounter

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// TestOpenSealed_Root: a binary opened sealed runs, and nothing done
// through its descriptor (what /proc/<pid>/exe of a process exec'd from it
// hands out) changes the file on the host: on a clone of its mount, and
// as a sealed memfd copy when the mount is unbindable and cannot be
// cloned.
func TestOpenSealed_Root(t *testing.T) {
	requireRoot(t)
	for _, tc := range []struct {
		name       string
		unbindable bool
	}{{"clone", false}, {"unbindable mount, memfd copy", true}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := privateDir(t)
			must.NoError(t, unix.Mount("tmpfs", dir, "tmpfs", 0, "size=16m"))
			cleanupMount(t, dir)
			if tc.unbindable {
				must.NoError(t, unix.Mount("", dir, "", unix.MS_UNBINDABLE, ""))
				_, err := New().CloneTree(dir, false)
				must.ErrorIs(t, err, unix.EINVAL, must.Sprint("an unbindable mount was cloned: the test proves nothing"))
			}
			bin := filepath.Join(dir, "true")
			data, err := os.ReadFile("/bin/true")
			must.NoError(t, err)
			must.NoError(t, os.WriteFile(bin, data, 0o755))

			f, err := OpenSealed(New(), bin)
			must.NoError(t, err)
			defer f.Close()
			cmd := exec.Command(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
			must.NoError(t, cmd.Run(), must.Sprint("the sealed binary does not run"))

			// As a root task would through /proc/<pid>/exe.
			path := fmt.Sprintf("/proc/self/fd/%d", f.Fd())
			if w, err := os.OpenFile(path, os.O_WRONLY, 0); err == nil {
				_, werr := w.Write([]byte("x"))
				w.Close()
				must.Error(t, werr, must.Sprint("wrote into the sealed binary"))
			}
			if err := os.Truncate(path, 0); err == nil {
				t.Fatal("truncated the sealed binary")
			}
			if err := os.Chmod(path, 0o4755); err == nil && !tc.unbindable {
				t.Fatal("made the cloned binary setuid")
			}
			fi, err := os.Stat(bin)
			must.NoError(t, err)
			must.Eq(t, os.FileMode(0o755), fi.Mode(), must.Sprint("the host's file changed mode"))
			got, err := os.ReadFile(bin)
			must.NoError(t, err)
			must.True(t, string(got) == string(data), must.Sprint("the host's file changed"))
		})
	}
}
