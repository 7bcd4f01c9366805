//go:build e2e

package e2e

import (
	"strings"
	"testing"
)

// escVolFlagsScript prints, for each destination given, the per-mount
// options of the task's mount there ("MOUNT <dest> rw,nosuid,nodev,..."),
// as the task's own /proc/self/mountinfo says (field 5 is the mount
// point, field 6 its options).
const escVolFlagsScript = escWho + `for d in "$@"; do
  echo "MOUNT $d $(awk -v d="$d" '$5 == d { o = $6 } END { print o }' /proc/self/mountinfo)"
done
echo DONE
`

// 19. Mount options from the job: a non-privileged job asks its plugin
// for mount_flags "suid", "dev" and "exec" (which the fixture, as most
// plugins, passes to mount(2) as they are), and also takes a volume
// without any flags (the fixture binds a directory of the host's root
// filesystem, which is neither nosuid nor nodev). In the task, each
// volume's mount must be nosuid and nodev whatever the job and the plugin
// said: a suid binary or a device node in a volume is how a task reaches
// the host once another layer (no_new_privs, the device filter) slips.
func TestEscapeVolumeMountFlags(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	// The operator runs its plugin privileged; the attacker's job is not.
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "escflags", VolFixtureOptions{})
	u := escUniq()
	for _, user := range []string{"", "root"} {
		t.Run("user_"+map[string]string{"": "unset", "root": "root"}[user], func(t *testing.T) {
			job := escRun(t, a, escJob{User: user, Script: escVolFlagsScript, Args: []string{"/smuggled", "/plain"},
				Volumes: []VolSpec{
					{Name: "smuggled", Plugin: fx.ID, ID: "escape-flags-s-" + user + u, Dest: "/smuggled",
						Create: true, CreateType: "dir", MountFlags: []string{"suid", "dev,exec"}},
					{Name: "plain", Plugin: fx.ID, ID: "escape-flags-p-" + user + u, Dest: "/plain",
						Create: true, CreateType: "dir"},
				}})
			al := a.WaitAlloc(t, job.ID, volTimeout, StatusComplete, StatusFailed)
			out := escRead(t, a, al.ID, "t", false)
			t.Logf("the task said:\n%s", out)
			if !strings.Contains(out, "DONE") {
				t.Fatalf("the task did not finish its script:\n%s", al.Describe())
			}
			for _, dest := range []string{"/smuggled", "/plain"} {
				opts := escMountOptions(out, dest)
				if opts == nil {
					t.Errorf("%s: the task has no mount there", dest)
					continue
				}
				for _, want := range []string{"nosuid", "nodev"} {
					if !opts[want] {
						t.Errorf("ESCAPED: %s is mounted without %s in a non-privileged task (options %v)", dest, want, opts)
					}
				}
			}
		})
	}
}

// escMountOptions returns the options of the "MOUNT <dest> <options>"
// line in out, or nil when there is none or it is empty.
func escMountOptions(out, dest string) map[string]bool {
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == "MOUNT" && f[1] == dest {
			opts := map[string]bool{}
			for _, o := range strings.Split(f[2], ",") {
				opts[o] = true
			}
			return opts
		}
	}
	return nil
}
