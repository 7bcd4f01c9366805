//go:build e2e

package e2e

import (
	"fmt"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// 21. Another namespace's volume, once its job is gone: namespace A
// creates a volume on the node, leaves a secret in it and stops (the
// volume is released: unpublished, unstaged). A job of namespace B then
// asks for it by the name A created it with, by the id the plugin gave
// it, and by look-alikes of both (another case, a trailing space). The
// first two are refused, naming both namespaces and
// allow_cross_namespace_volumes, before any task of B runs; the other
// case is another volume to the plugin (a new one) and never shows A's
// secret; the trailing space is refused before any plugin call, naming
// volume_id, so that a plugin that trims ids never sees it. TestPolicy
// covers the same refusal while A's task runs.
func TestEscapeNamespaceVolumes(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "escns", VolFixtureOptions{})
	u := escUniq()
	nsA, nsB := "esc-a-"+u, "esc-b-"+u
	for _, ns := range []string{nsA, nsB} {
		out, err := a.Nomad("namespace", "apply", "-description", "escape e2e", ns)
		must.NoError(t, err, must.Sprint(out))
	}
	run := func(t *testing.T, ns, volumeID string, create bool, script string) (*Allocation, string) {
		t.Helper()
		vars := map[string]string{"Namespace": ns, "PluginID": fx.ID, "VolumeID": volHCLString(volumeID),
			"Script": volHCLString(script), "Create": ""}
		if create {
			vars["Create"] = "true"
		}
		job, err := a.RenderJob("escape-ns-volume", vars)
		must.NoError(t, err)
		t.Cleanup(func() { stopNamespaced(t, a, ns, job.ID) })
		out, err := a.Nomad("job", "run", "-detach", job.File)
		must.NoError(t, err, must.Sprint(out))
		al := waitNamespacedAlloc(t, a, ns, job.ID, volTimeout, StatusComplete, StatusFailed)
		logs, err := a.Nomad("alloc", "logs", "-namespace", ns, al.ID, "t")
		if err != nil && !strings.Contains(logs, "not started yet") {
			t.Fatalf("nomad alloc logs -namespace %s %s t failed: %v\n%s", ns, al.ID, err, logs)
		}
		return al, logs
	}

	name, secret := "escape-ns-"+u, "NS-A-SECRET-"+u
	alA, out := run(t, nsA, name, true, fmt.Sprintf(`echo %s > /data/marker && echo written`, secret))
	if alA.ClientStatus != StatusComplete || !strings.Contains(out, "written") {
		t.Fatalf("namespace A's job did not write its secret (%s): %s\n%s", alA.ClientStatus, out, alA.Describe())
	}
	realID := fx.VolumeID(name)
	if realID == "" {
		t.Fatalf("the fixture has no volume named %s", name)
	}
	// A's job is gone: its volume is released, its ownership stays.
	stopNamespaced(t, a, nsA, alA.JobID)

	const reader = `cat /data/marker 2>&1; echo DONE`
	for _, c := range []struct {
		name     string
		volumeID string
		create   bool
		refused  bool // by the driver, naming the owner
		invalid  string
	}{
		{"create_name", name, true, true, ""},
		{"plugin_volume_id", realID, false, true, ""},
		{"name_other_case", strings.ToUpper(name), true, false, ""},
		{"plugin_volume_id_trailing_space", realID + " ", false, false,
			fmt.Sprintf(`volume "data": volume_id %q has leading or trailing white space`, realID+" ")},
	} {
		t.Run(c.name, func(t *testing.T) {
			al, out := run(t, nsB, c.volumeID, c.create, reader)
			text := eventsText(al, "t")
			t.Logf("namespace %s's task (%s) said %q; its events:\n%s", nsB, al.ClientStatus, out, text)
			if strings.Contains(out, secret) {
				t.Fatalf("ESCAPED: namespace %s read namespace %s's volume", nsB, nsA)
			}
			if c.invalid != "" {
				must.Eq(t, StatusFailed, al.ClientStatus)
				must.StrContains(t, text, c.invalid)
				must.SliceEmpty(t, fx.VolumeCalls(c.volumeID), must.Sprint("the plugin was called with the id"))
				return
			}
			if !c.refused {
				return
			}
			must.Eq(t, StatusFailed, al.ClientStatus)
			must.StrContains(t, text, fmt.Sprintf(`belongs to namespace %q`, nsA))
			must.StrContains(t, text, fmt.Sprintf(`not to namespace %q`, nsB))
			must.StrContains(t, text, "allow_cross_namespace_volumes = true")
		})
	}
}
