//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
	escNamespaces(t, a, nsA, nsB)
	name, secret := "escape-ns-"+u, "NS-A-SECRET-"+u
	alA, out := escNSRun(t, a, fx, nsA, name, true, fmt.Sprintf(`echo %s > /data/marker && echo written`, secret))
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
			al, out := escNSRun(t, a, fx, nsB, c.volumeID, c.create, reader)
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
			escNSRefused(t, al, nsA, nsB)
		})
	}
}

// 21b. A failed setup claims nothing: a volume made at the plugin outside
// Nomad (with csc, on the plugin's socket), its id known to namespaces A
// and B and not used on the node yet. A job of B names it and the plugin
// refuses B's NodeStageVolume (PermissionDenied, as for wrong secrets):
// the job fails, and its namespace must not become the volume's owner, or
// any namespace could have another's volumes refused on a node for good
// with calls bound to fail. A job of A then runs with the volume and
// reads what it holds. Once A had it published, the volume is A's: a job
// of B is refused, naming both namespaces, before any plugin call.
func TestEscapeNamespaceFailedSetup(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	csc := csiBin(t, "csc")
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "escfail", VolFixtureOptions{})
	u := escUniq()
	nsA, nsB := "esc-a-"+u, "esc-b-"+u
	escNamespaces(t, a, nsA, nsB)

	name, content := "escape-fail-"+u, "NS-A-DATA-"+u
	sock := filepath.Join(a.DriverRoot, "plugins", fx.ID, "csi.sock")
	out, err := csiRun(time.Minute, nil, csc, "controller", "create-volume",
		"--cap", "MULTI_NODE_MULTI_WRITER,mount,", "--endpoint", "unix://"+sock, name)
	must.NoError(t, err, must.Sprintf("csc controller create-volume: %s", out))
	id := strings.Trim(strings.Fields(out)[0], `"`)
	must.Eq(t, fx.VolumeID(name), id, must.Sprintf("csc said %q", out))
	err = os.WriteFile(filepath.Join(fx.StateDir, "volumes", id, "marker"), []byte(content+"\n"), 0o644)
	must.NoError(t, err, must.Sprint("failed to seed the volume"))
	const reader = `cat /data/marker 2>&1; echo DONE`

	// B's setup fails at the plugin.
	must.NoError(t, fx.SetFaults("NodeStageVolume "+id+" fail PermissionDenied"))
	t.Cleanup(func() {
		if err := fx.ClearFaults(); err != nil {
			t.Errorf("failed to clear the fault rules: %v", err)
		}
	})
	alB, outB := escNSRun(t, a, fx, nsB, id, false, reader)
	textB := eventsText(alB, "t")
	t.Logf("namespace %s's failing task (%s) said %q; its events:\n%s", nsB, alB.ClientStatus, outB, textB)
	must.Eq(t, StatusFailed, alB.ClientStatus)
	must.StrNotContains(t, outB, content)
	must.StrContains(t, textB, "refused the credentials", must.Sprint("not the plugin's refusal"))
	must.Positive(t, fx.Count("NodeStageVolume", id), must.Sprint("NodeStageVolume was never called for B"))
	must.NoError(t, fx.ClearFaults())
	if left := a.WaitVolJournalClear(volTimeout, id); len(left) > 0 {
		t.Fatalf("the failed setup left journal records: %v", left)
	}

	// A uses its volume on the node.
	alA, outA := escNSRun(t, a, fx, nsA, id, false, reader)
	if alA.ClientStatus != StatusComplete || !strings.Contains(outA, content) {
		t.Fatalf("namespace %s's job did not read its volume after namespace %s's failed setup (%s): %q\n%s",
			nsA, nsB, alA.ClientStatus, outA, eventsText(alA, "t"))
	}
	t.Logf("namespace %s's task said %q", nsA, outA)
	stopNamespaced(t, a, nsA, alA.JobID)

	// Published once, the volume is A's for good.
	stages := fx.Count("NodeStageVolume", id)
	al, outB := escNSRun(t, a, fx, nsB, id, false, reader)
	if strings.Contains(outB, content) {
		t.Fatalf("ESCAPED: namespace %s read namespace %s's volume", nsB, nsA)
	}
	t.Logf("namespace %s's task (%s) said %q; its events:\n%s", nsB, al.ClientStatus, outB, eventsText(al, "t"))
	escNSRefused(t, al, nsA, nsB)
	must.Eq(t, stages, fx.Count("NodeStageVolume", id), must.Sprint("the plugin was called for the refused job"))
}

// escNamespaces creates the Nomad namespaces.
func escNamespaces(t *testing.T, a *Agent, names ...string) {
	t.Helper()
	for _, ns := range names {
		out, err := a.Nomad("namespace", "apply", "-description", "escape e2e", ns)
		must.NoError(t, err, must.Sprint(out))
	}
}

// escNSRun runs job escape-ns-volume in namespace ns: script in task "t"
// with volume_id volumeID of fx at /data (created when create is set), and
// waits until it completes or fails. It returns the allocation and what
// the task printed.
func escNSRun(t *testing.T, a *Agent, fx *VolFixture, ns, volumeID string, create bool, script string) (*Allocation, string) {
	t.Helper()
	vars := map[string]string{"Namespace": ns, "PluginID": fx.ID, "VolumeID": volHCLString(volumeID),
		"Script": volHCLString(script), "Create": "", "Node": "", "User": ""}
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

// escNSRefused fails t unless al failed with the driver's refusal of a
// volume of namespace owner to namespace other.
func escNSRefused(t *testing.T, al *Allocation, owner, other string) {
	t.Helper()
	text := eventsText(al, "t")
	must.Eq(t, StatusFailed, al.ClientStatus, must.Sprint(text))
	must.StrContains(t, text, fmt.Sprintf(`belongs to namespace %q`, owner))
	must.StrContains(t, text, fmt.Sprintf(`not to namespace %q`, other))
	must.StrContains(t, text, "allow_cross_namespace_volumes = true")
}
