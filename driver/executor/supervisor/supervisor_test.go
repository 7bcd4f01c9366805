package supervisor

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

func TestOpenLog_RefusesWhatATaskCouldPlant(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "host-file")
	must.NoError(t, os.WriteFile(target, []byte("precious\n"), 0o600))

	link := filepath.Join(dir, "link.fifo")
	must.NoError(t, os.Symlink(target, link))
	_, err := openLog(link)
	must.ErrorContains(t, err, "symlink")

	if os.Geteuid() == 0 {
		dev := filepath.Join(dir, "dev.fifo")
		must.NoError(t, unix.Mknod(dev, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3))))
		_, err = openLog(dev)
		must.ErrorContains(t, err, "not a FIFO")
	}

	sock := filepath.Join(dir, "d")
	must.NoError(t, os.Mkdir(sock, 0o700))
	_, err = openLog(sock)
	must.ErrorContains(t, err, "not a FIFO")

	// A logs/ directory a task replaced with a link to a host directory
	// that happens to hold a file of the FIFO's name.
	hostDir := filepath.Join(dir, "host-dir")
	must.NoError(t, os.Mkdir(hostDir, 0o700))
	must.NoError(t, os.WriteFile(filepath.Join(hostDir, ".t.stdout.fifo"), []byte("precious\n"), 0o600))
	alloc := filepath.Join(dir, "alloc")
	must.NoError(t, os.Mkdir(alloc, 0o777))
	must.NoError(t, os.Symlink(hostDir, filepath.Join(alloc, "logs")))
	_, err = openLog(filepath.Join(alloc, "logs", ".t.stdout.fifo"))
	must.ErrorContains(t, err, "symlink")

	for _, f := range []string{target, filepath.Join(hostDir, ".t.stdout.fifo")} {
		b, err := os.ReadFile(f)
		must.NoError(t, err)
		must.Eq(t, "precious\n", string(b))
	}

	// Nomad's FIFO, with a reader, opens.
	fifo := filepath.Join(dir, "task.stdout.fifo")
	must.NoError(t, unix.Mkfifo(fifo, 0o600))
	r, err := os.OpenFile(fifo, os.O_RDONLY|unix.O_NONBLOCK, 0)
	must.NoError(t, err)
	defer r.Close()
	w, err := openLog(fifo)
	must.NoError(t, err)
	_, err = w.Write([]byte("hello\n"))
	must.NoError(t, err)
	must.NoError(t, w.Close())
}

// With Nomad's logs disabled the task's stdin, stdout and stderr are all
// /dev/null, opened through one read-only clone of its mount per start,
// not one each: every fd is on the same mount, which is not the host's
// and is read-only, and reads and writes as /dev/null does.
func TestOpenStdio_OneReadOnlyNullClone(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: clones /dev/null's mount")
	}
	mntID := func(fd uintptr) string {
		t.Helper()
		b, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", fd))
		must.NoError(t, err)
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "mnt_id:"); ok {
				return strings.TrimSpace(v)
			}
		}
		t.Fatalf("no mnt_id in fdinfo of fd %d: %s", fd, b)
		return ""
	}
	host, err := os.Open(os.DevNull)
	must.NoError(t, err)
	defer host.Close()

	files, err := openStdio(&wire.Spec{StdoutPath: os.DevNull, StderrPath: ""})
	must.NoError(t, err)
	defer func() {
		for _, f := range files {
			_ = f.Close()
		}
	}()
	must.SliceLen(t, 3, files)
	clone := mntID(files[0].Fd())
	must.NotEq(t, mntID(host.Fd()), clone, must.Sprint("stdin is the host's /dev/null mount"))
	for i, f := range files {
		must.Eq(t, clone, mntID(f.Fd()), must.Sprintf("fd %d is on a clone of its own", i))
		var sfs unix.Statfs_t
		must.NoError(t, unix.Fstatfs(int(f.Fd()), &sfs))
		must.NonZero(t, sfs.Flags&unix.ST_RDONLY, must.Sprintf("fd %d is on a writable mount", i))
		var st unix.Stat_t
		must.NoError(t, unix.Fstat(int(f.Fd()), &st))
		must.Eq(t, uint32(unix.S_IFCHR), st.Mode&unix.S_IFMT)
	}
	n, err := files[0].Read(make([]byte, 1))
	must.Eq(t, 0, n)
	must.ErrorIs(t, err, io.EOF)
	for _, f := range files[1:] {
		_, err := f.Write([]byte("x\n"))
		must.NoError(t, err)
	}
}
