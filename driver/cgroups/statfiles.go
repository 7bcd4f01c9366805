package cgroups

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// statFiles reads a group's stats files, and keeps them open between
// samples. The driver reads every task's group at each of Nomad's stats
// intervals (one a second by default): opening a cgroup file (a path walk
// through kernfs, a file and its seq_file made and freed) costs seven or
// eight times what reading an open one does. On this project's test hosts
// (cgroup v1, 2 CPUs) a v1 sample of six files took about 115 µs with a
// file opened for each read and about 20 µs with them held.
//
// A removed group's open files read as ENODEV: when a held file fails, the
// group's held files are all closed and the path opened again, so that a
// sample of a group that is gone fails as it did when every read opened
// its file (the file does not exist) and holds nothing of it, and a group
// made again under the same path is read anew.
//
// The files held by all groups together stay within a quarter of the
// process's limit on open files (heldFiles); past it a file is opened for
// each read, as before. Destroy closes a group's files, and a group that
// is dropped without Destroy has them closed once it is collected.
type statFiles struct {
	mu  sync.Mutex
	fds map[string]int
	// buf is lent from statBufs for one sample (lend).
	buf []byte
	// closed is set by close: nothing is held after it.
	closed bool
	// budget counts the files held, and takes each back when closed:
	// heldFiles, or a test's own.
	budget *fileBudget
}

// fileBudget counts held stats files against a limit.
type fileBudget struct {
	once sync.Once
	// limit is found on first use when 0 (heldLimit); below 0, no file
	// is held.
	limit int64
	n     atomic.Int64
}

// heldFiles counts the stats files held open by every group of the
// process.
var heldFiles fileBudget

// statBudget is what a group's reader counts its files against when it is
// made. Tests give their own, so that the files other groups let go (a
// collected group's, at any time) leave their counts alone.
var statBudget = &heldFiles

// heldLimit is the budget's limit; unset, a quarter of the soft limit on
// open files (the Go runtime raises it to the hard limit at start), so
// that the driver's other files, its sockets and its plugins' connections
// keep the rest.
func (b *fileBudget) heldLimit() int64 {
	b.once.Do(func() {
		if b.limit != 0 {
			return
		}
		var rl unix.Rlimit
		if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil || rl.Cur == unix.RLIM_INFINITY {
			b.limit = 1024
			return
		}
		b.limit = int64(rl.Cur / 4)
	})
	return b.limit
}

func (b *fileBudget) reserve() bool {
	limit := b.heldLimit()
	for {
		n := b.n.Load()
		if n >= limit {
			return false
		}
		if b.n.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// statReader returns the group's reader, made on first use. A group
// dropped without Destroy has its files closed once it is collected.
func (g *Group) statReader() *statFiles {
	g.statsMu.Lock()
	defer g.statsMu.Unlock()
	if g.stats == nil {
		s := &statFiles{fds: map[string]int{}, budget: statBudget}
		g.stats = s
		runtime.AddCleanup(g, func(s *statFiles) { s.close() }, s)
	}
	return g.stats
}

// closeStats closes the files the group holds; a later sample opens them
// again.
func (g *Group) closeStats() {
	g.statsMu.Lock()
	s := g.stats
	g.stats = nil
	g.statsMu.Unlock()
	if s != nil {
		s.close()
	}
}

func (s *statFiles) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	s.dropAll()
}

func (s *statFiles) dropAll() {
	for path, fd := range s.fds {
		s.drop(path, fd)
	}
}

func (s *statFiles) drop(path string, fd int) {
	_ = unix.Close(fd)
	delete(s.fds, path)
	s.budget.n.Add(-1)
}

// statBufs are the buffers samples read into, one per sample under way
// rather than one per group: 4 KiB per group was 2 MiB of the driver's
// heap at 500 tasks.
var statBufs = sync.Pool{New: func() any { b := make([]byte, 4096); return &b }}

// lend gives s a buffer for one sample, and returns what takes it back. A
// buffer grown past 64 KiB is not kept. s.mu is held.
func (s *statFiles) lend() (giveBack func()) {
	bp := statBufs.Get().(*[]byte)
	s.buf = *bp
	return func() {
		if cap(s.buf) <= 64<<10 {
			*bp = s.buf
			statBufs.Put(bp)
		}
		s.buf = nil
	}
}

// read returns the whole content of path, in s's buffer: valid until the
// next read. s.mu is held.
func (s *statFiles) read(path string) ([]byte, error) {
	if fd, ok := s.fds[path]; ok {
		b, err := s.readAt(fd)
		if err == nil {
			return b, nil
		}
		s.dropAll()
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to read %s: %w", path, &os.PathError{Op: "open", Path: path, Err: err})
	}
	b, err := s.readAt(fd)
	if err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("failed to read %s: %w", path, &os.PathError{Op: "read", Path: path, Err: err})
	}
	if !s.closed && s.budget.reserve() {
		s.fds[path] = fd
	} else {
		_ = unix.Close(fd)
	}
	return b, nil
}

// maxStatFile bounds what readAt reads: the group's paths come from its
// state (a supervisor's report, Nomad's handle), and a path that is not a
// cgroup file, such as /dev/zero, must not grow the buffer without end.
const maxStatFile = 1 << 20

// readAt reads fd from its start to its end into s.buf. A cgroup file is
// made whole by the read at offset 0, so a read that leaves room in the
// buffer had all of it; one that fills the buffer is followed by another,
// into a larger one.
func (s *statFiles) readAt(fd int) ([]byte, error) {
	if s.buf == nil {
		s.buf = make([]byte, 4096)
	}
	n := 0
	for {
		if n == len(s.buf) {
			if n >= maxStatFile {
				return nil, fmt.Errorf("longer than %d bytes, which no cgroup stats file is", maxStatFile)
			}
			s.buf = append(s.buf, make([]byte, len(s.buf))...)
		}
		m, err := unix.Pread(fd, s.buf[n:], int64(n))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, err
		}
		n += m
		if m == 0 || n < len(s.buf) {
			return s.buf[:n], nil
		}
	}
}

// uint reads a file holding one unsigned number; "max" reads as the
// largest value.
func (s *statFiles) uint(path string) (uint64, error) {
	b, err := s.read(path)
	if err != nil {
		return 0, err
	}
	v := strings.TrimSpace(string(b))
	if v == "max" {
		return ^uint64(0), nil
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("failed to parse %q in %s: %w", v, path, err)
	}
	return n, nil
}

// keyed reads the keys want of a flat keyed file (as readKeyed): a
// sample uses a few of memory.stat's forty or more, and a map of them all
// was a fifth of the sampler's CPU at 500 tasks.
func (s *statFiles) keyed(path string, want ...string) (map[string]uint64, error) {
	b, err := s.read(path)
	if err != nil {
		return nil, err
	}
	return parseKeyed(string(b), want...), nil
}

// parseKeyed parses "key value" lines, of the keys want (every key when
// none is given); lines that are not a key and an unsigned number are
// skipped.
func parseKeyed(text string, want ...string) map[string]uint64 {
	out := make(map[string]uint64, len(want))
	for line := range strings.Lines(text) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), " ")
		if !ok || len(want) > 0 && !slices.Contains(want, k) {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		if err != nil {
			continue
		}
		out[k] = n
	}
	return out
}
