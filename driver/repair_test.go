package driver

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

// replacingProcess is a fake task process that can take a fresh mount.
type replacingProcess struct {
	*fakeProcess
	mu    sync.Mutex
	calls []csihook.Repaired
	err   error
}

func (p *replacingProcess) ReplaceMount(source, target string, readOnly bool) (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls = append(p.calls, csihook.Repaired{HostPath: source, Destination: target, ReadOnly: readOnly})
	return target, p.err
}

func TestAttachRepaired(t *testing.T) {
	rep := csihook.Repaired{TaskID: "alloc-1/t/1", Name: "data", PluginID: "p", VolumeID: "v",
		HostPath: "/stage/publish/x/data", Destination: "/srv/data", ReadOnly: true}
	cases := []struct {
		name      string
		replacer  bool
		err       error
		wantEvent string
		wantCall  bool
	}{
		{name: "attached in the running task", replacer: true, wantCall: true,
			wantEvent: `Volume "data" repaired: its fresh mount is attached at /srv/data in the running task`},
		{name: "attach fails: the task is told to restart", replacer: true, wantCall: true, err: errors.New("mount target \"/srv\": symlink"),
			wantEvent: `Repair of stale volume "data" failed: it was published again, but attaching it in the running task failed (mount target "/srv": symlink): restart the task to see its data`},
		{name: "a process that cannot take mounts", replacer: false,
			wantEvent: `Volume "data" was published again but cannot be attached in this running task: restart the task to see its data`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, Config{})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			events, err := td.TaskEvents(ctx)
			must.NoError(t, err)
			cfg := &drivers.TaskConfig{ID: rep.TaskID, AllocID: "alloc-1", Name: "t"}
			fp := newFakeProcess(4242)
			rp := &replacingProcess{fakeProcess: fp, err: tc.err}
			var proc taskProcess = fp
			if tc.replacer {
				proc = rp
			}
			td.tasks.Set(cfg.ID, newTaskHandle(hclog.NewNullLogger(), cfg, proc, time.Now()))
			td.eventTargets.Store(cfg.ID, cfg)

			td.attachRepaired(rep, time.Now())
			select {
			case ev := <-events:
				must.Eq(t, tc.wantEvent, ev.Message)
				must.Eq(t, "data", ev.Annotations["volume"])
				must.Eq(t, rep.TaskID, ev.TaskID)
			case <-ctx.Done():
				t.Fatal("no task event")
			}
			if tc.wantCall {
				// The journal's target, destination and read_only go to the task.
				must.Eq(t, []csihook.Repaired{{HostPath: rep.HostPath, Destination: rep.Destination, ReadOnly: true}}, rp.calls)
			}
		})
	}
}
