//go:build e2e

package e2e

// Non-root writers: a task running as nobody writes a fresh volume, either
// because the driver gives the volume's root the task's group (mount_group
// = true, plugin without VOLUME_MOUNT_GROUP) or because the plugin does it
// from volume_mount_group (fixture with --mount-group). Without either, the
// same task cannot write: the negative check that shows the others prove
// something.

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// mgScript tries to write the volume at dest as the task's user and says
// how it went, with the owner, group and mode of the volume's root and of
// the file.
func mgScript(dest string) string {
	return fmt.Sprintf(`id; stat -c 'root %%u %%g %%a' %[1]s; if echo hi > %[1]s/by-task 2>/dev/null; then echo WROTE; stat -c 'file %%u %%g' %[1]s/by-task; else echo DENIED; fi`, dest)
}

func TestVolumeMountGroup(t *testing.T) {
	t.Parallel()
	a := volAgent(t, false)
	plain := a.StartVolFixture(t, "fxmg", VolFixtureOptions{})
	capable := a.StartVolFixture(t, "fxmgcap", VolFixtureOptions{Args: []string{"--mount-group"}})

	type run struct {
		name, want string
		vol        VolSpec
		job        Job
	}
	mk := func(name string, fx *VolFixture, typ string, mountGroup bool, want string) *run {
		id := volUniq("mg-" + name)
		dest := filepath.Join(volDir(a, id), "data")
		return &run{name: name, want: want, vol: VolSpec{Name: "data", Plugin: fx.ID, ID: id, Dest: dest,
			Access: "single-node-writer", Create: true, CreateType: typ, MountGroup: mountGroup}}
	}
	runs := []*run{
		// The driver applies the group to a real ext4 volume's root.
		mk("driver_applies_ext4", plain, "ext4", true, "WROTE"),
		mk("driver_applies_dir", plain, "dir", true, "WROTE"),
		// Negative: the same fresh volume without the option. (The
		// fixture's dir volumes are 0777: only ext4 makes this check.)
		mk("no_option_ext4", plain, "ext4", false, "DENIED"),
		// The plugin applies volume_mount_group: no option needed. The
		// plain fixture refuses volume_mount_group (InvalidArgument), so
		// the runs above also prove it is never sent to a plugin
		// without the capability.
		mk("plugin_applies", capable, "ext4", false, "WROTE"),
	}
	for _, r := range runs {
		r.job = a.RunVolJob(t, VolJob{User: "nobody", Script: mgScript(r.vol.Dest), Volumes: []VolSpec{r.vol}})
	}
	for _, r := range runs {
		t.Run(r.name, func(t *testing.T) {
			al := a.WaitAlloc(t, r.job.ID, volTimeout, StatusComplete)
			out := a.AllocLogs(t, al.ID, "t", false)
			t.Logf("%s:\n%s", r.name, out)
			must.StrContains(t, out, "uid=65534(nobody)")
			must.StrContains(t, out, r.want+"\n", must.Sprint(al.Describe()))
			// The hint before the failure: only the task that cannot
			// write its volume is told, before it starts, with both
			// fixes.
			hint := fmt.Sprintf(`Volume "data" (volume_id %q) is not writable by the task's user nobody (uid 65534, groups 65534): its root directory is owned by 0:0 with mode 0755.`, r.vol.ID)
			text := eventsText(al, "t")
			if r.want == "DENIED" {
				must.StrContains(t, text, hint, must.Sprint(al.Describe()))
				must.StrContains(t, text, "Set mount_group = true in the volume block")
				must.StrContains(t, text, "or set the task's user to one that can write it (its owner, uid 0)")
				// By the events' times, not their places in the list: the
				// driver's events reach Nomad on their own stream, apart
				// from StartTask's answer, and keep the time the driver
				// gave them; Started has the time Nomad heard the answer.
				var hinted, started int64
				for _, e := range al.Events("t") {
					if strings.Contains(e.Text(), "is not writable by the task's user") {
						hinted = e.Time
					}
					if e.Type == "Started" && started == 0 {
						started = e.Time
					}
				}
				must.Positive(t, started)
				must.Positive(t, hinted)
				must.Less(t, started, hinted, must.Sprint("the hint comes before the task starts"))
			} else {
				must.StrNotContains(t, text, "is not writable by the task's user", must.Sprint("a task that can write its volume is told it cannot"))
			}
			if r.want == "WROTE" {
				// The root is the task's group with setgid and g+rwx; what
				// the task made inherits the group.
				must.StrContains(t, out, "root 0 65534 2")
				must.StrContains(t, out, "file 65534 65534")
			}
		})
	}

	// Bad input: a clear error naming the field, and the task never runs.
	bad := []struct {
		name, user, want string
		vol              func(v *VolSpec)
	}{
		{"root_task", "root", `mount_group = true gives the volume the task's group, but the task runs as root`, func(*VolSpec) {}},
		{"read_only", "nobody", `mount_group = true makes the volume writable by the task's group, which a read-only volume cannot be`,
			func(v *VolSpec) { v.Access, v.ReadOnly = "single-node-reader-only", true }},
		{"block_device", "nobody", `mount_group = true cannot be used with attachment_mode = "block-device"`,
			func(v *VolSpec) { v.Attach, v.CreateType = "block-device", "ext4" }},
	}
	for _, b := range bad {
		t.Run("bad_"+b.name, func(t *testing.T) {
			r := mk("bad-"+strings.ReplaceAll(b.name, "_", "-"), plain, "dir", true, "")
			b.vol(&r.vol)
			job := a.RunVolJob(t, VolJob{User: b.user, Script: "echo SHOULD-NOT-RUN", Volumes: []VolSpec{r.vol}})
			al := a.WaitAlloc(t, job.ID, volTimeout, StatusFailed)
			must.StrContains(t, eventsText(al, "t"), b.want, must.Sprint(al.Describe()))
			for _, e := range al.Events("t") {
				must.NotEq(t, "Started", e.Type, must.Sprint("the task started"))
			}
		})
	}
}
