package wal

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"
)

// Options are what a Log needs from its caller. The callbacks are called
// while no write is under way: Replay and Loaded within Open, before the
// Log is returned; Snapshot, Stale, Compacted (and an append's applied)
// with the Log's lock held, so that they see the log as it is on disk or
// just became. They must not call the Log.
type Options struct {
	Logger hclog.Logger
	// Replay is given, at Open, the payload of each intact frame in
	// order, with the frame's offset, and returns how many of the
	// payload's records it could not use: those count as damage.
	Replay func(payload []byte, off int) (bad int)
	// Loaded is called at Open after Replay, before any compaction can
	// run; cleanup asks for a compaction soon (see Log.cleanup), an error
	// fails Open.
	Loaded func() (cleanup bool, err error)
	// Snapshot returns the payloads of the frames a compaction writes as
	// the new log: the caller's live records.
	Snapshot func() ([][]byte, error)
	// Stale reports, after each write, whether the log holds what the
	// caller wants a compaction to remove soon (secrets no record needs).
	Stale func() bool
	// Compacted is called once a compaction's new log is durable.
	Compacted func()
	// CompactMin is the log size below which it is never compacted;
	// DefaultCompactMin when 0.
	CompactMin int64
	// CompactDelay is how long the log may keep what a cleanup
	// compaction removes after the write that made it so; writes
	// meanwhile share the one compaction.
	CompactDelay time.Duration
	// LazySyncDelay is how long a lazy append may stay unsynced when no
	// other append syncs it first.
	LazySyncDelay time.Duration
	// CreateTemp makes a compaction's new log; os.CreateTemp when nil.
	CreateTemp func(dir, pattern string) (*os.File, error)
}

// maxCompactBackoff caps the wait before a failed cleanup compaction is
// tried again (on a full disk, say).
const maxCompactBackoff = time.Minute

// keepBadCopies is how many copies of a damaged log (*.bad) are kept, the
// newest; they may hold secrets, so older ones are removed.
const keepBadCopies = 3

// Log is the log of one directory. A lock file (.lock) keeps a second
// process off the same directory. Its methods are safe for concurrent
// use; appends that arrive while one is being written go out together in
// the next write and fdatasync.
type Log struct {
	dir    string
	opts   Options
	logger hclog.Logger
	lock   *os.File

	mu sync.Mutex
	// f is the log, nil once closed; size is the log's length (durable
	// but for lazy appends, see unsynced), and alloc the file's, zeros
	// after size. The log is compacted once it grows past limit.
	f          *os.File
	size       int64
	alloc      int64
	limit      int64
	compactMin int64
	// queue holds the appends waiting for the one being written, while
	// writing is set.
	queue   []*pending
	writing bool
	// broken is set when a write may have reached the disk in part and
	// could not be cut off again: nothing more is written.
	broken error
	// unsynced is set while lazy appends are written but not yet synced;
	// flushing is set while a sync of them is scheduled.
	unsynced, flushing bool
	// batches and syncs count written batches and fdatasyncs, for tests.
	batches, syncs int

	// cleanup is set while the log holds what only a compaction removes:
	// damaged bytes, the rest of a torn batch that could not be cut off,
	// or what the caller asks to be removed (Options.Loaded and Stale).
	// A compaction is then scheduled (compactArmed) within CompactDelay;
	// one that fails leaves the log as it is, in use, and is tried again
	// after compactBackoff.
	cleanup        bool
	compactArmed   bool
	compactBackoff time.Duration
	// badCopy is set while a damaged log waits for its copy (*.bad): no
	// compaction drops the damaged bytes before it is made.
	badCopy bool
	// compactions counts compactions, for tests.
	compactions int
}

type pending struct {
	frame   []byte
	applied func()
	// lazy appends need not be durable before they return (see Append).
	lazy bool
	done chan error
}

// LockName is the lock file of a journal directory: whoever holds an
// exclusive flock on it owns the journal (a driver through Open, the
// operator CLI while it acts).
const LockName = ".lock"

// Lock makes dir (0700) when missing and takes its lock without waiting.
// When another holds it, the error wraps unix.EWOULDBLOCK. Closing the
// file releases the lock.
func Lock(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create journal directory %q: %w", dir, err)
	}
	f, err := os.OpenFile(filepath.Join(dir, LockName), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("failed to open journal lock in %q: %w", dir, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("journal directory %q is in use by another volume manager: %w", dir, err)
	}
	return f, nil
}

// Open creates dir if need be, locks it, and replays its log through
// opts.Replay, without writing anything that needs free space: a full
// disk must not keep the log from opening. Leftover temp files are
// removed. A torn tail is dropped with a warning and cut off (truncating
// needs no space). Damage before the tail (bytes that are no frames, or
// records Replay could not use) is skipped with an error, and a copy of
// the log as it was is kept beside it (*.bad, mode 0600, the newest
// keepBadCopies), since what the lost records describe can no longer be
// undone automatically; when the copy cannot be made, the log is left as
// it is until it can. What the log holds that only a compaction removes
// is compacted away soon after, and a compaction that fails leaves the
// log in use as it is.
func Open(dir string, opts Options) (*Log, error) {
	if opts.Logger == nil {
		opts.Logger = hclog.NewNullLogger()
	}
	if opts.CompactMin == 0 {
		opts.CompactMin = DefaultCompactMin
	}
	if opts.CreateTemp == nil {
		opts.CreateTemp = os.CreateTemp
	}
	f, err := Lock(dir)
	if err != nil {
		return nil, err
	}
	l := &Log{dir: dir, opts: opts, logger: opts.Logger, lock: f, compactMin: opts.CompactMin}
	if err := l.load(); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// Close syncs what lazy appends left unsynced, closes the log and
// releases the directory. Appends after it fail.
func (l *Log) Close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.syncLazyLocked()
	if l.f != nil {
		l.f.Close()
		l.f = nil
	}
	if l.lock != nil {
		l.lock.Close()
		l.lock = nil
	}
}

// Path is the log file's path.
func (l *Log) Path() string { return filepath.Join(l.dir, Name) }

func (l *Log) load() error {
	entries, err := os.ReadDir(l.dir)
	if err != nil {
		return fmt.Errorf("failed to read journal directory %q: %w", l.dir, err)
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".tmp-") {
			os.Remove(filepath.Join(l.dir, e.Name()))
		}
	}
	path := l.Path()
	data, err := os.ReadFile(path)
	created := errors.Is(err, fs.ErrNotExist)
	if err != nil && !created {
		return fmt.Errorf("failed to read journal %q: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("failed to open journal %q: %w", path, err)
	}
	l.f = f
	if created {
		// The first append's fdatasync does not make the new name durable.
		if err := SyncDir(l.dir); err != nil {
			return err
		}
	}
	badOps := 0
	scan := ScanFrames(data, func(payload []byte, off int) {
		if l.opts.Replay != nil {
			badOps += l.opts.Replay(payload, off)
		}
	})
	l.size, l.alloc = int64(scan.End), int64(len(data))
	if scan.Torn > 0 {
		l.logger.Warn("journal ends in a partly written batch, as after a crash during a write; dropped it",
			"path", path, "offset", scan.End, "bytes", scan.Torn)
		if err := f.Truncate(l.size); err != nil {
			// Appends overwrite it; until then the next start drops it again.
			l.logger.Warn("cannot cut the partly written batch off the journal; later commits overwrite it",
				"path", path, "error", err)
			l.cleanup = true
		} else {
			l.alloc = l.size
		}
	}
	if scan.Damaged > 0 || badOps > 0 {
		l.cleanup, l.badCopy = true, true
		copyPath, err := l.keepBadCopy(data)
		if err != nil {
			l.logger.Error("journal is damaged: records in the damaged parts are lost, what they describe must be cleaned up by hand; no copy of it could be kept yet, so it is left as it is",
				"path", path, "damaged_bytes", scan.Damaged, "unusable_records", badOps, "error", err)
		} else {
			l.logger.Error("journal is damaged: records in the damaged parts are lost, what they describe must be cleaned up by hand; a copy of it as it was is kept (mode 0600, it holds secrets)",
				"path", path, "copy", copyPath, "damaged_bytes", scan.Damaged, "unusable_records", badOps)
		}
	}
	if l.opts.Loaded != nil {
		cleanup, err := l.opts.Loaded()
		if err != nil {
			return err
		}
		l.cleanup = l.cleanup || cleanup
	}
	// Compacted once it grows past compactMin; the first compaction sets
	// the limit from the live records.
	l.limit = l.compactMin
	if l.cleanup {
		l.mu.Lock()
		l.scheduleCompactLocked(0)
		l.mu.Unlock()
	}
	return nil
}

// keepBadCopy keeps a copy of a damaged log, data, beside it
// (journal.log.<time>.bad, mode 0600), removes all but the newest
// keepBadCopies copies, and returns the copy's path.
func (l *Log) keepBadCopy(data []byte) (string, error) {
	path := l.Path()
	bad := path + "." + time.Now().UTC().Format("20060102T150405.000000000Z") + ".bad"
	if err := writeFileSync(bad, bytes.TrimRight(data, "\x00")); err != nil {
		os.Remove(bad)
		return "", fmt.Errorf("failed to keep a copy of damaged journal %q: %w", path, err)
	}
	l.badCopy = false
	copies, err := filepath.Glob(path + ".*.bad")
	if err != nil || len(copies) <= keepBadCopies {
		return bad, nil
	}
	// The time in the name sorts as it reads.
	sort.Strings(copies)
	old := copies[:len(copies)-keepBadCopies]
	for _, c := range old {
		if err := os.Remove(c); err != nil && !errors.Is(err, fs.ErrNotExist) {
			l.logger.Warn("cannot remove an old copy of a damaged journal", "copy", c, "error", err)
		}
	}
	l.logger.Info("removed old copies of a damaged journal; the newest are kept", "removed", old,
		"kept", copies[len(copies)-keepBadCopies:])
	return bad, nil
}

// Append writes payload as one frame and returns once it is durable:
// replayed after a crash, it is there entirely or not at all. Once it is
// written, applied (if not nil) is called, in the order of the writes.
//
// With lazy, Append does not wait for the disk: the frame is written (so
// it survives the process, not a crash of the host) and synced with the
// next durable append or within Options.LazySyncDelay.
func (l *Log) Append(payload []byte, lazy bool, applied func()) error {
	frame, err := EncodeFrame(payload)
	if err != nil {
		return err
	}
	c := &pending{frame: frame, applied: applied, lazy: lazy, done: make(chan error, 1)}
	l.mu.Lock()
	if err := l.usableLocked(); err != nil {
		l.mu.Unlock()
		return err
	}
	l.queue = append(l.queue, c)
	if !l.writing {
		l.writing = true
		l.writeQueueLocked()
		l.writing = false
	}
	l.mu.Unlock()
	return <-c.done
}

func (l *Log) usableLocked() error {
	switch {
	case l.f == nil:
		return fmt.Errorf("journal %q is closed", l.Path())
	case l.broken != nil:
		return l.broken
	}
	return nil
}

// writeQueueLocked writes the queued appends, each round in one write and
// one fdatasync, until no append is waiting. l.mu is held on entry and
// exit and released while writing, so appends arriving meanwhile queue up
// for the next round.
func (l *Log) writeQueueLocked() {
	for len(l.queue) > 0 {
		q := l.queue
		l.queue = nil
		err := l.usableLocked()
		if err == nil {
			var buf []byte
			sync := false
			for _, c := range q {
				buf = append(buf, c.frame...)
				sync = sync || !c.lazy
			}
			n, f, off := int64(len(buf)), l.f, l.size
			if grow := off + n - l.alloc; grow > 0 {
				// Past the zeros: grow the file by whole steps of
				// zeros in the same write.
				buf = append(buf, make([]byte, roundUp(grow, preallocate)-grow)...)
			}
			l.mu.Unlock()
			err = writeLog(f, off, buf, sync)
			l.mu.Lock()
			if err == nil {
				l.size += n
				l.alloc = max(l.alloc, off+int64(len(buf)))
				l.batches += len(q)
				for _, c := range q {
					if c.applied != nil {
						c.applied()
					}
				}
				if sync {
					// fdatasync covers the lazy writes before it too.
					l.syncs++
					l.unsynced = false
				} else {
					l.unsynced = true
					l.scheduleSyncLocked()
				}
			} else {
				l.failedLocked(f, off, err)
			}
		}
		for _, c := range q {
			c.done <- err
		}
		if err == nil && l.size > l.limit {
			if err := l.compactLocked(); err != nil {
				l.limit = 2 * l.size
				l.logger.Warn("failed to compact the journal; it goes on growing", "path", l.Path(), "error", err)
			}
		}
		if err == nil && l.opts.Stale != nil && l.opts.Stale() {
			// The log holds what the caller wants gone soon.
			l.cleanup = true
			l.scheduleCompactLocked(l.opts.CompactDelay)
		}
	}
}

type syncError struct{ err error }

func (e *syncError) Error() string { return e.err.Error() }
func (e *syncError) Unwrap() error { return e.err }

func roundUp(n, step int64) int64 { return (n + step - 1) / step * step }

// writeLog writes buf at off, and with sync makes it (and every write
// before it) durable.
func writeLog(f *os.File, off int64, buf []byte, sync bool) error {
	if _, err := f.WriteAt(buf, off); err != nil {
		return fmt.Errorf("failed to write journal %q: %w", f.Name(), err)
	}
	if !sync {
		return nil
	}
	if err := Fdatasync(f); err != nil {
		return &syncError{fmt.Errorf("failed to sync journal %q: %w", f.Name(), err)}
	}
	return nil
}

// scheduleSyncLocked makes sure unsynced lazy appends are synced within
// LazySyncDelay, if no append syncs them first.
func (l *Log) scheduleSyncLocked() {
	if l.flushing {
		return
	}
	l.flushing = true
	time.AfterFunc(l.opts.LazySyncDelay, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.flushing = false
		l.syncLazyLocked()
	})
}

// syncLazyLocked syncs the lazy appends written so far, unless a write is
// under way (whose writer then syncs or schedules again). A failed sync
// leaves nothing known of what reached the disk: the log refuses writes
// from then on.
func (l *Log) syncLazyLocked() {
	if !l.unsynced || l.writing || l.usableLocked() != nil {
		return
	}
	f := l.f
	l.writing = true
	l.mu.Unlock()
	err := Fdatasync(f)
	l.mu.Lock()
	l.writing = false
	if err != nil {
		l.failedLocked(f, l.size, &syncError{fmt.Errorf("failed to sync journal %q: %w", f.Name(), err)})
	} else {
		l.syncs++
		l.unsynced = false
	}
	// Appends that came meanwhile waited for this sync to end.
	if len(l.queue) > 0 {
		l.writing = true
		l.writeQueueLocked()
		l.writing = false
	}
}

// Fdatasync makes f's data durable.
func Fdatasync(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.Fdatasync(int(fd)) }); err != nil {
		return err
	}
	return serr
}

// failedLocked deals with a failed write. The file is cut at the end of the
// log, so that no part of the batch is left for a later batch to follow
// (the zeros come back with the next write). After a failed fdatasync
// nothing is known of what reached the disk, nor after a cut that failed:
// the log then refuses every further write, and a restart replays what
// the disk holds.
func (l *Log) failedLocked(f *os.File, off int64, err error) {
	var se *syncError
	if !errors.As(err, &se) {
		if terr := f.Truncate(off); terr == nil {
			l.alloc = off
			return
		}
	}
	l.broken = fmt.Errorf("journal %q refuses writes after a failed write (restart the driver to replay it): %w", l.Path(), err)
	l.logger.Error("journal refuses writes after a failed write; restart the driver", "path", l.Path(), "error", err)
}

// Compact writes the caller's snapshot (Options.Snapshot) as the new log
// now. The log compacts itself as it grows and when it holds what only a
// compaction removes; this is for tests and tools.
func (l *Log) Compact() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.usableLocked(); err != nil {
		return err
	}
	if l.writing {
		return fmt.Errorf("journal %q is being written; compact it later", l.Path())
	}
	l.writing = true
	defer func() { l.writing = false }()
	return l.compactLocked()
}

// compactLocked writes the snapshot to a new log and renames it over the
// old one: temp file, fsync, rename, fsync of the directory. A crash
// leaves the old log or the new one, and so does a failure before the
// rename (a full disk, say): the old log stays in use as it was. A
// damaged log is copied first (see load). The caller holds l.mu and has
// set l.writing, or has the log to itself.
func (l *Log) compactLocked() error {
	path := l.Path()
	if l.badCopy {
		data, err := os.ReadFile(path)
		bad := ""
		if err == nil {
			bad, err = l.keepBadCopy(data)
		}
		if err != nil {
			return fmt.Errorf("failed to compact journal %q: %w", path, err)
		}
		l.logger.Error("kept a copy of the damaged journal before compacting it", "path", path, "copy", bad)
	}
	var buf []byte
	if l.opts.Snapshot != nil {
		payloads, err := l.opts.Snapshot()
		if err != nil {
			return fmt.Errorf("failed to compact journal %q: %w", path, err)
		}
		for _, p := range payloads {
			if len(p) > MaxFrame {
				return fmt.Errorf("failed to compact journal %q: batch of %d bytes is larger than the limit of %d", path, len(p), MaxFrame)
			}
			buf = AppendFrame(buf, p)
		}
	}
	size := int64(len(buf))
	buf = append(buf, make([]byte, roundUp(size+1, preallocate)-size)...)
	f, err := l.opts.CreateTemp(l.dir, ".tmp-")
	if err != nil {
		return fmt.Errorf("failed to compact journal %q: %w", path, err)
	}
	tmp := f.Name()
	err = f.Chmod(0o600)
	if err == nil {
		_, err = f.Write(buf)
	}
	if err == nil {
		err = f.Sync()
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("failed to compact journal %q: %w", path, err)
	}
	// From the rename on, the new file is the log, whatever happens next.
	if l.f != nil {
		l.f.Close()
	}
	l.f, l.size, l.alloc = f, size, int64(len(buf))
	l.limit = max(l.compactMin, 2*l.size)
	// The new file is synced: lazy appends before it are durable.
	l.unsynced = false
	l.compactions++
	if err := SyncDir(l.dir); err != nil {
		l.broken = fmt.Errorf("journal %q refuses writes after a failed compaction (restart the driver to replay it): %w", path, err)
		return err
	}
	l.cleanup = false
	if l.opts.Compacted != nil {
		l.opts.Compacted()
	}
	return nil
}

// scheduleCompactLocked runs a cleanup compaction (see Log.cleanup) after
// delay, unless one is scheduled already.
func (l *Log) scheduleCompactLocked(delay time.Duration) {
	if l.compactArmed {
		return
	}
	l.compactArmed = true
	time.AfterFunc(delay, l.compactForCleanup)
}

func (l *Log) compactForCleanup() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.compactArmed = false
	if !l.cleanup || l.usableLocked() != nil {
		return
	}
	if l.writing {
		l.scheduleCompactLocked(max(l.opts.CompactDelay, 10*time.Millisecond))
		return
	}
	l.writing = true
	err := l.compactLocked()
	l.writing = false
	if err != nil {
		l.compactBackoff = min(max(2*l.compactBackoff, time.Second), maxCompactBackoff)
		l.logger.Warn("failed to compact the journal; the log stays in use as it is, compacting is tried again later",
			"path", l.Path(), "retry_in", l.compactBackoff, "error", err)
		if l.usableLocked() == nil {
			l.scheduleCompactLocked(l.compactBackoff)
		}
	} else {
		l.compactBackoff = 0
	}
	// Appends that came meanwhile waited for the compaction to end.
	if len(l.queue) > 0 {
		l.writing = true
		l.writeQueueLocked()
		l.writing = false
	}
}

// Stats are a Log's counters and sizes, for tests and tools.
type Stats struct {
	// Size is the log's length in bytes; Limit the size past which the
	// next write compacts it.
	Size, Limit int64
	// Batches and Syncs count written batches and fdatasyncs,
	// Compactions the compactions, since Open.
	Batches, Syncs, Compactions int
	// Unsynced is set while lazy appends are written but not synced.
	Unsynced bool
	// CleanupPending is set while the log holds what only a compaction
	// removes, or one is scheduled.
	CleanupPending bool
}

// Stats returns the log's counters and sizes.
func (l *Log) Stats() Stats {
	l.mu.Lock()
	defer l.mu.Unlock()
	return Stats{Size: l.size, Limit: l.limit, Batches: l.batches, Syncs: l.syncs, Compactions: l.compactions,
		Unsynced: l.unsynced, CleanupPending: l.cleanup || l.compactArmed}
}

// SetLimits sets the size below which the log is never compacted and the
// size past which the next write compacts it (tests use a small one, or
// 0 for "at once").
func (l *Log) SetLimits(compactMin, limit int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.compactMin, l.limit = compactMin, limit
}

// SyncDir makes dir's entries durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("failed to sync journal directory %q: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("failed to sync journal directory %q: %w", dir, err)
	}
	return nil
}

// writeFileSync creates path (mode 0600) holding data, durably.
func writeFileSync(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = SyncDir(filepath.Dir(path))
	}
	return err
}
