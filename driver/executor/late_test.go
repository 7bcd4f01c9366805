package executor

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// A late mount made on a private host mount after the supervisor started
// (so no propagation could bring it into the task's namespace) reaches the
// task through its tree: read-only when asked, a file for a file, and with
// an earlier mount whose target lies inside it made on top of it.
func TestStart_LateMounts_Root(t *testing.T) {
	requireTaskRoot(t)
	m := mounter.New()
	base := t.TempDir()
	// A private mount of its own, so that nothing made under it later can
	// propagate anywhere.
	must.NoError(t, m.BindMount(base, base, false, false))
	t.Cleanup(func() { detachAll(base) })
	must.NoError(t, m.SetPropagation(base, mounter.PropagationPrivate, false))
	vol := filepath.Join(base, "vol")
	file := filepath.Join(base, "file")
	must.NoError(t, os.Mkdir(vol, 0o755))
	must.NoError(t, os.WriteFile(file, nil, 0o644))
	inner := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(inner, "inner"), []byte("inner\n"), 0o644))

	tt := newTestSpec(t, "/bin/sh", "-c", `
cat /late/data/marker
cat /late/data/sub/inner
cat /late/file
if touch /late/data/new 2>/dev/null; then echo writable; else echo read-only; fi`)
	tt.spec.Mounts = []Mount{{Source: inner, Target: "/late/data/sub"}}
	tt.spec.LateMounts = []Mount{{Target: "/late/file"}, {Target: "/late/data"}}
	called := 0
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		called++
		// Mounted now, in the host's namespace only.
		must.NoError(t, m.Mount("late-data", vol, "tmpfs", 0, "size=1m"))
		must.NoError(t, os.WriteFile(filepath.Join(vol, "marker"), []byte("late\n"), 0o644))
		must.NoError(t, os.Mkdir(filepath.Join(vol, "sub"), 0o755))
		must.NoError(t, m.BindMount(filepath.Join(inner, "inner"), file, false, false))
		return []Mount{{Source: file, Target: "/late/file"}, {Source: vol, Target: "/late/data", ReadOnly: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 1, called)
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "late\ninner\ninner\nread-only\n", readFile(t, tt.stdout))
	// The host's mounts are the host's: unmounting them works and leaves
	// nothing behind.
	must.NoError(t, m.Unmount(vol))
	must.NoError(t, m.Unmount(file))
}

// An error from late stops the supervisor before anything runs: Start
// returns that very error, and no process, cgroup or tree is left.
func TestStart_LateMountsError_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "/bin/sh", "-c", "echo ran")
	tt.spec.LateMounts = []Mount{{Target: "/late/data"}}
	boom := errors.New("NodeStageVolume failed")
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) { return nil, boom })
	must.Nil(t, p)
	must.ErrorIs(t, err, boom)
	must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
	must.Eq(t, 0, len(processesMentioning(t, tt.spec.StateDir)))
	must.Eq(t, "", readFile(t, tt.stdout))

	// A source that is gone fails the start with a message naming it.
	tt = newTestSpec(t, "/bin/sh", "-c", "echo ran")
	tt.spec.LateMounts = []Mount{{Target: "/late/data"}}
	p, err = Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: "/nonexistent/volume", Target: "/late/data"}}, nil
	})
	must.Nil(t, p)
	must.ErrorContains(t, err, `"/nonexistent/volume"`)
	must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
	must.Eq(t, 0, len(processesMentioning(t, tt.spec.StateDir)))

	// Mounts for other targets than the spec's are refused.
	tt = newTestSpec(t, "/bin/sh", "-c", "echo ran")
	tt.spec.LateMounts = []Mount{{Target: "/late/data"}}
	p, err = Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: t.TempDir(), Target: "/elsewhere"}}, nil
	})
	must.Nil(t, p)
	must.ErrorContains(t, err, `mount 0 is for "/elsewhere", want "/late/data"`)
	must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))

	// Late mounts need a late function.
	tt = newTestSpec(t, "true")
	tt.spec.LateMounts = []Mount{{Target: "/late/data"}}
	_, err = Start(hclog.NewNullLogger(), tt.spec, nil)
	must.ErrorContains(t, err, "late mounts")
}

// Without mounts inside them, late mounts are attached in the entered root,
// which is sealed only after: a top-level target is made on the task's own
// root and the root is read-only for the task.
func TestStart_LateMountsAfterPivot_Root(t *testing.T) {
	requireTaskRoot(t)
	vol := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(vol, "f"), []byte("top\n"), 0o644))
	top := "/ncsi-late-top-" + filepath.Base(vol)
	tt := newTestSpec(t, "/bin/sh", "-c", `cat "$TOP/f"; echo w > "$TOP/w" && echo wrote
if touch /top-level-file 2>/dev/null; then echo root-writable; else echo root-read-only; fi`)
	tt.spec.Env = append(tt.spec.Env, "TOP="+top)
	tt.spec.LateMounts = []Mount{{Target: top}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: vol, Target: top}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "top\nwrote\nroot-read-only\n", readFile(t, tt.stdout))
	must.Eq(t, "w\n", readFile(t, filepath.Join(vol, "w")))
	_, err = os.Stat(top)
	must.True(t, os.IsNotExist(err), must.Sprintf("%s exists on the host: %v", top, err))
}

// Nomad's log collector stops reading a FIFO for good once its last writer
// closes it. A supervisor waiting for its late mounts, which dies with its
// driver, must therefore not have opened the task's output yet: the start
// Nomad retries writes its output into that FIFO.
func TestStart_OutputOpenedOnlyOnceTheTaskRuns_Root(t *testing.T) {
	requireTaskRoot(t)
	fifo := filepath.Join(t.TempDir(), "stdout.fifo")
	must.NoError(t, unix.Mkfifo(fifo, 0o600))
	rfd, err := unix.Open(fifo, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	must.NoError(t, err)
	reader := os.NewFile(uintptr(rfd), fifo)
	defer reader.Close()
	// writers reports whether anyone holds the FIFO open for writing: a
	// non-blocking read sees EOF without one, EAGAIN with one.
	writers := func() bool {
		_, err := unix.Read(rfd, make([]byte, 64))
		return errors.Is(err, unix.EAGAIN)
	}

	src := t.TempDir()
	tt := newTestSpec(t, "/bin/sh", "-c", "echo through-the-fifo")
	tt.spec.StdoutPath = fifo
	tt.spec.LateMounts = []Mount{{Target: "/late"}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		// The supervisor runs and waits for these; give it every chance
		// to open the FIFO early.
		for i := 0; i < 20; i++ {
			must.False(t, writers(), must.Sprint("the supervisor opened the task's output before it had its mounts"))
			time.Sleep(25 * time.Millisecond)
		}
		return []Mount{{Source: src, Target: "/late"}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode)
	var out []byte
	waitFor(t, "the task's output", func() bool {
		buf := make([]byte, 64)
		n, _ := unix.Read(rfd, buf)
		if n > 0 {
			out = append(out, buf[:n]...)
		}
		return string(out) == "through-the-fifo\n"
	})
}
