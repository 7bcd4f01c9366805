//go:build e2e

package e2e

// The operator CLI in the driver's binary, run as an operator would on a
// client whose agent runs a volume task: volumes reads the journal beside
// the running driver and lists the volume by the volume_id its job wrote,
// probe and stats ask the plugin task through its socket under root_dir
// (stats by that name too, choosing among plugins that share it), cleanup
// only looks.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// runDriverCLI runs the driver binary as a person would: without Nomad's
// plugin handshake in its environment.
func runDriverCLI(t *testing.T, a *Agent, args ...string) (string, string, error) {
	t.Helper()
	cmd := exec.Command(filepath.Join(PluginDir(a.Root), "nomad-driver-csi"), args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "NOMAD_PLUGIN_MAGIC_COOKIE=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	return out.String(), errOut.String(), err
}

func TestCLI(t *testing.T) {
	a := volAgent(t, false)
	fx := a.StartVolFixture(t, "clifx", VolFixtureOptions{})
	name := volUniq("cli")
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{
		Type:   "service",
		Script: fmt.Sprintf("echo ready > %s/f && sleep 600", dest),
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer",
			Create: true, CreateType: "dir"}},
	})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	volID := fx.VolumeID(name)
	must.NotEq(t, "", volID)

	out, errOut, err := runDriverCLI(t, a)
	must.NoError(t, err, must.Sprint(errOut))
	must.StrHasPrefix(t, "Usage: nomad-driver-csi", out)

	out, errOut, err = runDriverCLI(t, a, "volumes", "-json", "-root-dir", a.DriverRoot)
	must.NoError(t, err, must.Sprint(errOut))
	var vols struct {
		Volumes []struct {
			PluginID string   `json:"plugin_id"`
			VolumeID string   `json:"volume_id"`
			Names    []string `json:"names"`
			Stage    string   `json:"stage"`
			Tasks    []struct {
				TaskID string `json:"task_id"`
				State  string `json:"state"`
				Target string `json:"target"`
			} `json:"tasks"`
		} `json:"volumes"`
	}
	must.NoError(t, json.Unmarshal([]byte(out), &vols), must.Sprint(out))
	found := false
	for _, v := range vols.Volumes {
		if v.VolumeID != volID {
			continue
		}
		found = true
		must.Eq(t, fx.ID, v.PluginID)
		must.Eq(t, []string{name}, v.Names)
		must.Eq(t, "staged", v.Stage)
		must.SliceLen(t, 1, v.Tasks)
		must.StrHasPrefix(t, al.ID, v.Tasks[0].TaskID)
		must.Eq(t, "published", v.Tasks[0].State)
		must.SliceContains(t, a.VolMounts(), v.Tasks[0].Target)
	}
	must.True(t, found, must.Sprintf("volume %s not in %s", volID, out))

	out, errOut, err = runDriverCLI(t, a, "volumes", "-root-dir", a.DriverRoot)
	must.NoError(t, err, must.Sprint(errOut))
	t.Logf("volumes:\n%s", out)
	// The name the job wrote, next to the plugin's id.
	must.NotEq(t, name, volID)
	must.StrContains(t, out, "Volume "+name+" (plugin "+fx.ID+", plugin's volume ID "+volID+")")

	out, errOut, err = runDriverCLI(t, a, "probe", fx.ID, "-root-dir", a.DriverRoot)
	must.NoError(t, err, must.Sprint(errOut))
	must.StrContains(t, out, "fixture.csi.nomad-driver-csi")
	must.StrContains(t, out, "e2e-node")
	must.StrContains(t, out, "GET_VOLUME_STATS")
	t.Logf("probe %s:\n%s", fx.ID, out)

	for _, arg := range []string{volID, name} {
		out, errOut, err = runDriverCLI(t, a, "stats", arg, "-root-dir", a.DriverRoot)
		must.NoError(t, err, must.Sprint(errOut))
		must.StrContains(t, out, "Volume "+name+" (plugin "+fx.ID+", plugin's volume ID "+volID+"), task ")
		must.StrContains(t, out, "bytes")
		must.StrContains(t, out, "Condition normal")
	}

	// A second plugin with a volume of the same name: the name is
	// ambiguous, the error lists both, and -plugin chooses.
	fx2 := a.StartVolFixture(t, "clifx2", VolFixtureOptions{})
	dest2 := filepath.Join(volDir(a, name+"-2"), "data")
	job2 := a.RunVolJob(t, VolJob{
		Type:   "service",
		Script: fmt.Sprintf("echo ready > %s/f && sleep 600", dest2),
		Volumes: []VolSpec{{Name: "data", Plugin: fx2.ID, ID: name, Dest: dest2, Access: "single-node-writer",
			Create: true, CreateType: "dir"}},
	})
	a.WaitAlloc(t, job2.ID, volTimeout, StatusRunning)
	volID2 := fx2.VolumeID(name)
	_, errOut, err = runDriverCLI(t, a, "stats", name, "-root-dir", a.DriverRoot)
	must.Error(t, err)
	must.StrContains(t, errOut, fmt.Sprintf("%q names more than one published volume", name))
	must.StrContains(t, errOut, fmt.Sprintf(`plugin %q volume ID %q (created as %q)`, fx.ID, volID, name))
	must.StrContains(t, errOut, fmt.Sprintf(`plugin %q volume ID %q (created as %q)`, fx2.ID, volID2, name))
	must.StrContains(t, errOut, "choose one with -plugin or -namespace")
	out, errOut, err = runDriverCLI(t, a, "stats", name, "-plugin", fx2.ID, "-root-dir", a.DriverRoot)
	must.NoError(t, err, must.Sprint(errOut))
	must.StrContains(t, out, "Volume "+name+" (plugin "+fx2.ID+", plugin's volume ID "+volID2+"), task ")

	// Beside the running driver cleanup only looks, and -apply refuses.
	out, errOut, err = runDriverCLI(t, a, "cleanup", "-root-dir", a.DriverRoot)
	must.NoError(t, err, must.Sprint(errOut))
	must.StrContains(t, out, "The driver is running")
	must.StrContains(t, out, "Orphan volume mounts: none")
	_, errOut, err = runDriverCLI(t, a, "cleanup", "-apply", "-root-dir", a.DriverRoot)
	must.Error(t, err)
	must.StrContains(t, errOut, "the driver holds the volume journal's lock")

	_, errOut, err = runDriverCLI(t, a, "probe", "no-such-plugin", "-root-dir", a.DriverRoot)
	must.Error(t, err)
	must.StrContains(t, errOut, `no plugin task "no-such-plugin" on this node`)
}
