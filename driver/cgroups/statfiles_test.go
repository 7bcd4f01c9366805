package cgroups

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
)

// openUnder counts this process's descriptors open on files under any of
// dirs. The read of /proc/self/fd is checked: a count of 0 must not come
// from a failed read.
func openUnder(t *testing.T, dirs ...string) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	must.NoError(t, err)
	must.Positive(t, len(entries))
	n := 0
	for _, e := range entries {
		target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err != nil {
			continue // the directory's own descriptor, closed by now
		}
		for _, d := range dirs {
			if strings.HasPrefix(target, d+"/") {
				n++
				break
			}
		}
	}
	return n
}

// A sample opens the group's stats files once and reads them open at
// every later sample, seeing what the files hold then; Destroy closes
// them.
func TestStatFiles_HeldBetweenSamples(t *testing.T) {
	h := fakeV1(t, allV1)
	g, err := h.create("", "t", Limits{})
	must.NoError(t, err)
	dirs := g.dirs()
	must.Eq(t, 0, openUnder(t, dirs...))

	st, err := g.Stats()
	must.NoError(t, err)
	must.Eq(t, 0, st.MemoryUsage)
	// cpuacct.usage, cpuacct.stat, cpu.stat, memory.stat,
	// memory.usage_in_bytes, memory.max_usage_in_bytes.
	must.Eq(t, 6, openUnder(t, dirs...))
	// The buffer went back to the pool: none is kept per group.
	must.Nil(t, g.stats.buf)

	// Rewritten in place, as the kernel's files change under a reader.
	must.NoError(t, os.WriteFile(filepath.Join(g.paths["memory"], "memory.usage_in_bytes"), []byte("4096\n"), 0o644))
	must.NoError(t, os.WriteFile(filepath.Join(g.paths["memory"], "memory.stat"), []byte("total_rss 12\ntotal_cache 34\n"), 0o644))
	st, err = g.Stats()
	must.NoError(t, err)
	must.Eq(t, 4096, st.MemoryUsage)
	must.Eq(t, 12, st.MemoryRSS)
	must.Eq(t, 34, st.MemoryCache)
	must.Eq(t, 6, openUnder(t, dirs...))

	must.NoError(t, g.Destroy())
	must.Eq(t, 0, openUnder(t, dirs...))
}

// A file longer than the reader's first buffer is read whole.
func TestStatFiles_LongFile(t *testing.T) {
	h := fakeV2(t, "cpu memory")
	g, err := h.create("", "t", Limits{})
	must.NoError(t, err)
	t.Cleanup(func() { _ = g.Destroy() })
	var b strings.Builder
	for i := 0; b.Len() < 3*4096; i++ {
		fmt.Fprintf(&b, "padding_field_%d %d\n", i, i)
	}
	b.WriteString("anon 777\nfile 888\n")
	must.NoError(t, os.WriteFile(filepath.Join(g.paths[unifiedKey], "memory.stat"), []byte(b.String()), 0o644))
	for range 2 {
		st, err := g.Stats()
		must.NoError(t, err)
		must.Eq(t, 777, st.MemoryRSS)
		must.Eq(t, 888, st.MemoryCache)
	}
}

// Past the limit on held files, a file is opened for each read: samples
// stay right and hold nothing more.
func TestStatFiles_Limit(t *testing.T) {
	old := statBudget
	t.Cleanup(func() { statBudget = old })
	statBudget = &fileBudget{limit: 2}

	h := fakeV1(t, allV1)
	g, err := h.create("", "t", Limits{})
	must.NoError(t, err)
	t.Cleanup(func() { _ = g.Destroy() })
	dirs := g.dirs()
	for i := range 3 {
		must.NoError(t, os.WriteFile(filepath.Join(g.paths["cpuacct"], "cpuacct.usage"), []byte(fmt.Sprint(100+i)), 0o644))
		must.NoError(t, os.WriteFile(filepath.Join(g.paths["memory"], "memory.max_usage_in_bytes"), []byte(fmt.Sprint(200+i)), 0o644))
		st, err := g.Stats()
		must.NoError(t, err)
		must.Eq(t, uint64(100+i), st.CPUTotalNanos)
		must.Eq(t, uint64(200+i), st.MemoryMaxUsage)
		must.Eq(t, 2, openUnder(t, dirs...))
	}
}

// A group dropped without Destroy has its files closed once the garbage
// collector has it.
func TestStatFiles_DroppedGroup(t *testing.T) {
	h := fakeV1(t, allV1)
	g, err := h.create("", "t", Limits{})
	must.NoError(t, err)
	dirs := g.dirs()
	_, err = g.Stats()
	must.NoError(t, err)
	must.Eq(t, 6, openUnder(t, dirs...))
	g = nil
	_ = g
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		runtime.GC()
		return openUnder(t, dirs...) == 0
	}), wait.Timeout(10*time.Second), wait.Gap(20*time.Millisecond)))
}

// The kernel's files of a removed group read as ENODEV: a group whose
// directories are gone fails its sample as a missing file, as it did when
// every read opened its file, and one made again at the same path is read
// anew (root, on this host's cgroups).
func TestHost_StatsGroupGoneAndBack(t *testing.T) {
	h := needHost(t)
	needLimits(t)
	parent := uniqueParent()
	t.Cleanup(func() { removeParent(t, h, parent) })
	g, err := Create(parent, "task", Limits{MemoryBytes: 64 << 20})
	must.NoError(t, err)
	_, run := startIn(t, g, `while :; do sleep 1; done`)
	run()
	must.Wait(t, waitFor(func() bool {
		st, err := g.Stats()
		return err == nil && st.MemoryUsage > 0
	}))
	dirs := g.dirs()
	must.Positive(t, openUnder(t, dirs...))

	// Removed behind g's back, by another handle on the same group.
	other, err := Load(g.State())
	must.NoError(t, err)
	must.NoError(t, other.Kill())
	must.NoError(t, other.Destroy())
	_, err = g.Stats()
	must.Error(t, err)
	must.True(t, isNotExist(err), must.Sprintf("want a missing file, got %v", err))
	must.Eq(t, 0, openUnder(t, dirs...))

	again, err := Create(parent, "task", Limits{MemoryBytes: 64 << 20})
	must.NoError(t, err)
	t.Cleanup(func() {
		_ = again.Kill()
		_ = again.Destroy()
	})
	st, err := g.Stats()
	must.NoError(t, err)
	must.Eq(t, 0, st.MemoryUsage, must.Sprint("the new group is empty"))
	must.Positive(t, openUnder(t, dirs...))
	must.NoError(t, again.Kill())
	must.NoError(t, g.Destroy())
	must.Eq(t, 0, openUnder(t, dirs...))
}

// A sample that has the group's reader when Destroy closes it reads its
// files opened for that read alone, and holds none of them after.
func TestStatFiles_SampleAfterClose(t *testing.T) {
	h := fakeV1(t, allV1)
	g, err := h.create("", "t", Limits{})
	must.NoError(t, err)
	t.Cleanup(func() { _ = g.Destroy() })
	dirs := g.dirs()
	r := g.statReader()
	g.closeStats()
	r.mu.Lock()
	_, err = g.statsV1(r)
	r.mu.Unlock()
	must.NoError(t, err)
	must.Eq(t, 0, openUnder(t, dirs...))
}

// A sample taken while Destroy removes the group's directories (the
// driver's stats loop runs beside DestroyTask) holds nothing of the
// removed group once Destroy has returned (root, on this host's cgroups).
func TestHost_StatsDuringDestroy(t *testing.T) {
	g := hostGroup(t, Limits{MemoryBytes: 64 << 20})
	dirs := g.dirs()
	old := rmdir
	t.Cleanup(func() { rmdir = old })
	sampled := false
	rmdir = func(dir string) error {
		if !sampled {
			sampled = true
			_, err := g.Stats()
			must.NoError(t, err)
			must.Positive(t, openUnder(t, dirs...))
		}
		return old(dir)
	}
	must.NoError(t, g.Destroy())
	must.True(t, sampled)
	must.Eq(t, 0, openUnder(t, dirs...))
}

// A group's path that leads to an endless file (its state tampered with)
// fails the sample instead of growing the buffer without end.
func TestStatFiles_EndlessFile(t *testing.T) {
	g := &Group{version: 2, paths: map[string]string{unifiedKey: t.TempDir()}}
	must.NoError(t, os.Symlink("/dev/zero", filepath.Join(g.paths[unifiedKey], "cpu.stat")))
	_, err := g.Stats()
	must.ErrorContains(t, err, "cpu.stat")
	must.ErrorContains(t, err, "longer than 1048576 bytes")
	g.closeStats()
}

// The keys a sample wants are found where they begin a line and are
// followed by a space and a number, as a parse of every line finds them.
func TestParseKeyed_Wanted(t *testing.T) {
	text := "total_rss_huge 5\nxtotal_rss 3\ntotal_cache\ntotal_cache lots\ntotal_cache 11\ncache 1\ntotal_rss 7\ntotal_swap 9"
	want := []string{"total_rss", "total_cache", "total_swap", "absent"}
	got := parseKeyed(text, want...)
	must.Eq(t, map[string]uint64{"total_rss": 7, "total_cache": 11, "total_swap": 9}, got)
	all := parseKeyed(text)
	for _, k := range want {
		v, ok := all[k]
		g, gok := got[k]
		must.Eq(t, ok, gok, must.Sprint(k))
		must.Eq(t, v, g, must.Sprint(k))
	}
	must.MapEmpty(t, parseKeyed("", "anon"))
	must.Eq(t, map[string]uint64{"anon": 1}, parseKeyed("anon 1\n", "anon"))
	must.MapEmpty(t, parseKeyed("anon", "anon"))
}
