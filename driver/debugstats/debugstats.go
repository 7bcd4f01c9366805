// Package debugstats is a debugging aid: when the driver's environment
// names a file in NOMAD_DRIVER_CSI_DEBUG_STATS, the driver rewrites that
// file every second with its goroutine count and heap figures, and a
// second file beside it (FILE.goroutines) with its goroutines grouped by
// stack. When NOMAD_DRIVER_CSI_DEBUG_PROFILES is set too (to anything),
// every ProfileWindow it also writes the CPU profile of the window that
// ended (FILE.cpu.pprof) and a heap profile (FILE.heap.pprof), for go tool
// pprof, the heap sampled every HeapProfileRate bytes; the CPU profile
// costs the driver about 1 MiB and a sampling signal 100 times a second
// while it runs, the finer heap sampling some CPU and profile buckets.
// Soak tests read the files to see whether the driver leaks goroutines,
// and the many-tasks benchmark
// where its time and memory go; an operator hunting a leak can set the
// variables in the Nomad agent's environment, which Nomad passes on to its
// plugins.
//
// Nothing starts when the variable is unset (the default): no listener,
// no signal handler, no goroutine. The files are written atomically
// (temp file + rename) with mode 0600.
package debugstats

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/atomicfile"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/threads"
)

// Env is the environment variable that names the stats file.
const Env = "NOMAD_DRIVER_CSI_DEBUG_STATS"

// ProfilesEnv, set beside Env, adds the CPU and heap profiles.
const ProfilesEnv = "NOMAD_DRIVER_CSI_DEBUG_PROFILES"

// HeapProfileRate is the heap profile's sampling rate (bytes allocated per
// sample) while the profiles are on.
const HeapProfileRate = 16 << 10

// Interval is how often the files are rewritten.
const Interval = time.Second

// ProfileWindow is how long each CPU profile runs before it is written.
const ProfileWindow = 10 * time.Second

// Stats is the content of the stats file.
type Stats struct {
	PID        int       `json:"pid"`
	Time       time.Time `json:"time"`
	Goroutines int       `json:"goroutines"`
	// Threads is the runtime's live OS threads.
	Threads     int    `json:"threads"`
	HeapAlloc   uint64 `json:"heap_alloc"`
	HeapObjects uint64 `json:"heap_objects"`
	NumGC       uint32 `json:"num_gc"`
	// Memory is where the runtime's memory goes, from runtime/metrics:
	// every /memory/classes/ metric by its name below that prefix
	// ("heap/objects", "heap/free", "heap/released", "heap/stacks",
	// "os-stacks", "metadata/other", "total", ...) and the GC's heap goal
	// ("gc-heap-goal") and the size new goroutines' stacks start at
	// ("stack-start", the average stack in use at the last GC, which the
	// runtime starts goroutines with), in bytes. Released heap pages are no
	// longer in the process's RSS; free ones still are, until the
	// scavenger returns them.
	Memory map[string]uint64 `json:"memory,omitempty"`
}

// memoryPrefix is the runtime/metrics prefix Stats.Memory reports.
const memoryPrefix = "/memory/classes/"

// memoryExtra are the metrics Stats.Memory reports beside the classes, by
// the names it gives them.
var memoryExtra = map[string]string{
	"/gc/heap/goal:bytes":           "gc-heap-goal",
	"/gc/stack/starting-size:bytes": "stack-start",
}

// memorySamples are the metrics Stats.Memory reads, made once.
var memorySamples = func() []metrics.Sample {
	var s []metrics.Sample
	for _, d := range metrics.All() {
		if strings.HasPrefix(d.Name, memoryPrefix) || memoryExtra[d.Name] != "" {
			s = append(s, metrics.Sample{Name: d.Name})
		}
	}
	return s
}()

// memoryClasses reads memorySamples into a map by short name (see
// Stats.Memory).
func memoryClasses() map[string]uint64 {
	s := make([]metrics.Sample, len(memorySamples))
	copy(s, memorySamples)
	metrics.Read(s)
	out := make(map[string]uint64, len(s))
	for _, m := range s {
		if m.Value.Kind() != metrics.KindUint64 {
			continue
		}
		name := memoryExtra[m.Name]
		if name == "" {
			name = strings.TrimPrefix(strings.TrimSuffix(m.Name, ":bytes"), memoryPrefix)
		}
		out[name] = m.Value.Uint64()
	}
	return out
}

// StartFromEnv starts writing the stats file named by Env, if it is set,
// and returns a function that stops it (a no-op when nothing started).
// An invalid value (a relative path) starts nothing and is reported.
func StartFromEnv() (stop func(), err error) {
	path := os.Getenv(Env)
	if path == "" {
		return func() {}, nil
	}
	if !filepath.IsAbs(path) {
		return func() {}, fmt.Errorf("%s must be an absolute file path, got %q", Env, path)
	}
	window := time.Duration(0)
	if os.Getenv(ProfilesEnv) != "" {
		window = ProfileWindow
		// The runtime's default samples one allocation per 512 KiB: too
		// coarse for a heap of a few MiB. Set before the driver starts,
		// so that what it allocates from here on is sampled this finely.
		runtime.MemProfileRate = HeapProfileRate
	}
	return Start(path, Interval, window), nil
}

// Start writes the stats file at path now and then every interval, and
// the profiles every window (none when window is 0), until stop is called.
// The CPU profile runs only when no other is (pprof allows one at a time).
func Start(path string, interval, window time.Duration) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(interval)
		defer t.Stop()
		var windows <-chan time.Time
		var cpu bytes.Buffer
		profiling := false
		if window > 0 {
			w := time.NewTicker(window)
			defer w.Stop()
			windows = w.C
			profiling = pprof.StartCPUProfile(&cpu) == nil
		}
		defer func() {
			if profiling {
				pprof.StopCPUProfile()
			}
		}()
		for {
			_ = Write(path)
			select {
			case <-done:
				return
			case <-t.C:
			case <-windows:
				if profiling {
					pprof.StopCPUProfile()
					_ = writeAtomic(path+".cpu.pprof", cpu.Bytes())
					cpu.Reset()
					profiling = pprof.StartCPUProfile(&cpu) == nil
				}
				_ = writeHeap(path + ".heap.pprof")
			}
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}

// writeHeap writes the heap profile (in use and allocated since the start).
func writeHeap(path string) error {
	var b bytes.Buffer
	if err := pprof.Lookup("heap").WriteTo(&b, 0); err != nil {
		return err
	}
	return writeAtomic(path, b.Bytes())
}

// Write writes the stats file at path and the goroutine profile at
// path+".goroutines" once.
func Write(path string) error {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	st := Stats{
		PID:         os.Getpid(),
		Time:        time.Now().UTC(),
		Goroutines:  runtime.NumGoroutine(),
		Threads:     threads.Read().Threads,
		HeapAlloc:   ms.HeapAlloc,
		HeapObjects: ms.HeapObjects,
		NumGC:       ms.NumGC,
		Memory:      memoryClasses(),
	}
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	var prof bytes.Buffer
	if p := pprof.Lookup("goroutine"); p != nil {
		_ = p.WriteTo(&prof, 1)
	}
	if err := writeAtomic(path+".goroutines", prof.Bytes()); err != nil {
		return err
	}
	return writeAtomic(path, append(b, '\n'))
}

// Read reads a stats file.
func Read(path string) (Stats, error) {
	var st Stats
	b, err := os.ReadFile(path)
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return st, fmt.Errorf("failed to decode the debug stats file %s: %w", path, err)
	}
	return st, nil
}

func writeAtomic(path string, b []byte) error {
	if err := atomicfile.Write(path, b, 0o600, false); err != nil {
		return fmt.Errorf("failed to write the debug stats file: %w", err)
	}
	return nil
}
