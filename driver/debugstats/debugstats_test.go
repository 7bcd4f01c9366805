package debugstats

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

func TestStartFromEnv(t *testing.T) {
	cases := []struct {
		name    string
		value   string
		wantErr string
		wantRun bool
	}{
		{name: "unset starts nothing", value: ""},
		{name: "relative path refused", value: "stats.json", wantErr: "must be an absolute file path"},
		{name: "absolute path starts", value: "ABS", wantRun: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "stats.json")
			value := tc.value
			if value == "ABS" {
				value = path
			}
			t.Setenv(Env, value)
			stop, err := StartFromEnv()
			if tc.wantErr != "" {
				must.ErrorContains(t, err, tc.wantErr)
			} else {
				must.NoError(t, err)
			}
			stop()
			entries, err := os.ReadDir(dir)
			must.NoError(t, err)
			for _, e := range entries {
				must.StrNotContains(t, e.Name(), ".pprof", must.Sprintf("a profile without %s", ProfilesEnv))
			}
			if !tc.wantRun {
				must.SliceEmpty(t, entries)
				return
			}
			st, err := Read(path)
			must.NoError(t, err)
			must.Eq(t, os.Getpid(), st.PID)
			must.Positive(t, st.Goroutines)
			must.Positive(t, st.Threads)
			must.Positive(t, st.HeapAlloc)
			prof, err := os.ReadFile(path + ".goroutines")
			must.NoError(t, err)
			must.StrContains(t, string(prof), "goroutine profile: total")
		})
	}
}

// The count follows the process: goroutines started after a write show in
// the next one.
func TestWriteCountsGoroutines(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stats.json")
	must.NoError(t, Write(path))
	before, err := Read(path)
	must.NoError(t, err)

	const extra = 25
	release := make(chan struct{})
	started := make(chan struct{}, extra)
	for range extra {
		go func() {
			started <- struct{}{}
			<-release
		}()
	}
	for range extra {
		<-started
	}
	must.NoError(t, Write(path))
	during, err := Read(path)
	close(release)
	must.NoError(t, err)
	// The extra goroutines and this test's own are alive at the second
	// write (others counted before may have ended since: a bound on the
	// difference would not hold).
	must.GreaterEq(t, extra+1, during.Goroutines)
	must.Greater(t, before.Goroutines, during.Goroutines)
	prof, err := os.ReadFile(path + ".goroutines")
	must.NoError(t, err)
	must.True(t, strings.Contains(string(prof), "TestWriteCountsGoroutines"), must.Sprint("the profile names the waiting goroutines' function"))
}

// Start keeps rewriting the file until stop returns, and writes the CPU
// and heap profiles of each window; no temp file is left.
func TestStartRewrites(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "stats.json")
	stop := Start(path, 10*time.Millisecond, 50*time.Millisecond)
	first := time.Now()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := Read(path)
		_, cpuErr := os.Stat(path + ".cpu.pprof")
		_, heapErr := os.Stat(path + ".heap.pprof")
		if err == nil && st.Time.After(first) && cpuErr == nil && heapErr == nil {
			break
		}
		must.True(t, time.Now().Before(deadline), must.Sprintf("the stats file or a profile was not written: %v %v %v", err, cpuErr, heapErr))
		time.Sleep(5 * time.Millisecond)
	}
	stop()
	for _, p := range []string{path + ".cpu.pprof", path + ".heap.pprof"} {
		b, err := os.ReadFile(p)
		must.NoError(t, err)
		// A profile is gzipped protobuf.
		must.True(t, len(b) > 2 && b[0] == 0x1f && b[1] == 0x8b, must.Sprintf("%s is not a profile", p))
	}
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	must.SliceContainsAll(t, []string{"stats.json", "stats.json.goroutines", "stats.json.cpu.pprof", "stats.json.heap.pprof"}, names)
}

// The stats say where the runtime's memory goes, by class: what the heap
// holds, what it keeps free and what it gave back, the stacks, the GC's
// goal. Classes sum to the total, so nothing is left out.
func TestWriteMemoryClasses(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stats.json")
	must.NoError(t, Write(path))
	st, err := Read(path)
	must.NoError(t, err)
	for _, k := range []string{"heap/objects", "heap/free", "heap/released", "heap/stacks", "heap/unused", "total", "gc-heap-goal", "stack-start"} {
		_, ok := st.Memory[k]
		must.True(t, ok, must.Sprintf("no %q in %v", k, st.Memory))
	}
	must.Positive(t, st.Memory["heap/objects"])
	must.Positive(t, st.Memory["heap/stacks"])
	var sum uint64
	for k, v := range st.Memory {
		if k != "total" && k != "gc-heap-goal" && k != "stack-start" {
			sum += v
		}
	}
	must.Eq(t, st.Memory["total"], sum)
}
