package csihook

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"sort"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/safetext"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// The stats loop: every published volume whose plugin has the node
// capability GET_VOLUME_STATS is sampled with NodeGetVolumeStats once per
// Config.StatsInterval. Each volume has its own phase within the interval
// (a hash of its plugin and volume id), so that a node with hundreds of
// volumes asks a few at a time, never all at once, and a volume keeps its
// place from one interval to the next. The last sample of each volume is
// kept in memory (VolumeStats); an abnormal volume condition (VOLUME_CONDITION)
// becomes an event on every task using the volume, and another one when
// it is normal again.
//
// The loop reads the manager's records; it takes no volume lock, so a
// stuck plugin never delays a setup or teardown, and a sample racing an
// unpublish is dropped (the volume is no longer a target).

// MethodNodeGetVolumeStats names the stats RPC, as in FakeClient and logs.
const MethodNodeGetVolumeStats = csiclient.NodeGetVolumeStats

// StatsClient is a Client that can also answer NodeGetVolumeStats. The
// real client and FakeClient are; a Client that is not is never asked.
type StatsClient interface {
	NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error)
}

const (
	// statsRescan is the longest the loop sleeps before it looks again
	// for volumes published or unpublished meanwhile.
	statsRescan = 5 * time.Second
	// statsMinGap is the shortest wait between two passes.
	statsMinGap = 100 * time.Millisecond
	// statsParallel bounds the samples in flight at once, and
	// statsPerPlugin those of one plugin: the volumes of a plugin that
	// hangs (a plugin task is a job's) wait for its two slots, holding no
	// other, and a pass never waits for a sample, so the volumes of other
	// plugins are sampled on time.
	statsParallel  = 8
	statsPerPlugin = 2
	// MaxConditionMessage bounds the plugin's condition message kept and
	// put in events, in runes.
	MaxConditionMessage = 256
)

// Usage is one unit (bytes or inodes) of a volume's usage. A plugin may
// leave any of the numbers out (zero).
type Usage struct {
	Total     int64 `json:"total"`
	Used      int64 `json:"used"`
	Available int64 `json:"available"`
}

// VolumeStats is the last sample of one volume.
type VolumeStats struct {
	PluginID string `json:"plugin_id"`
	VolumeID string `json:"volume_id"`
	// Tasks are the IDs of the tasks using the volume, sorted.
	Tasks []string `json:"tasks"`
	// Sampled is when the last answer came; zero before the first.
	Sampled time.Time `json:"sampled"`
	Bytes   *Usage    `json:"bytes,omitempty"`
	Inodes  *Usage    `json:"inodes,omitempty"`
	// HasCondition is set once the plugin (with VOLUME_CONDITION) told
	// the volume's condition; Abnormal and Message are that condition.
	HasCondition bool `json:"has_condition"`
	Abnormal     bool `json:"abnormal"`
	// Message is the plugin's condition message, with secrets removed,
	// control characters escaped and at most MaxConditionMessage runes.
	Message string `json:"message,omitempty"`
	// Error is the last call's failure (cleaned as Message), empty once a
	// call answers again.
	Error string `json:"error,omitempty"`
}

// statsTarget is a volume to sample, as the records say now.
type statsTarget struct {
	key     volKey
	path    string
	staging string
	secrets []map[string]string
	// tasks maps a task ID to its name for the volume.
	tasks map[string]string
}

type statsEntry struct {
	next time.Time
	busy bool
	last VolumeStats
	// told holds the tasks that were told the volume is abnormal.
	told map[string]bool
	// warnedUsage is set once a usage the CSI spec forbids was logged.
	warnedUsage bool
}

type statsLoop struct {
	interval time.Duration
	mu       sync.Mutex
	entries  map[volKey]*statsEntry
	// slots bounds the samples in flight; plugins those per plugin.
	slots   chan struct{}
	plugins map[string]chan struct{}
	// wg counts the sample goroutines; the loop waits for them to end.
	wg sync.WaitGroup
}

// StartStats starts the stats loop with Config.StatsInterval; it does
// nothing when the interval is zero or less, or when it already runs.
// Close stops it.
func (m *Manager) StartStats() {
	if m.cfg.StatsInterval <= 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed || m.stats != nil {
		return
	}
	m.stats = newStatsLoop(m.cfg.StatsInterval)
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.runStats(m.ctx)
	}()
}

func newStatsLoop(interval time.Duration) *statsLoop {
	return &statsLoop{interval: interval, entries: map[volKey]*statsEntry{},
		slots: make(chan struct{}, statsParallel), plugins: map[string]chan struct{}{}}
}

func (m *Manager) runStats(ctx context.Context) {
	m.logger.Debug("volume stats loop started", "interval", m.cfg.StatsInterval)
	defer m.stats.wg.Wait()
	for {
		now := time.Now()
		next := m.statsPass(ctx, now)
		t := time.NewTimer(wakeAt(now, next, m.cfg.StatsInterval).Sub(now))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// wakeAt is when the loop that made a pass at now wakes again, given the
// next volume due: then, but no sooner than a hundredth of the interval
// (at least statsMinGap) after now, so that a pass handles the volumes due
// meanwhile together rather than one pass per volume (each pass reads
// every record), and no later than statsRescan, to find new volumes.
func wakeAt(now, next time.Time, interval time.Duration) time.Time {
	gap := max(interval/100, statsMinGap)
	if next.Before(now.Add(gap)) {
		next = now.Add(gap)
	}
	if late := now.Add(statsRescan); next.After(late) {
		next = late
	}
	return next
}

// phase is a volume's offset within the interval: spread evenly over it
// for many volumes, the same for a volume every time.
func phase(k volKey, interval time.Duration) time.Duration {
	h := fnv.New64a()
	h.Write([]byte(k.plugin))
	h.Write([]byte{0})
	h.Write([]byte(k.volume))
	return time.Duration(h.Sum64() % uint64(interval))
}

// publishedKeys returns the volumes published to a task now.
func (m *Manager) publishedKeys() map[volKey]bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[volKey]bool, len(m.vols))
	for _, recs := range m.tasks {
		for _, t := range recs {
			if t.State == phasePublished {
				out[t.key()] = true
			}
		}
	}
	return out
}

// statsTargets returns the volumes of keys that are still published, each
// with a target path and the tasks using it.
func (m *Manager) statsTargets(keys map[volKey]bool) map[volKey]*statsTarget {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[volKey]*statsTarget, len(keys))
	for _, recs := range m.tasks {
		for _, t := range recs {
			k := t.key()
			if t.State != phasePublished || !keys[k] {
				continue
			}
			st := out[k]
			if st == nil {
				st = &statsTarget{key: k, path: t.Target, tasks: map[string]string{}}
				if v, ok := m.vols[k]; ok {
					st.staging = v.stagingTarget()
					st.secrets = append(st.secrets, v.Secrets)
				}
				out[k] = st
			} else if t.Target < st.path {
				// The same path every time, whichever map order.
				st.path = t.Target
			}
			st.tasks[t.TaskID] = t.Name
			st.secrets = append(st.secrets, t.Secrets)
		}
	}
	return out
}

// statsPass starts sampling the volumes due at now (without waiting for
// the answers: statsLoop.wg) and returns when the next one is due. Volumes no longer published are forgotten; new ones are due at
// their phase. Only the volumes due are looked at closely, so a pass costs
// little more than a look at each record.
func (m *Manager) statsPass(ctx context.Context, now time.Time) time.Time {
	s := m.stats
	keys := m.publishedKeys()
	infos := map[string]PluginInfo{}
	// moved holds the volumes whose plugin id another server serves now:
	// they keep their place but are not sampled, as the volume's other
	// calls wait for the server that set it up (pluginClients).
	moved := map[volKey]bool{}
	for k := range keys {
		info, seen := infos[k.plugin]
		if !seen {
			var err error
			if info, err = m.cfg.Lookup(k.plugin); err != nil {
				info = PluginInfo{}
			}
			infos[k.plugin] = info
		}
		// A plugin without GET_VOLUME_STATS is never asked.
		if !info.VolumeStats || info.ControllerOnly || info.Socket == "" {
			delete(keys, k)
		} else if v, ok := m.vol(k); ok && serverMoved(v, info) {
			moved[k] = true
		}
	}

	due := map[volKey]bool{}
	s.mu.Lock()
	for k := range s.entries {
		if !keys[k] {
			delete(s.entries, k)
		}
	}
	next := now.Add(s.interval)
	for k := range keys {
		e := s.entries[k]
		if e == nil {
			e = &statsEntry{next: now.Add(phase(k, s.interval)), told: map[string]bool{},
				last: VolumeStats{PluginID: k.plugin, VolumeID: k.volume}}
			s.entries[k] = e
		}
		// An unhealthy plugin is skipped, keeping the volume's place; so
		// is a volume whose last sample has not ended.
		if !e.next.After(now) && !e.busy && infos[k.plugin].Healthy && !moved[k] {
			e.busy = true
			due[k] = true
		}
		for !e.next.After(now) {
			e.next = e.next.Add(s.interval)
		}
		if e.next.Before(next) {
			next = e.next
		}
	}
	s.mu.Unlock()
	if len(due) == 0 {
		return next
	}

	targets := m.statsTargets(due)
	var sorted []*statsTarget
	for k := range due {
		if t, ok := targets[k]; ok {
			sorted = append(sorted, t)
			continue
		}
		// Unpublished since: not busy any more (the next pass forgets it).
		s.done(k)
	}
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].key.String() < sorted[j].key.String() })
	for _, t := range sorted {
		slot := s.pluginSlots(t.key.plugin)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.done(t.key)
			for _, c := range []chan struct{}{slot, s.slots} {
				select {
				case c <- struct{}{}:
					defer func() { <-c }()
				case <-ctx.Done():
					return
				}
			}
			// One call in flight per volume (CSI spec, Concurrency): a
			// volume another call is on is skipped, keeping its place,
			// and a call on the volume waits for the sample (bounded by
			// its deadline).
			unlock, ok := m.locks.tryLock(t.key.String())
			if !ok {
				return
			}
			defer unlock()
			m.sample(ctx, t, infos[t.key.plugin])
		}()
	}
	return next
}

func (s *statsLoop) pluginSlots(id string) chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.plugins[id]
	if !ok {
		c = make(chan struct{}, statsPerPlugin)
		s.plugins[id] = c
	}
	return c
}

// done ends a sample of k: the volume may be sampled again.
func (s *statsLoop) done(k volKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.entries[k]; ok {
		e.busy = false
	}
}

func sortedKeys(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// sample asks the plugin for one volume's stats, keeps the answer and
// tells the volume's tasks when its condition turned abnormal or normal.
func (m *Manager) sample(ctx context.Context, t *statsTarget, info PluginInfo) {
	resp, err := m.volumeStats(ctx, t, info)
	s := m.stats
	s.mu.Lock()
	e, ok := s.entries[t.key]
	if !ok {
		// Unpublished meanwhile: nothing to keep or tell.
		s.mu.Unlock()
		return
	}
	e.last.Tasks = sortedKeys(t.tasks)
	if err != nil {
		first := e.last.Error == ""
		e.last.Error = cleanMessage(message(err), t.secrets...)
		s.mu.Unlock()
		if first && ctx.Err() == nil {
			m.logger.Warn("failed to read volume stats", "plugin_id", t.key.plugin, "volume_id", t.key.volume,
				"code", Code(err).String(), "error", e.last.Error)
		}
		return
	}
	e.last.Error = ""
	e.last.Sampled = time.Now()
	e.last.Bytes, e.last.Inodes = nil, nil
	var badUsage *csi.VolumeUsage
	for _, u := range resp.GetUsage() {
		// The spec: none of the numbers may be negative. Such a unit is
		// left out, not exported as a number no volume can have.
		if u.GetTotal() < 0 || u.GetUsed() < 0 || u.GetAvailable() < 0 {
			badUsage = u
			continue
		}
		v := &Usage{Total: u.GetTotal(), Used: u.GetUsed(), Available: u.GetAvailable()}
		switch u.GetUnit() {
		case csi.VolumeUsage_BYTES:
			e.last.Bytes = v
		case csi.VolumeUsage_INODES:
			e.last.Inodes = v
		}
	}
	type event struct{ taskID, msg string }
	var events []event
	if c := resp.GetVolumeCondition(); c != nil && info.VolumeCondition {
		e.last.HasCondition = true
		e.last.Abnormal = c.GetAbnormal()
		e.last.Message = cleanMessage(c.GetMessage(), t.secrets...)
		for _, id := range sortedKeys(t.tasks) {
			switch {
			case e.last.Abnormal && !e.told[id]:
				e.told[id] = true
				events = append(events, event{id, fmt.Sprintf("Volume %s (volume_id %s) is abnormal: %s",
					t.tasks[id], shortID(t.key.volume), e.last.Message)})
			case !e.last.Abnormal && e.told[id]:
				delete(e.told, id)
				events = append(events, event{id, fmt.Sprintf("Volume %s (volume_id %s) is normal again: %s",
					t.tasks[id], shortID(t.key.volume), e.last.Message)})
			}
		}
	}
	for id := range e.told {
		if _, ok := t.tasks[id]; !ok {
			delete(e.told, id)
		}
	}
	warnUsage := badUsage != nil && !e.warnedUsage
	e.warnedUsage = e.warnedUsage || warnUsage
	s.mu.Unlock()
	if warnUsage {
		m.logger.Warn("plugin answered a negative usage to NodeGetVolumeStats, which the CSI spec forbids; that unit is left out of the volume's stats",
			"plugin_id", t.key.plugin, "volume_id", t.key.volume, "unit", badUsage.GetUnit().String(),
			"total", badUsage.GetTotal(), "used", badUsage.GetUsed(), "available", badUsage.GetAvailable())
	}
	for _, ev := range events {
		ann := annotations(t.tasks[ev.taskID], t.key.plugin, t.key.volume)
		m.event(ev.taskID, ev.msg, ann)
	}
}

// volumeStats makes the call, once: the next interval is its retry.
func (m *Manager) volumeStats(ctx context.Context, t *statsTarget, info PluginInfo) (*csi.NodeGetVolumeStatsResponse, error) {
	c, err := m.client(info.Socket)
	if err != nil {
		return nil, err
	}
	sc, ok := c.(StatsClient)
	if !ok {
		return nil, errors.New("the plugin client cannot ask for volume stats")
	}
	var resp *csi.NodeGetVolumeStatsResponse
	p := csiclient.Policy{Attempts: 1, Timeout: min(m.cfg.RPCTimeout, csiclient.Deadline(MethodNodeGetVolumeStats)),
		Code: Code, Observe: m.observer(info.ID)}
	_, err = p.Do(ctx, MethodNodeGetVolumeStats, func(ctx context.Context) (err error) {
		resp, err = sc.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{
			VolumeId: t.key.volume, VolumePath: t.path, StagingTargetPath: t.staging})
		return err
	}, nil, nil)
	return resp, err
}

// observer returns the Policy.Observe of calls to a plugin: Config.Observe
// with the plugin's id, or nil.
func (m *Manager) observer(pluginID string) func(csiclient.Observation) {
	if m.cfg.Observe == nil {
		return nil
	}
	return func(o csiclient.Observation) { m.cfg.Observe(pluginID, o) }
}

// VolumeStats returns the last sample of every volume the stats loop
// samples, sorted by plugin and volume id; nil when the loop is off.
func (m *Manager) VolumeStats() []VolumeStats {
	m.mu.Lock()
	s := m.stats
	m.mu.Unlock()
	if s == nil {
		return nil
	}
	s.mu.Lock()
	out := make([]VolumeStats, 0, len(s.entries))
	for _, e := range s.entries {
		v := e.last
		v.Tasks = append([]string(nil), v.Tasks...)
		if v.Bytes != nil {
			b := *v.Bytes
			v.Bytes = &b
		}
		if v.Inodes != nil {
			i := *v.Inodes
			v.Inodes = &i
		}
		out = append(out, v)
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].PluginID != out[j].PluginID {
			return out[i].PluginID < out[j].PluginID
		}
		return out[i].VolumeID < out[j].VolumeID
	})
	return out
}

// VolumeCounts is how many volumes of this node are in each stage an
// operator looks for, and how many task volumes are published.
type VolumeCounts struct {
	// Staged are the volumes staged on this node.
	Staged int
	// Refused are the volumes whose last NodeStageVolume the plugin
	// refused with a final code (stage "refused"): not staged. The next
	// setup that uses one stages it again, as does a repair or a driver
	// restart that finds a mount of one of its tasks gone (when the
	// secrets that stage needs are still held); tasks that had them
	// before keep their mounts.
	Refused int
	// Published are the task volumes published on this node.
	Published int
}

// VolumeCounts returns how many volumes are staged on this node, how many
// the plugin refused to stage, and how many task volumes are published.
// A volume staging or unstaging (a call under way, or a step a crash left
// for recovery to settle) is in neither count.
func (m *Manager) VolumeCounts() VolumeCounts {
	m.mu.Lock()
	defer m.mu.Unlock()
	var c VolumeCounts
	for _, v := range m.vols {
		switch v.Stage {
		case phaseStaged:
			c.Staged++
		case phaseStageRefused:
			c.Refused++
		}
	}
	for _, recs := range m.tasks {
		for _, t := range recs {
			if t.State == phasePublished {
				c.Published++
			}
		}
	}
	return c
}

// cleanMessage makes a plugin's text safe to keep and show: secrets
// removed, every control or non-printable character (a terminal escape, a
// newline) written as a Go escape, at most MaxConditionMessage runes.
func cleanMessage(s string, secrets ...map[string]string) string {
	return cleanBounded(s, MaxConditionMessage, secrets...)
}

// MaxErrorMessage bounds the plugin's part of a failed call's error (in
// events, the task's failure and logs), in runes.
const MaxErrorMessage = 1024

// cleanBounded is cleanMessage with its bound in runes: the secrets are
// redacted first, then the text goes through the one cleaner
// (csihook/safetext).
func cleanBounded(s string, limit int, secrets ...map[string]string) string {
	return safetext.Bounded(redact(s, secrets...), limit)
}

// shortID is a volume id for an event: as it is when short and printable,
// else its first bytes, cleaned.
func shortID(id string) string {
	const max = 64
	if len(id) > max {
		return cleanMessage(id[:max]) + "..."
	}
	return cleanMessage(id)
}
