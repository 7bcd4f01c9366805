package csihook

import (
	"context"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// countingDial records which sockets are dialled and which clients closed.
type countingDial struct {
	mu     sync.Mutex
	fake   *FakeClient
	closed []string
}

type closeRecorder struct {
	*FakeClient
	socket string
	d      *countingDial
}

func (c closeRecorder) Close() error {
	c.d.mu.Lock()
	defer c.d.mu.Unlock()
	c.d.closed = append(c.d.closed, c.socket)
	return nil
}

func (d *countingDial) dial(socket string) (Client, error) {
	return closeRecorder{FakeClient: d.fake, socket: socket, d: d}, nil
}

func (m *Manager) cachedSockets() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for s := range m.clients {
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}

func TestClientCache_GoneSocketsArePruned(t *testing.T) {
	dir := t.TempDir()
	d := &countingDial{}
	h := newHarness(t, func(c *Config) { c.Dial = d.dial })
	d.fake = h.fake
	sock := func(name string) string {
		p := filepath.Join(dir, name+".sock")
		must.NoError(t, os.WriteFile(p, nil, 0o600))
		return p
	}
	first, second := sock("first"), sock("second")
	p := fullPlugin("p")
	p.Socket = first
	h.setPlugin(p)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.Eq(t, []string{first}, h.m.cachedSockets())

	// The plugin task ends (its socket goes) and a new one serves the id
	// over another socket: the old client is closed, not kept for good.
	must.NoError(t, os.Remove(first))
	p.Socket = second
	h.setPlugin(p)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.Eq(t, []string{second}, h.m.cachedSockets())
	d.mu.Lock()
	must.Eq(t, []string{first}, d.closed)
	d.mu.Unlock()
}

func TestTeardown_ReleasedAfterBackgroundRetry(t *testing.T) {
	var mu sync.Mutex
	var released []string
	h := newHarness(t, func(c *Config) {
		c.Released = func(taskID string) {
			mu.Lock()
			defer mu.Unlock()
			released = append(released, taskID)
		}
	})
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.fake.SetError(MethodNodeUnpublishVolume, status.Error(codes.Unavailable, "connection refused"))
	must.ErrorContains(t, h.m.Teardown(ctx, "task-a"), "retrying in the background")
	must.Wait(t, waitFor(func() bool { return h.fake.Count(MethodNodeUnpublishVolume) >= 3 }))
	mu.Lock()
	must.SliceEmpty(t, released)
	mu.Unlock()

	h.fake.SetError(MethodNodeUnpublishVolume, nil)
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())
	mu.Lock()
	defer mu.Unlock()
	must.Eq(t, []string{"task-a"}, released)
}

// A plugin that is not there yet (its task starts with the workload, or a
// driver that just restarted has not taken it back) is waited for, up to
// PluginWait; one that never comes fails the start as before.
func TestSetup_WaitsForAPluginThatIsNotThereYet(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.PluginWait = 10 * time.Second })
	h.removePlugin("p")
	go func() {
		time.Sleep(300 * time.Millisecond)
		h.setPlugin(fullPlugin("p"))
	}()
	_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.True(t, containsEvent(h.eventMsgs(), `Waiting up to 10s for CSI plugin "p": CSI plugin "p" is not running on node`))
	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))

	h2 := newHarness(t, func(c *Config) { c.PluginWait = 300 * time.Millisecond })
	h2.removePlugin("p")
	_, err = h2.m.Setup(context.Background(), "task-b", []VolumeRequest{req("data", "vol1", "/data")})
	must.ErrorContains(t, err, `CSI plugin "p" is not running on node`)
	must.Eq(t, 0, h2.fake.Count(MethodNodeStageVolume))
}
