//go:build e2e

package e2e

// secrets_file: a template block renders a volume's secrets into the
// task's secrets directory before the task starts; the driver reads them
// from there and the plugin gets them (the fixture, with --require-secret,
// refuses NodeStageVolume and NodePublishVolume without the right one).
// The secret is in no event, no agent log line and, once the volume is
// published, not in the journal. A path out of the task directory is
// refused, naming the field.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

func secretsTemplate(content string) string {
	return fmt.Sprintf("      template {\n        destination = \"secrets/vol.env\"\n        data        = %s\n      }\n", volHCLString(content))
}

func TestVolumeSecretsFile(t *testing.T) {
	t.Parallel()
	a := volAgent(t, false)
	canary := "canary-" + volUniq("sf")
	fx := a.StartVolFixture(t, "fxsec", VolFixtureOptions{Args: []string{"--require-secret", "token=" + canary}})

	vol := func(id, file string) VolSpec {
		return VolSpec{Name: "data", Plugin: fx.ID, ID: id, Dest: filepath.Join(volDir(a, id), "data"),
			Access: "single-node-writer", Create: true, CreateType: "dir", SecretsFile: file}
	}
	// The right secret, in a Nomad Variable of the job that the template
	// renders (so it is not in the job spec either): the task runs, and
	// while it does the journal no longer holds the secret.
	good := volUniq("sf-good")
	okJob, err := a.RenderVolJob(VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{vol(good, "secrets/vol.env")},
		Template: secretsTemplate("{{ with nomadVar \"nomad/jobs/JOBID\" }}token={{ .token }}{{ end }}\n")})
	must.NoError(t, err)
	varPath := "nomad/jobs/" + okJob.ID
	text, err := os.ReadFile(okJob.File)
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(okJob.File, []byte(strings.ReplaceAll(string(text), "nomad/jobs/JOBID", varPath)), 0o600))
	out, err := a.Nomad("var", "put", varPath, "token="+canary)
	must.NoError(t, err, must.Sprint(out))
	a.TrackJob(okJob.ID)
	out, err = a.Nomad("job", "run", "-detach", okJob.File)
	must.NoError(t, err, must.Sprint(out))
	okAlloc := a.WaitAlloc(t, okJob.ID, volTimeout, StatusRunning)
	must.StrContains(t, eventsText(okAlloc, "t"), `Published volume "data"`)
	var agentLog string
	journal := filepath.Join(a.DriverRoot, "journal", "journal.log")
	var held bool
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		b, err := os.ReadFile(journal)
		must.NoError(t, err)
		if held = strings.Contains(string(b), canary); !held {
			break
		}
	}
	must.False(t, held, must.Sprint("the journal still holds the secret of a published volume"))

	// A wrong secret: the plugin refuses it.
	wrong := volUniq("sf-wrong")
	wrongJob := a.RunVolJob(t, VolJob{Script: "echo SHOULD-NOT-RUN", Volumes: []VolSpec{vol(wrong, "secrets/vol.env")},
		Template: secretsTemplate("token=wrong-value\n")})
	wrongAlloc := a.WaitAlloc(t, wrongJob.ID, volTimeout, StatusFailed)
	must.StrContains(t, eventsText(wrongAlloc, "t"), `secret "token" is missing or wrong`)

	// Bad input, each named: a path out of the task directory, both ways
	// of giving secrets, a file that is not KEY=VALUE.
	bad := []struct {
		name, want string
		vol        VolSpec
		tmpl       string
	}{
		{"escape", `secrets_file "../../../../../etc/shadow" must not contain '..'`, vol(volUniq("sf-esc"), "../../../../../etc/shadow"), ""},
		{"absolute", `secrets_file "/etc/shadow" must be relative to the task directory`, vol(volUniq("sf-abs"), "/etc/shadow"), ""},
		{"both", "secrets and secrets_file are both set", func() VolSpec {
			v := vol(volUniq("sf-both"), "secrets/vol.env")
			v.Secrets = map[string]string{"token": "inline"}
			return v
		}(), secretsTemplate("token=x\n")},
		{"bad_format", `secrets_file "secrets/vol.env" line 1 is not KEY=VALUE`, vol(volUniq("sf-fmt"), "secrets/vol.env"), secretsTemplate("not-a-pair\n")},
	}
	var failed []*Allocation
	for _, b := range bad {
		t.Run(b.name, func(t *testing.T) {
			job := a.RunVolJob(t, VolJob{Script: "echo SHOULD-NOT-RUN", Volumes: []VolSpec{b.vol}, Template: b.tmpl})
			al := a.WaitAlloc(t, job.ID, volTimeout, StatusFailed)
			must.StrContains(t, eventsText(al, "t"), b.want, must.Sprint(al.Describe()))
			for _, e := range al.Events("t") {
				must.NotEq(t, "Started", e.Type, must.Sprint("the task started"))
			}
			failed = append(failed, al)
		})
	}

	// The secret is in no event and no line of the agent's log.
	for _, al := range append(failed, okAlloc, wrongAlloc) {
		var raw struct{ TaskStates json.RawMessage }
		must.NoError(t, a.GetJSON("/v1/allocation/"+al.ID, &raw))
		must.StrNotContains(t, string(raw.TaskStates), canary, must.Sprintf("the events of allocation %s show the secret", al.ID))
	}
	agentLog, err = a.ReadLog()
	must.NoError(t, err)
	must.StrContains(t, agentLog, wrongAlloc.ID, must.Sprint("the agent log does not name the failed allocation"))
	must.StrNotContains(t, agentLog, canary, must.Sprint("the agent log shows the secret"))
}
