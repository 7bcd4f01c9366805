package csihook

import (
	"context"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// passClock is the repairs' clock of a test: each pass moves it on by the
// driver's 30 s between checks.
type passClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *passClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *passClock) next() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(30 * time.Second)
}

// newRelapseHarness sets up task-a's volume "data" with the repairs'
// back-off at 20 s doubling up to 5 min on a clock the test moves.
func newRelapseHarness(t *testing.T) (*harness, *passClock, string) {
	t.Helper()
	h := newHarness(t, func(c *Config) { c.RepairBackoffBase, c.RepairBackoffMax = 20*time.Second, 5*time.Minute })
	clock := &passClock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	h.m.now = clock.now
	return h, clock, h.setupData()
}

// pass is one periodic check, 30 s after the last; it returns how many
// NodePublishVolume calls it made.
func (h *harness) pass(clock *passClock) int {
	h.t.Helper()
	clock.next()
	h.fake.ResetCalls()
	_, err := h.m.RepairStale(context.Background(), "")
	must.NoError(h.t, err)
	return h.fake.Count(MethodNodePublishVolume)
}

const relapseEvent = `Volume "data" died again soon after its repair`

// A volume whose fresh mount dies again before the next check (a plugin
// that publishes and then loses the mount) is not repaired at every pass
// for ever: each relapse doubles the wait before its next repair (20 s,
// 40 s, 80 s ... up to 5 min), the task is told once why, and each pass
// that holds the repair back says so at Debug.
func TestRepairStale_RelapsingVolumeBacksOff(t *testing.T) {
	h, clock, target := newRelapseHarness(t)
	var published []int
	for i := range 10 {
		h.mnt.SetStale(target, true)
		if h.pass(clock) > 0 {
			published = append(published, i)
		}
	}
	// Pass 0 repairs; 1 finds it dead again (waits 20 s: 2 repairs); 3
	// again (40 s: 5 repairs); 6 again (80 s: 9 repairs).
	must.Eq(t, []int{0, 2, 5, 9}, published, must.Sprint(h.eventMsgs()))
	must.Eq(t, 1, countEvents(h, relapseEvent), must.Sprint(h.eventMsgs()))
	must.Eq(t, 1, countEvents(h, `Volume "data" is stale`), must.Sprint(h.eventMsgs()))
	must.Eq(t, 6, strings.Count(h.logs.String(), "[DEBUG] csi.csihook: dead volume mount not repaired in this pass"), must.Sprint(h.logs.String()))

	// The wait stops growing at 5 min: a relapse and ten passes, at the
	// most, from one repair to the next (160 s: 16; 300 s: 27, 38, 49).
	last := 9
	for i := 10; i < 60; i++ {
		h.mnt.SetStale(target, true)
		if h.pass(clock) > 0 {
			must.LessEq(t, 11, i-last, must.Sprintf("repairs at passes %d and %d", last, i))
			last = i
		}
	}
	must.Eq(t, 49, last)
	must.Eq(t, 1, countEvents(h, relapseEvent), must.Sprint(h.eventMsgs()))

	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
}

// A repaired mount that a check finds alive ends the back-off: its next
// death is repaired at once, and told as the first was.
func TestRepairStale_BackoffResetOnceTheRepairHolds(t *testing.T) {
	h, clock, target := newRelapseHarness(t)
	for range 4 { // repaired, relapse, repaired, relapse (40 s)
		h.mnt.SetStale(target, true)
		h.pass(clock)
	}
	must.Eq(t, 0, h.pass(clock)) // still waiting; the mount stays dead
	must.Eq(t, 1, h.pass(clock)) // repaired
	must.Eq(t, 0, h.pass(clock)) // alive: the back-off ends
	h.mnt.SetStale(target, true)
	must.Eq(t, 1, h.pass(clock), must.Sprint(h.eventMsgs()))
	must.Eq(t, 2, countEvents(h, `Volume "data" is stale`), must.Sprint(h.eventMsgs()))
	must.Eq(t, 1, countEvents(h, relapseEvent), must.Sprint(h.eventMsgs()))
	// Dead again before a check saw it alive: a relapse, told anew.
	h.mnt.SetStale(target, true)
	must.Eq(t, 0, h.pass(clock))
	must.Eq(t, 2, countEvents(h, relapseEvent), must.Sprint(h.eventMsgs()))

	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
	must.SliceEmpty(t, h.journalRecords())
}

// A plugin that comes back after its process died is a new plugin: the
// driver's repair on its return (ResetRepairBackoff, then RepairStale) is
// not held back by the relapses of the one before. Nomad's restart policy
// paces a plugin that crash-loops.
func TestRepairStale_PluginReturnEndsTheBackoff(t *testing.T) {
	h, clock, target := newRelapseHarness(t)
	// Repaired, relapse (20 s), repaired, relapse (40 s), held,
	// repaired, relapse (80 s: the next two passes hold it too).
	for range 7 {
		h.mnt.SetStale(target, true)
		h.pass(clock)
	}
	h.m.ResetRepairBackoff("other")
	must.Eq(t, 0, h.pass(clock), must.Sprint("another plugin's return changes nothing"))
	h.m.ResetRepairBackoff("p")
	must.Eq(t, 1, h.pass(clock))
	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
}

// repairStates is a copy of Manager.repairs.
func (m *Manager) repairStates() map[taskRef]repairState {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.repairs)
}

// A task stopped while its volume's repair is held back is torn down as
// any other, and what its repairs remembered goes with it.
func TestRepairStale_TeardownDuringBackoff(t *testing.T) {
	h, clock, target := newRelapseHarness(t)
	for range 2 { // repaired, relapse
		h.mnt.SetStale(target, true)
		h.pass(clock)
	}
	must.Positive(t, h.m.repairStates()[taskRef{"task-a", "data"}].relapses)
	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
	must.MapEmpty(t, h.m.repairStates())
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
	must.Eq(t, 0, h.pass(clock))
}

// A relapse whose staging mount died too is held back whole: no restage
// without the publishes on it.
func TestRepairStale_RelapseWithDeadStagingHeldWhole(t *testing.T) {
	h, clock, target := newRelapseHarness(t)
	staging := h.m.StagingPath("p", "vol1")
	h.mnt.SetStale(staging, true)
	must.Eq(t, 1, h.pass(clock))
	must.Eq(t, 1, h.fake.Count(MethodNodeStageVolume))
	h.mnt.SetStale(staging, true)
	h.mnt.SetStale(target, true)
	must.Eq(t, 0, h.pass(clock))
	must.SliceEmpty(t, h.fake.Methods())
	must.Eq(t, 1, h.pass(clock))
	must.Eq(t, 1, h.fake.Count(MethodNodeStageVolume))
	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
	must.SliceEmpty(t, h.mountPaths())
}

// A plugin whose process died is no plugin that keeps losing its mounts:
// a check that finds a repaired mount dead while its plugin is down (the
// periodic check during the plugin's restart delay) counts no relapse and
// tells the task nothing of one; the plugin's return repairs it at once.
func TestRepairStale_DownPluginIsNoRelapse(t *testing.T) {
	h, clock, target := newRelapseHarness(t)
	h.mnt.SetStale(target, true)
	must.Eq(t, 1, h.pass(clock)) // repaired
	// The plugin's process dies: its fresh mount dies with it.
	h.mnt.SetStale(target, true)
	down := fullPlugin("p")
	down.Healthy = false
	h.setPlugin(down)
	clock.next()
	_, err := h.m.RepairStale(context.Background(), "")
	must.Eq(t, 0, countEvents(h, relapseEvent), must.Sprint(h.eventMsgs()))
	must.Zero(t, h.m.repairStates()[taskRef{"task-a", "data"}].relapses)
	must.ErrorIs(t, err, ErrPluginNotFound)
	// Back: the driver ends the back-off and repairs.
	h.setPlugin(fullPlugin("p"))
	h.m.ResetRepairBackoff("p")
	must.Eq(t, 1, h.pass(clock))
	must.Eq(t, 0, countEvents(h, relapseEvent), must.Sprint(h.eventMsgs()))
	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
	must.SliceEmpty(t, h.mountPaths())
}

// A dead staging is restaged with every publish on it: a relapsed publish
// of one task does not hold back the restage another task's first death
// needs, and, repaired in that pass, its task is not told of a wait.
func TestRepairStale_DeadStagingOfAnotherTaskIsNotHeld(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.RepairBackoffBase, c.RepairBackoffMax = 20*time.Second, 5*time.Minute })
	clock := &passClock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	h.m.now = clock.now
	shared := req("data", "vol1", "/data")
	shared.AccessMode = AccessMultiNodeMultiWriter
	_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{shared})
	must.NoError(t, err)
	staging := h.m.StagingPath("p", "vol1")
	h.mnt.SetStale(staging, true)
	must.Eq(t, 1, h.pass(clock)) // task-a repaired
	_, err = h.m.Setup(context.Background(), "task-b", []VolumeRequest{shared})
	must.NoError(t, err)
	// The staging dies again: task-a's publish relapsed, task-b's died
	// for the first time.
	h.mnt.SetStale(staging, true)
	must.Eq(t, 2, h.pass(clock), must.Sprint(h.eventMsgs()))
	must.Eq(t, 1, h.fake.Count(MethodNodeStageVolume))
	must.Eq(t, 0, countEvents(h, relapseEvent), must.Sprint(h.eventMsgs()))
	must.Zero(t, h.m.repairStates()[taskRef{"task-a", "data"}].relapses)
	for _, task := range []string{"task-a", "task-b"} {
		must.NoError(t, h.m.Teardown(context.Background(), task))
	}
	must.SliceEmpty(t, h.mountPaths())
}

// Tasks of an allocation share one publish (allocShare): one repair of it
// is a fresh mount for each, and each must hear of it to bind it afresh.
// A task whose share relapsed is not left out when another's first death
// has the publish repaired: the checks after it would find the shared
// target alive and never repair the dead copy in the held task.
func TestRepairStale_SharedPublishRepairedForEveryTask(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.RepairBackoffBase, c.RepairBackoffMax = 20*time.Second, 5*time.Minute })
	clock := &passClock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	h.m.now = clock.now
	ctx := context.Background()
	app, backup := "alloc-a/app/11111111", "alloc-a/backup/22222222"
	target := h.shareData(ctx, app)
	h.mnt.SetStale(target, true)
	must.Eq(t, 1, h.pass(clock)) // app's repaired
	// Another task of the allocation starts on the same publish; the
	// publish dies again before a check saw it alive.
	must.Eq(t, target, h.shareData(ctx, backup))
	h.mnt.SetStale(target, true)
	clock.next()
	rep, err := h.m.RepairStale(ctx, "p")
	must.NoError(t, err)
	var got []string
	for _, r := range rep {
		got = append(got, r.TaskID)
	}
	must.Eq(t, []string{app, backup}, got, must.Sprint(h.eventMsgs()))
	must.Eq(t, 0, countEvents(h, relapseEvent), must.Sprint(h.eventMsgs()))
	h.teardownAll(ctx, app, backup)
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
}
