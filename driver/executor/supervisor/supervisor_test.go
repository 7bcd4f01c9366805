package supervisor

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
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
