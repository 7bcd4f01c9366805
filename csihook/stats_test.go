package csihook

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// statsPlugin is fullPlugin with GET_VOLUME_STATS and VOLUME_CONDITION.
func statsPlugin(id string) PluginInfo {
	p := fullPlugin(id)
	p.VolumeStats, p.VolumeCondition = true, true
	return p
}

// putPublished records n published volumes of plugin "p" (one task each)
// without calling the plugin: the stats loop only reads the records.
func putPublished(h *harness, n int) {
	h.t.Helper()
	var ops []journalOp
	for i := range n {
		id := fmt.Sprintf("vol-%04d", i)
		task := fmt.Sprintf("task-%04d", i)
		ops = append(ops,
			journalOp{Op: opPutVol, Vol: &volRecord{PluginID: "p", VolumeID: id, StagingPath: "/stage/" + id, Stage: phaseStaged}},
			journalOp{Op: opPutTask, Task: &taskRecord{TaskID: task, Name: "data", PluginID: "p", VolumeID: id,
				Target: "/publish/" + task + "/data", State: phasePublished}})
	}
	applyInMemory(h.m, ops)
}

// applyInMemory puts ops into the manager's records without journalling
// them.
func applyInMemory(m *Manager, ops []journalOp) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.journal.state.apply(ops...)
}

// statsPassWait is statsPass and a wait for its samples to end.
func statsPassWait(m *Manager, ctx context.Context, now time.Time) time.Time {
	next := m.statsPass(ctx, now)
	m.stats.wg.Wait()
	return next
}

// callsByVolume counts the NodeGetVolumeStats calls per volume id.
func callsByVolume(f *FakeClient) map[string]int {
	out := map[string]int{}
	for _, c := range f.Calls() {
		if c.Method == MethodNodeGetVolumeStats {
			out[c.VolumeID]++
		}
	}
	return out
}

// TestStatsStaggered checks that the volumes of one interval are spread
// over it: passes one second apart through a minute each sample a few
// volumes, and by the end of the minute each volume was sampled once.
func TestStatsStaggered(t *testing.T) {
	const n = 100
	h := newHarness(t)
	h.setPlugin(statsPlugin("p"))
	putPublished(h, n)
	h.m.stats = newStatsLoop(time.Minute)
	ctx := context.Background()
	t0 := time.Now()
	most := 0
	for i := range 60 {
		before := h.fake.Count(MethodNodeGetVolumeStats)
		next := statsPassWait(h.m, ctx, t0.Add(time.Duration(i)*time.Second))
		must.True(t, next.After(t0.Add(time.Duration(i)*time.Second)))
		most = max(most, h.fake.Count(MethodNodeGetVolumeStats)-before)
	}
	statsPassWait(h.m, ctx, t0.Add(time.Minute-time.Nanosecond))
	// 100 volumes over 60 passes: under 2 a pass on average.
	must.Less(t, 10, most, must.Sprintf("one pass sampled %d of %d volumes", most, n))
	per := callsByVolume(h.fake)
	must.MapLen(t, n, per)
	for id, c := range per {
		must.Eq(t, 1, c, must.Sprintf("volume %s", id))
	}
	// The next interval keeps each volume's place: once more each.
	for i := range 60 {
		statsPassWait(h.m, ctx, t0.Add(time.Minute+time.Duration(i)*time.Second))
	}
	statsPassWait(h.m, ctx, t0.Add(2*time.Minute-time.Nanosecond))
	for id, c := range callsByVolume(h.fake) {
		must.Eq(t, 2, c, must.Sprintf("volume %s", id))
	}
	stats := h.m.VolumeStats()
	must.SliceLen(t, n, stats)
	must.Eq(t, int64(1<<10), stats[0].Bytes.Used)
	must.Eq(t, int64(990), stats[0].Inodes.Available)
	must.Eq(t, []string{"task-0000"}, stats[0].Tasks)
}

// TestStatsCondition walks a volume's condition from normal to abnormal
// and back: one event each way on the task, none repeated, and the
// plugin's message cleaned of terminal escapes and secrets.
// statsSetup is a harness with task-a's volume vol1 of a stats plugin set
// up, and a function that runs one stats pass a minute after the last.
func statsSetup(t *testing.T) (*harness, func()) {
	t.Helper()
	h := newHarness(t)
	h.setPlugin(statsPlugin("p"))
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.m.stats = newStatsLoop(time.Minute)
	later := time.Now().Add(time.Hour)
	return h, func() {
		later = later.Add(time.Minute)
		statsPassWait(h.m, ctx, later)
	}
}

func TestStatsCondition(t *testing.T) {
	h, pass := statsSetup(t)
	conditionEvents := func() []string {
		var out []string
		for _, e := range h.eventMsgs() {
			if strings.Contains(e, "abnormal") || strings.Contains(e, "normal again") {
				out = append(out, e)
			}
		}
		return out
	}

	pass() // finds the volume
	pass()
	must.SliceEmpty(t, conditionEvents())
	st := h.m.VolumeStats()
	must.SliceLen(t, 1, st)
	must.True(t, st[0].HasCondition)
	must.False(t, st[0].Abnormal)

	h.fake.SetCondition("vol1", true, "disk \x1b[31mon fire\x1b[0m\nsecret "+canary)
	pass()
	pass()
	ev := conditionEvents()
	must.SliceLen(t, 1, ev)
	must.StrContains(t, ev[0], "Volume data (volume_id vol1) is abnormal: disk \\x1b[31mon fire")
	must.StrNotContains(t, ev[0], "\x1b")
	must.StrNotContains(t, ev[0], "\n")
	must.StrNotContains(t, ev[0], canary)
	must.True(t, h.m.VolumeStats()[0].Abnormal)

	h.fake.SetCondition("vol1", false, "healed")
	pass()
	pass()
	ev = conditionEvents()
	must.SliceLen(t, 2, ev)
	must.Eq(t, "Volume data (volume_id vol1) is normal again: healed", ev[1])
	must.False(t, h.m.VolumeStats()[0].Abnormal)
}

// TestStatsCapabilities checks that a plugin is only asked when it has
// GET_VOLUME_STATS, that a condition is only acted on with
// VOLUME_CONDITION, and that an unhealthy plugin is not asked.
func TestStatsCapabilities(t *testing.T) {
	for _, tc := range []struct {
		name      string
		stats     bool
		condition bool
		healthy   bool
		calls     int
		events    int
	}{
		{"no stats", false, false, true, 0, 0},
		{"no stats but condition", false, true, true, 0, 0},
		{"stats without condition", true, false, true, 1, 0},
		{"stats and condition", true, true, true, 1, 1},
		{"unhealthy", true, true, false, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
			must.NoError(t, err)
			p := fullPlugin("p")
			p.VolumeStats, p.VolumeCondition, p.Healthy = tc.stats, tc.condition, tc.healthy
			h.setPlugin(p)
			h.fake.SetCondition("vol1", true, "broken")
			h.m.stats = newStatsLoop(time.Minute)
			// The first pass finds the volume, the next samples it.
			statsPassWait(h.m, context.Background(), time.Now())
			statsPassWait(h.m, context.Background(), time.Now().Add(time.Minute))
			must.Eq(t, tc.calls, h.fake.Count(MethodNodeGetVolumeStats))
			n := 0
			for _, e := range h.eventMsgs() {
				if strings.Contains(e, "abnormal") {
					n++
				}
			}
			must.Eq(t, tc.events, n)
		})
	}
}

// TestStatsStopOnUnpublish checks that a volume torn down is forgotten
// and never asked again, and that a failed call keeps the last numbers
// and records the error.
func TestStatsStopOnUnpublish(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(statsPlugin("p"))
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.m.stats = newStatsLoop(time.Minute)
	later := time.Now()
	statsPassWait(h.m, ctx, later) // finds it, due within the minute
	must.Eq(t, 0, h.fake.Count(MethodNodeGetVolumeStats))
	later = later.Add(time.Minute)
	statsPassWait(h.m, ctx, later)
	must.Eq(t, 1, h.fake.Count(MethodNodeGetVolumeStats))

	h.fake.SetNextError(MethodNodeGetVolumeStats, status.Error(codes.Internal, "statfs \x07failed"))
	statsPassWait(h.m, ctx, later.Add(time.Minute))
	st := h.m.VolumeStats()
	must.SliceLen(t, 1, st)
	must.Eq(t, `statfs \x07failed`, st[0].Error)
	must.NotNil(t, st[0].Bytes)

	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	statsPassWait(h.m, ctx, later.Add(2*time.Minute))
	statsPassWait(h.m, ctx, later.Add(3*time.Minute))
	must.Eq(t, 2, h.fake.Count(MethodNodeGetVolumeStats))
	must.SliceEmpty(t, h.m.VolumeStats())
}

// TestStatsLoop runs the real loop: a published volume gets sampled, the
// manager's Observe hears the calls with the plugin id, and Close stops
// the loop (it would hang otherwise).
func TestStatsLoop(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]int{}
	h := newHarness(t, func(c *Config) {
		c.StatsInterval = 20 * time.Millisecond
		c.Observe = func(pluginID string, o csiclient.Observation) {
			mu.Lock()
			defer mu.Unlock()
			seen[pluginID+"/"+o.Method+"/"+o.Code.String()]++
		}
	})
	h.setPlugin(statsPlugin("p"))
	_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.m.StartStats()
	h.m.StartStats() // a second start does nothing
	deadline := time.Now().Add(20 * time.Second)
	for {
		st := h.m.VolumeStats()
		if len(st) == 1 && !st[0].Sampled.IsZero() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("volume never sampled: %+v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	h.m.Close()
	mu.Lock()
	defer mu.Unlock()
	must.Positive(t, seen["p/NodeGetVolumeStats/OK"])
	must.Eq(t, 1, seen["p/NodePublishVolume/OK"])
	must.Eq(t, 1, seen["p/NodeStageVolume/OK"])
}

func TestCleanMessage(t *testing.T) {
	long := strings.Repeat("é", MaxConditionMessage+10)
	for _, tc := range []struct {
		in, want string
	}{
		{"ok", "ok"},
		{"a\x1b[2Jb", `a\x1b[2Jb`},
		{"line\nnext\r", `line\nnext\r`},
		{"bidi \u202e", `bidi \u202e`},
		{"bad \xff", `bad \xff`},
		{"token " + canary, "token <redacted>"},
		{long, strings.Repeat("é", MaxConditionMessage) + "... (20 more bytes)"},
	} {
		must.Eq(t, tc.want, cleanMessage(tc.in, map[string]string{"t": canary}))
	}
}

// TestWakeAt checks the loop's pacing: never sooner than a hundredth of
// the interval (at least statsMinGap) after a pass, never later than
// statsRescan, else at the next volume due.
func TestWakeAt(t *testing.T) {
	now := time.Unix(1000, 0)
	for _, tc := range []struct {
		interval, next, want time.Duration
	}{
		{time.Minute, 0, 600 * time.Millisecond},
		{time.Minute, time.Second, time.Second},
		{time.Minute, time.Minute, statsRescan},
		{time.Second, 0, statsMinGap},
		{time.Hour, time.Hour, statsRescan},
	} {
		must.Eq(t, tc.want, wakeAt(now, now.Add(tc.next), tc.interval).Sub(now), must.Sprintf("%+v", tc))
	}
}

// TestStatsHungPlugin checks what a plugin that never answers
// NodeGetVolumeStats (a plugin task is a job's) does to the others: its
// volumes hold at most statsPerPlugin calls, a pass does not wait for
// them, and the volume of another plugin is sampled meanwhile.
func TestStatsHungPlugin(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.RPCTimeout = time.Minute })
	h.setPlugin(statsPlugin("p"))
	h.setPlugin(statsPlugin("slow"))
	var ops []journalOp
	for i := range 5 {
		id := fmt.Sprintf("slow-%d", i)
		ops = append(ops, journalOp{Op: opPutTask, Task: &taskRecord{TaskID: "task-" + id, Name: "data", PluginID: "slow",
			VolumeID: id, Target: "/publish/" + id, State: phasePublished}})
	}
	ops = append(ops, journalOp{Op: opPutTask, Task: &taskRecord{TaskID: "task-ok", Name: "data", PluginID: "p",
		VolumeID: "ok", Target: "/publish/ok", State: phasePublished}})
	applyInMemory(h.m, ops)
	var releases []func()
	for i := range 5 {
		releases = append(releases, h.fake.Hang(fmt.Sprintf("slow-%d", i)))
	}
	h.m.stats = newStatsLoop(time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	defer func() {
		cancel()
		for _, r := range releases {
			r()
		}
		h.m.stats.wg.Wait()
	}()
	countSlow := func() int {
		n := 0
		for _, c := range h.fake.Calls() {
			if c.Method == MethodNodeGetVolumeStats && strings.HasPrefix(c.VolumeID, "slow-") {
				n++
			}
		}
		return n
	}
	okSampled := func() time.Time {
		for _, v := range h.m.VolumeStats() {
			if v.VolumeID == "ok" {
				return v.Sampled
			}
		}
		return time.Time{}
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal(what)
			}
		}
	}
	now := time.Now()
	h.m.statsPass(ctx, now)
	h.m.statsPass(ctx, now.Add(time.Minute))
	waitFor("the volume of the healthy plugin was not sampled beside the hung one", func() bool { return !okSampled().IsZero() })
	// The calls run in goroutines of their own: wait for the two that
	// took the plugin's slots to reach it. The others wait for a slot,
	// which the hung calls never give back.
	waitFor("the hung plugin's calls did not start", func() bool { return countSlow() >= statsPerPlugin })
	// The hung plugin holds its two calls, no more, across passes; the
	// other plugin's volume is sampled again meanwhile.
	before := okSampled()
	h.m.statsPass(ctx, now.Add(2*time.Minute))
	waitFor("the volume of the healthy plugin was not sampled again", func() bool { return okSampled().After(before) })
	slow := countSlow()
	must.Eq(t, statsPerPlugin, slow)
	must.Less(t, 5, slow)
}

// TestStatsNegativeUsageLeftOut checks that a unit a plugin answers with a
// negative number (the CSI spec forbids it) is left out of the volume's
// stats, that the other unit is kept, that the warning is logged once,
// and that a good answer later is kept again.
func TestStatsNegativeUsageLeftOut(t *testing.T) {
	h, pass := statsSetup(t)

	h.fake.SetUsage("vol1",
		&csi.VolumeUsage{Unit: csi.VolumeUsage_BYTES, Total: 100, Used: 120, Available: -20},
		&csi.VolumeUsage{Unit: csi.VolumeUsage_INODES, Total: 1000, Used: 10, Available: 990})
	pass() // finds the volume
	pass()
	pass()
	st := h.m.VolumeStats()
	must.SliceLen(t, 1, st)
	must.Nil(t, st[0].Bytes)
	must.Eq(t, &Usage{Total: 1000, Used: 10, Available: 990}, st[0].Inodes)
	must.Eq(t, "", st[0].Error)
	must.Eq(t, 1, strings.Count(h.logs.String(), "plugin answered a negative usage to NodeGetVolumeStats"))
	must.StrContains(t, h.logs.String(), "available=-20")

	h.fake.SetUsage("vol1", &csi.VolumeUsage{Unit: csi.VolumeUsage_BYTES, Total: 100, Used: 20, Available: 80})
	pass()
	st = h.m.VolumeStats()
	must.Eq(t, &Usage{Total: 100, Used: 20, Available: 80}, st[0].Bytes)
	must.Nil(t, st[0].Inodes)
}
