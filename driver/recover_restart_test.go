package driver

import (
	"testing"

	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
)

// persisted round-trips a handle the way the Nomad client stores it in its
// state database (msgpack of the exported fields): the task config's raw
// driver config does not survive, as after a real agent restart.
func persisted(t *testing.T, h *drivers.TaskHandle) *drivers.TaskHandle {
	t.Helper()
	var b []byte
	must.NoError(t, base.MsgPackEncode(&b, h))
	var out drivers.TaskHandle
	must.NoError(t, base.MsgPackDecode(b, &out))
	var tc TaskConfig
	must.Error(t, out.Config.DecodeDriverConfig(&tc), must.Sprint("the stored handle still carries the driver config"))
	return &out
}

func TestRecoverTask_afterAgentRestartKeepsPluginAndVolumes(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	cfg := taskConfig(t, TaskConfig{
		Command:    "/usr/bin/plugin",
		Privileged: true,
		CSIPlugin:  &PluginTaskConfig{ID: "fixture", Type: "monolith", MountDir: "/csi"},
	})
	handle, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	var st TaskState
	must.NoError(t, handle.GetDriverState(&st))
	must.Eq(t, &PluginTaskConfig{ID: "fixture", Type: "monolith", MountDir: "/csi"}, st.Plugin)

	// A fresh driver process gets the handle from Nomad's state: the plugin
	// is probed again and released when the task is destroyed.
	d2 := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	must.NoError(t, d2.RecoverTask(persisted(t, handle)))
	ps, ok := d2.prober.Get("fixture")
	must.True(t, ok, must.Sprint("the recovered plugin task is not probed"))
	must.Eq(t, cfg.ID, ps.TaskID)
	h, ok := d2.tasks.Get(cfg.ID)
	must.True(t, ok)
	must.NotNil(t, h.plugin)
	must.False(t, h.volumes)
	// The plugin's stage root is a shared mount point the task holds; it is
	// not among the mounts Nomad stored, so only the state can say so.
	must.Eq(t, []string{d.currentConfig().stageRoot()}, st.SharedSources)
	must.Eq(t, st.SharedSources, h.sharedSources)

	// A task whose state says it has volumes keeps them to tear down.
	work := taskConfig(t, TaskConfig{Command: "/bin/sleep"})
	work.ID, work.Name, work.AllocID = "alloc-2/work/def", "work", "alloc-2"
	wh, _, err := d.StartTask(work)
	must.NoError(t, err)
	must.NoError(t, wh.GetDriverState(&st))
	must.False(t, st.Volumes)
	st.Volumes = true
	must.NoError(t, wh.SetDriverState(&st))
	must.NoError(t, d2.RecoverTask(persisted(t, wh)))
	h, ok = d2.tasks.Get(work.ID)
	must.True(t, ok)
	must.True(t, h.volumes, must.Sprint("a recovered task with volumes would skip their teardown"))
	must.Nil(t, h.plugin)
}
