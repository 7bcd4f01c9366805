package mounter

import (
	"fmt"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// mountinfoLines is an endless mount table: lines of count mounts under
// /mnt, read as a stream (never held whole, as a task's table need not
// be), then tail.
type mountinfoLines struct {
	count, n int
	tail     string
	buf      []byte
}

func (m *mountinfoLines) Read(p []byte) (int, error) {
	if len(m.buf) == 0 {
		switch {
		case m.n < m.count:
			m.n++
			m.buf = fmt.Appendf(nil, "%d 24 0:%d / /mnt/a\\040dir\\012%d rw,relatime - tmpfs tmpfs rw\n", 100+m.n, 100+m.n, m.n)
		case m.tail != "":
			m.buf, m.tail = []byte(m.tail), ""
		default:
			return 0, io.EOF
		}
	}
	n := copy(p, m.buf)
	m.buf = m.buf[n:]
	return n, nil
}

// The mount the driver looks for in a task's mount table (its /dev/pts)
// is found as FindMount finds it in the whole table, and the table, which
// a task allowed to mount makes as long as it likes (fs.mount-max mounts,
// a path of up to 4 KiB each, four bytes a character escaped), is read no
// further than a bound: never held whole, never read for ever.
func TestFindMountIn(t *testing.T) {
	const (
		root   = "24 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
		dev    = "25 24 0:5 / /dev rw,nosuid - tmpfs tmpfs rw,mode=755\n"
		pts    = "26 25 0:24 / /dev/pts rw,nosuid,noexec - devpts devpts rw,gid=5,mode=620,ptmxmode=000\n"
		ownPts = "900 26 0:77 / /dev/pts rw,nosuid,noexec - devpts devpts rw,gid=5,mode=620,ptmxmode=666,max=128\n"
		// A directory named so that its escaped path reads like /dev/pts
		// with a line after it.
		decoy = "901 24 0:78 / /dev/pts\\012902\\04024\\0400:79 rw - tmpfs tmpfs rw\n"
	)
	for _, tc := range []struct {
		name   string
		table  string
		wantID int
	}{
		{"the host's", root + dev + pts, 26},
		{"its own stacked on the host's", root + dev + pts + ownPts, 900},
		{"a decoy named with escapes", root + dev + ownPts + decoy, 900},
		{"none: the mount it lives on", root + dev, 25},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mp, ok, err := findMountIn(strings.NewReader(tc.table), "/dev/pts", 1<<20)
			must.NoError(t, err)
			must.True(t, ok)
			must.Eq(t, tc.wantID, mp.ID)
			all, err := ParseMountInfo(strings.NewReader(tc.table))
			must.NoError(t, err)
			want, _ := FindMount(all, "/dev/pts")
			must.Eq(t, want, mp)
		})
	}

	t.Run("a long table within the bound", func(t *testing.T) {
		table := &mountinfoLines{count: 20000, tail: ownPts}
		mp, ok, err := findMountIn(io.MultiReader(strings.NewReader(root+dev+pts), table), "/dev/pts", 16<<20)
		must.NoError(t, err)
		must.True(t, ok)
		must.Eq(t, 900, mp.ID)
	})
	t.Run("a table longer than the bound", func(t *testing.T) {
		// About 120 MB of mounts before its own /dev/pts: read up to the
		// bound (1 MiB here), then refused.
		table := &mountinfoLines{count: 2_000_000, tail: ownPts}
		_, _, err := findMountIn(io.MultiReader(strings.NewReader(root+dev+pts), table), "/dev/pts", 1<<20)
		must.ErrorContains(t, err, "the mount table is longer than 1048576 bytes")
		must.Less(t, 100_000, table.n, must.Sprint("read past the bound"))
	})
	t.Run("this process's own", func(t *testing.T) {
		mp, ok, err := ProcessMountAt(os.Getpid(), "/")
		must.NoError(t, err)
		must.True(t, ok)
		must.Eq(t, "/", mp.Path)
	})
}
