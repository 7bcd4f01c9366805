package csihook

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

const canary = "s3cr3t-CANARY-value"

// syncBuffer is a bytes.Buffer safe for the logger's concurrent writes.
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

type recordedEvent struct {
	TaskID, Msg string
	Ann         map[string]string
}

type harness struct {
	t       testing.TB
	root    string
	mnt     *mounter.Fake
	fake    *FakeClient
	logs    *syncBuffer
	m       *Manager
	mu      sync.Mutex
	plugins map[string]PluginInfo
	events  []recordedEvent
	tweak   func(*Config)
}

// fullPlugin needs ControllerPublish and staging, and can create and serve
// block volumes.
func fullPlugin(id string) PluginInfo {
	return PluginInfo{ID: id, Socket: "/run/" + id + ".sock", NodeID: "node-1", Healthy: true,
		StageUnstage: true, ControllerPublish: true, PublishReadonly: true, CreateDelete: true, Block: true}
}

func newHarness(t testing.TB, tweak ...func(*Config)) *harness {
	t.Helper()
	h := &harness{
		t: t, root: t.TempDir(), mnt: mounter.NewFake(), logs: &syncBuffer{},
		plugins: map[string]PluginInfo{"p": fullPlugin("p")},
	}
	if len(tweak) > 0 {
		h.tweak = tweak[0]
	}
	h.fake = NewFakeClient(h.mnt)
	h.m = h.newManager()
	t.Cleanup(func() { h.m.Close() })
	return h
}

func (h *harness) config() Config {
	cfg := Config{
		Root: h.root,
		Lookup: func(id string) (PluginInfo, error) {
			h.mu.Lock()
			defer h.mu.Unlock()
			p, ok := h.plugins[id]
			if !ok {
				return PluginInfo{}, fmt.Errorf("no plugin %q", id)
			}
			return p, nil
		},
		Dial:    h.fake.Dial,
		Mounter: h.mnt,
		Logger: hclog.New(&hclog.LoggerOptions{Name: "csi", Level: hclog.Trace, Output: h.logs,
			JSONFormat: false, IncludeLocation: false}),
		Events: func(taskID, msg string, ann map[string]string) {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.events = append(h.events, recordedEvent{taskID, msg, ann})
		},
		NodeName:            "n1",
		PluginWait:          20 * time.Millisecond,
		RPCTimeout:          2 * time.Second,
		RetryAttempts:       3,
		RetryBase:           time.Millisecond,
		RetryMax:            5 * time.Millisecond,
		BackgroundRetryBase: 10 * time.Millisecond,
		BackgroundRetryMax:  50 * time.Millisecond,
	}
	if h.tweak != nil {
		h.tweak(&cfg)
	}
	return cfg
}

func (h *harness) newManager() *Manager {
	h.t.Helper()
	m, err := New(h.config())
	must.NoError(h.t, err)
	return m
}

// restart closes the manager and opens a new one on the same directories.
func (h *harness) restart() {
	h.t.Helper()
	h.m.Close()
	h.m = h.newManager()
}

func (h *harness) setPlugin(p PluginInfo) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.plugins[p.ID] = p
}

func (h *harness) removePlugin(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.plugins, id)
}

func (h *harness) eventMsgs() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]string, 0, len(h.events))
	for _, e := range h.events {
		out = append(out, e.Msg)
	}
	return out
}

// journalRecords lists what the journal holds on disk: its live volume
// and task records as "vol <plugin>/<volume> <stage>/<controller>" and
// "task <task>/<name> <state>", and any file but the log and the lock by
// name (such as *.bad), sorted. Records of created volumes are left out:
// they stay by design, they are not work left to do.
func (h *harness) journalRecords() []string {
	h.t.Helper()
	return journalRecords(h.t, filepath.Join(h.root, "journal"))
}

// diskJournal replays the journal's log as it is on disk.
func diskJournal(t testing.TB, dir string) *journalState {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, logName))
	must.NoError(t, err)
	scan := scanLog(data, hclog.NewNullLogger())
	must.Eq(t, 0, scan.torn+scan.damaged+scan.badOps)
	return scan.state
}

func journalRecords(t testing.TB, dir string) []string {
	t.Helper()
	s := diskJournal(t, dir)
	var out []string
	for _, v := range s.vols {
		out = append(out, fmt.Sprintf("vol %s/%s %s/%s", v.PluginID, v.VolumeID, v.Stage, v.Controller))
	}
	for _, recs := range s.tasks {
		for _, tr := range recs {
			out = append(out, fmt.Sprintf("task %s/%s %s", tr.TaskID, tr.Name, tr.State))
		}
	}
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	for _, e := range entries {
		// A compaction's temp file comes and goes.
		if e.Name() != ".lock" && e.Name() != logName && !strings.HasPrefix(e.Name(), ".tmp-") {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out)
	return out
}

func (h *harness) waitIdle() {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	must.NoError(h.t, h.m.WaitIdle(ctx))
}

// mountPaths returns the fake mount table's paths.
func (h *harness) mountPaths() []string {
	h.t.Helper()
	mps, err := h.mnt.List()
	must.NoError(h.t, err)
	var out []string
	for _, mp := range mps {
		out = append(out, mp.Path)
	}
	return out
}

func req(name, volumeID, dest string) VolumeRequest {
	return VolumeRequest{
		Name: name, PluginID: "p", VolumeID: volumeID, Destination: dest,
		AccessMode: AccessSingleNodeWriter, AttachmentMode: AttachmentFileSystem,
		FSType: "ext4", MountFlags: []string{"noatime"},
		Context: map[string]string{"ctx": "v"}, Secrets: map[string]string{"token": canary},
	}
}

func containsEvent(events []string, sub string) bool {
	for _, e := range events {
		if strings.Contains(e, sub) {
			return true
		}
	}
	return false
}

// teardownFailing sets up volume "data" (vol1) for taskID and tears it
// down while method answers Unavailable, which leaves the rest to the
// background retry; method answers again on return.
func (h *harness) teardownFailing(t *testing.T, taskID, method string) {
	t.Helper()
	ctx := context.Background()
	_, err := h.m.Setup(ctx, taskID, []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.fake.SetError(method, status.Error(codes.Unavailable, "connection refused"))
	must.ErrorContains(t, h.m.Teardown(ctx, taskID), "retrying in the background")
	h.fake.SetError(method, nil)
}
