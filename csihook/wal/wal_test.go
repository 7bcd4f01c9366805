package wal

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
)

// syncBuffer is a log output safe for concurrent writes.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// records is a caller of the log that keeps each payload as one record.
type records struct {
	mu  sync.Mutex
	got []string
}

func (r *records) add(p []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, string(p))
}

func (r *records) list() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string{}, r.got...)
}

// openTest opens the log in dir with a caller keeping payloads in r,
// closing it when the test ends.
func openTest(t *testing.T, dir string, r *records) (*Log, *syncBuffer) {
	t.Helper()
	logs := &syncBuffer{}
	l, err := Open(dir, Options{
		Logger: hclog.New(&hclog.LoggerOptions{Level: hclog.Trace, Output: logs}),
		Replay: func(p []byte, _ int) int { r.add(p); return 0 },
		Snapshot: func() ([][]byte, error) {
			var out [][]byte
			for _, s := range r.list() {
				out = append(out, []byte(s))
			}
			return out, nil
		},
	})
	must.NoError(t, err)
	t.Cleanup(l.Close)
	return l, logs
}

func appendTo(l *Log, r *records, p string) error {
	return l.Append([]byte(p), false, func() { r.add([]byte(p)) })
}

func TestLog_AppendReplayCompact(t *testing.T) {
	dir := t.TempDir()
	r := &records{}
	l, _ := openTest(t, dir, r)
	for i := range 5 {
		must.NoError(t, appendTo(l, r, fmt.Sprintf(`{"n":%d}`, i)))
	}
	must.NoError(t, l.Append([]byte(`{"n":5}`), true, func() { r.add([]byte(`{"n":5}`)) }))
	must.Eq(t, 6, l.Stats().Batches)
	want := r.list()
	l.Close()

	// Replayed in order, the lazy one too (close synced it).
	r2 := &records{}
	l2, _ := openTest(t, dir, r2)
	must.Eq(t, want, r2.list())
	// A compaction writes the snapshot as the log: the same frames.
	before, err := os.ReadFile(filepath.Join(dir, Name))
	must.NoError(t, err)
	must.NoError(t, l2.Compact())
	after, err := os.ReadFile(filepath.Join(dir, Name))
	must.NoError(t, err)
	must.Eq(t, string(bytes.TrimRight(before, "\x00")), string(bytes.TrimRight(after, "\x00")))
	must.Eq(t, 1, l2.Stats().Compactions)
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	must.Len(t, 2, entries) // .lock and the log
}

func TestLog_SecondOpenRefused(t *testing.T) {
	dir := t.TempDir()
	openTest(t, dir, &records{})
	_, err := Open(dir, Options{})
	must.ErrorContains(t, err, "is in use by another volume manager")
}

// A write that fails is cut off the file and not applied; one whose cut
// fails too leaves the log refusing every further write, and a restart
// replays what the disk holds.
func TestLog_FailedWriteRefusesFurtherWrites(t *testing.T) {
	dir := t.TempDir()
	r := &records{}
	l, logs := openTest(t, dir, r)
	must.NoError(t, appendTo(l, r, `"v1"`))
	l.mu.Lock()
	must.NoError(t, l.f.Close()) // every write and the cut now fail
	l.mu.Unlock()
	err := appendTo(l, r, `"v2"`)
	must.ErrorContains(t, err, "failed to write journal")
	err = appendTo(l, r, `"v3"`)
	must.ErrorContains(t, err, "refuses writes after a failed write")
	must.StrContains(t, logs.String(), "restart the driver")
	must.Eq(t, []string{`"v1"`}, r.list())
	l.Close()

	r2 := &records{}
	l2, _ := openTest(t, dir, r2)
	must.Eq(t, []string{`"v1"`}, r2.list())
	must.NoError(t, appendTo(l2, r2, `"v2"`))
}

func TestEncodeFrame_TooLarge(t *testing.T) {
	_, err := EncodeFrame(make([]byte, MaxFrame+1))
	must.ErrorContains(t, err, "larger than the limit")
	frame, err := EncodeFrame([]byte(`{}`))
	must.NoError(t, err)
	payload, next, ok := ReadFrame(frame, 0)
	must.True(t, ok)
	must.Eq(t, `{}`, string(payload))
	must.Eq(t, len(frame), next)
}
