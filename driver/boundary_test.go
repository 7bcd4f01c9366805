package driver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"
	pstructs "github.com/hashicorp/nomad/plugins/shared/structs"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/safetext"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// The Boundary serves every optional interface of Nomad's that the driver
// implements: a method the driver gains must be added to the Boundary (and
// cleaned there), or Nomad, served the Boundary, would not see it.
func TestBoundary_servesWhatTheDriverImplements(t *testing.T) {
	for _, iface := range []reflect.Type{
		reflect.TypeFor[drivers.DriverPlugin](),
		reflect.TypeFor[drivers.ExecTaskStreamingDriver](),
		reflect.TypeFor[drivers.ExecTaskStreamingRawDriver](),
		reflect.TypeFor[drivers.DriverNetworkManager](),
		reflect.TypeFor[drivers.InternalCapabilitiesDriver](),
	} {
		d := reflect.TypeFor[*Driver]().Implements(iface)
		b := reflect.TypeFor[*Boundary]().Implements(iface)
		must.Eq(t, d, b, must.Sprintf("%s: the driver implements it: %t, the boundary: %t", iface, d, b))
	}
}

// A plugin's messages (a volume call's error, a probe's failure), a
// volume's fields and a task's exit message reach Nomad through the
// Boundary escaped: the start error, every event, the exit result, the
// task's status and the fingerprint.
func TestBoundary_pluginTextAndExitMessages(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	fp := withFakePlugins(t, d)
	b := d.Boundary()
	events := collectEvents(t, b)

	plugin := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p", "default", "plugin")
	_, _, err := b.StartTask(plugin)
	must.NoError(t, err)
	waitHealthy(t, d, "hp")

	// A volume call fails with the plugin's message (a volume id with the
	// text is refused before any call: TestBoundary_everyJobField).
	fp.vols.SetNextError(csihook.MethodNodePublishVolume, status.Error(codes.Internal, "disk on fire "+hostileText))
	vol := jobTask(t, TaskConfig{Command: "/bin/sleep", Volumes: map[string]VolumeConfig{"data": {
		PluginID: "hp", VolumeID: "v1", Destination: "/data", AccessMode: "single-node-writer", AttachmentMode: "file-system",
	}}}, "alloc-w", "default", "web")
	_, _, err = b.StartTask(vol)
	must.Error(t, err)
	t.Logf("start error: %v", err)
	mustCleanAndCarry(t, err.Error())

	// The plugin's probe fails with its message: the plugin task's event
	// and the node's attributes.
	d.Driver.mu.Lock()
	for _, f := range fp.fakes {
		f.NextProbeErr = status.Error(codes.Unavailable, "not ready "+hostileText)
	}
	d.Driver.mu.Unlock()
	must.NoError(t, d.currentProber().Refresh(context.Background()))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	fps, err := b.Fingerprint(ctx)
	must.NoError(t, err)
	got := <-fps
	must.NotNil(t, got)
	carried := false
	for k, v := range got.Attributes {
		if v.String != nil {
			must.True(t, safetext.IsClean(*v.String), must.Sprintf("attribute %s = %q", k, *v.String))
			carried = carried || strings.Contains(*v.String, hostileMark)
		}
	}
	must.True(t, carried, must.Sprint("no attribute carries the plugin's message: the case proves nothing"))

	// A task exits with a message its supervisor wrote.
	work := jobTask(t, TaskConfig{Command: "/bin/sleep"}, "alloc-x", "default", "exit")
	_, _, err = b.StartTask(work)
	must.NoError(t, err)
	d.mu.Lock()
	proc := d.procs[len(d.procs)-1]
	d.mu.Unlock()
	proc.exit(executor.ExitStatus{ExitCode: 1, Err: "failed to kill the rest of the task: " + hostileText})
	wait, err := b.WaitTask(ctx, work.ID)
	must.NoError(t, err)
	res := <-wait
	must.NotNil(t, res)
	must.Error(t, res.Err)
	mustCleanAndCarry(t, res.Err.Error())
	st, err := b.InspectTask(work.ID)
	must.NoError(t, err)
	must.NotNil(t, st.ExitResult)
	mustCleanAndCarry(t, st.ExitResult.Err.Error())

	all := events()
	carried = false
	for _, e := range all {
		must.True(t, safetext.IsClean(e.Message), must.Sprintf("event %q", e.Message))
		for k, v := range e.Annotations {
			must.True(t, safetext.IsClean(k) && safetext.IsClean(v), must.Sprintf("annotation %q=%q", k, v))
		}
		carried = carried || strings.Contains(e.Message, hostileMark)
	}
	must.True(t, carried, must.Sprintf("no event carries the hostile text: the case proves nothing: %d events", len(all)))
}

// Each helper of the Boundary leaves clean text alone and escapes the rest.
func TestBoundary_cleaners(t *testing.T) {
	s := "ok " + hostileText
	fp := cleanFingerprint(&drivers.Fingerprint{HealthDescription: s, Err: errors.New(s),
		Attributes: map[string]*pstructs.Attribute{"a": pstructs.NewStringAttribute(s), "n": pstructs.NewIntAttribute(1, "")}})
	mustCleanAndCarry(t, fp.HealthDescription)
	mustCleanAndCarry(t, fp.Err.Error())
	mustCleanAndCarry(t, *fp.Attributes["a"].String)
	must.Eq(t, int64(1), *fp.Attributes["n"].Int)

	ev := cleanEvent(&drivers.TaskEvent{Message: s, Annotations: map[string]string{"k": s}})
	mustCleanAndCarry(t, ev.Message)
	mustCleanAndCarry(t, ev.Annotations["k"])

	plain := &drivers.ExitResult{ExitCode: 2, Err: errors.New("plain")}
	must.True(t, cleanExitResult(plain) == plain)
	mustCleanAndCarry(t, cleanExitResult(&drivers.ExitResult{Err: errors.New(s)}).Err.Error())
	must.Nil(t, cleanExitResult(nil))
}

type stringer string

func (s stringer) String() string { return string(s) }

// The driver's log, which Nomad copies into the agent's log (where a value
// with a newline is written as it is), holds job text escaped: messages,
// keys and values, strings, errors, string lists and Stringers, and what
// With and Named add.
func TestCleanLogger(t *testing.T) {
	var buf bytes.Buffer
	base := hclog.New(&hclog.LoggerOptions{Output: &buf, Level: hclog.Trace})
	l := newCleanLogger(base)
	must.True(t, newCleanLogger(l) == l, must.Sprint("wrapped twice"))
	s := "x" + hostileText
	l = l.With("with", s).Named("n" + s)
	l.Info("message "+s, "str", s, "err", fmt.Errorf("wrapped: %w", errors.New(s)), "list", []string{"a", s},
		"stringer", stringer(s), "n", 3, "d", time.Second, "nil", nil)
	l.Warn("two", "k"+s, "v")
	l.Log(hclog.Error, "three", "v", s)
	out := buf.String()
	t.Logf("%s", out)
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	must.SliceLen(t, 3, lines, must.Sprint("a value with a newline was written over several lines"))
	for _, line := range lines {
		must.True(t, safetext.IsClean(line), must.Sprintf("raw terminal text in %q", line))
		must.StrContains(t, line, hostileMark)
	}
	must.StrContains(t, lines[0], "n=3")
	must.StrContains(t, lines[0], "d=1s")
}

// Every field of a task's config that a start error may quote, and the
// mounts, devices and user Nomad hands over from the job, each with the
// hostile text: the error through the Boundary is clean. The cases whose
// bare error held the text raw are counted: the Boundary is what cleaned
// them. (A volume's fs_type and mount_flags do not fail a start: they reach
// the plugin as written, and what the plugin answers is
// TestBoundary_pluginTextAndExitMessages's.)
func TestBoundary_everyJobField(t *testing.T) {
	h := hostileText
	vol := func(f func(*VolumeConfig)) TaskConfig {
		v := VolumeConfig{PluginID: "hp", VolumeID: "v1", Destination: "/data", AccessMode: "single-node-writer", AttachmentMode: "file-system"}
		f(&v)
		return TaskConfig{Command: "/bin/sleep", Volumes: map[string]VolumeConfig{"data": v}}
	}
	plugin := func(f func(*PluginTaskConfig)) TaskConfig {
		p := PluginTaskConfig{ID: "hp2", Type: "monolith", MountDir: "/csi"}
		f(&p)
		return TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &p}
	}
	cases := []struct {
		name string
		tc   TaskConfig
		cfg  func(*drivers.TaskConfig)
	}{
		{"cap_add", TaskConfig{Command: "/bin/true", CapAdd: []string{"sys_" + h}}, nil},
		{"cap_drop", TaskConfig{Command: "/bin/true", CapDrop: []string{"kill" + h}}, nil},
		{"pid_mode", TaskConfig{Command: "/bin/true", PIDMode: "host" + h}, nil},
		{"ipc_mode", TaskConfig{Command: "/bin/true", IPCMode: "host" + h}, nil},
		{"csi_plugin.id", plugin(func(p *PluginTaskConfig) { p.ID = "p" + h }), nil},
		{"csi_plugin.type", plugin(func(p *PluginTaskConfig) { p.Type = "node" + h }), nil},
		{"csi_plugin.mount_dir", plugin(func(p *PluginTaskConfig) { p.MountDir = "csi" + h }), nil},
		{"csi_plugin.health_timeout", plugin(func(p *PluginTaskConfig) { p.HealthTimeout = "1m" + h }), nil},
		{"volume.plugin_id", vol(func(v *VolumeConfig) { v.PluginID = "nope" + h }), nil},
		{"volume.volume_id", vol(func(v *VolumeConfig) { v.VolumeID = "v" + h }), nil},
		{"volume.destination", vol(func(v *VolumeConfig) { v.Destination = "data" + h }), nil},
		{"volume.access_mode", vol(func(v *VolumeConfig) { v.AccessMode = "rw" + h }), nil},
		{"volume.attachment_mode", vol(func(v *VolumeConfig) { v.AttachmentMode = "fs" + h }), nil},
		{"volume.secrets_file", vol(func(v *VolumeConfig) { v.SecretsFile = "s" + h }), nil},
		{"volume.capacity_min", vol(func(v *VolumeConfig) { v.Create = &VolumeCreateBlock{CapacityMin: "1G" + h} }), nil},
		{"mount", TaskConfig{Command: "/bin/true"}, func(c *drivers.TaskConfig) {
			c.Mounts = []*drivers.MountConfig{{TaskPath: "/m" + h, HostPath: "/tmp", PropagationMode: "x" + h}}
		}},
		{"device", TaskConfig{Command: "/bin/true"}, func(c *drivers.TaskConfig) {
			c.Devices = []*drivers.DeviceConfig{{TaskPath: "dev" + h, HostPath: "/dev/null"}}
		}},
		{"user", TaskConfig{Command: "/bin/true"}, func(c *drivers.TaskConfig) { c.User = "nobody" + h }},
	}
	// The wait is set before SetConfig: the volume manager reads it on
	// its own goroutine from then on.
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll},
		func(d *Driver) { d.pluginWait = 100 * time.Millisecond })
	withFakePlugins(t, d)
	b := d.Boundary()
	p := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p", "default", "plugin")
	_, _, err := d.StartTask(p)
	must.NoError(t, err)
	waitHealthy(t, d, "hp")
	// The user is looked up by the driver itself where denied_host_uids
	// is set (and by the supervisor, TestBoundary_jobFieldsReachNoTerminalRaw,
	// otherwise).
	denying := newTestDriver(t, Config{Enabled: true, DeniedHostUIDs: "0"})
	rawBefore := 0
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d, b := d, b
			if c.name == "user" {
				d, b = denying, denying.Boundary()
			}
			cfg := jobTask(t, c.tc, fmt.Sprintf("alloc-%d", i), "default", "hostile")
			if c.cfg != nil {
				c.cfg(cfg)
			}
			_, _, err := b.StartTask(cfg)
			must.Error(t, err, must.Sprint("the case's start did not fail: it proves nothing"))
			t.Logf("%v", err)
			must.True(t, safetext.IsClean(err.Error()), must.Sprintf("raw terminal text in %q", err))
			_, _, bare := d.StartTask(cfg)
			if bare != nil && !safetext.IsClean(bare.Error()) {
				rawBefore++
			}
		})
	}
	t.Logf("%d of %d fields reached the bare driver's error raw", rawBefore, len(cases))
}
