//go:build e2e

package e2e

import (
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// 22. A plugin that echoes its request: the operator's plugin (the
// fixture with --echo-secrets) refuses NodeStageVolume with a message
// holding the volume's secrets verbatim, Go-quoted (%q) and JSON-encoded,
// as careless plugins print a request. The job's secret has a quote, a
// backslash, a tab and a non-ASCII letter, so each form spells it
// differently. No form of it reaches the task's events, `nomad alloc
// status` or the agent's log (which carries the driver's): secrets from a
// secrets_file (Vault, a template) are in no job spec, and these are
// readable by whoever may read the job. The secret's middle, letters and
// digits only, is what is looked for: any form that was not redacted
// keeps it.
func TestEscapeSecretsEchoedByPlugin(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "escecho", VolFixtureOptions{Args: []string{"--echo-secrets"}})
	u := escUniq()
	core := "ECHOED" + u
	secret := `q"` + core + "\\x\té"
	job := escRun(t, a, escJob{Script: `echo ran`,
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: "escape-echo-" + u, Dest: "/data",
			Create: true, CreateType: "dir", Secrets: map[string]string{"token": secret}}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusFailed)
	events := eventsText(al, "t")
	status, err := a.Nomad("alloc", "status", "-verbose", al.ID)
	must.NoError(t, err, must.Sprint(status))
	log, err := a.ReadLog()
	must.NoError(t, err)
	t.Logf("the task's events:\n%s", events)
	// The plugin's message reached the events: the check below means
	// something.
	must.StrContains(t, events, "refusing secrets token=")
	must.StrContains(t, log, al.ID, must.Sprint("the agent log does not name the allocation"))
	for what, text := range map[string]string{"the task's events": events, "nomad alloc status": status, "the agent log": log} {
		if strings.Contains(text, core) {
			i := strings.Index(text, core)
			t.Errorf("LEAKED: %s show the volume's secret: ...%s...", what, text[max(0, i-40):min(len(text), i+len(core)+20)])
		}
	}
}
