//go:build e2e

package e2e

import (
	"os"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// The version matrix (make e2e-matrix) runs the core cases against the
// agent in E2E_NOMAD_BIN and names its version in E2E_NOMAD_VERSION: the
// agent the cases ran against must say it is that version, so that a
// table row never reports a run against another agent.
func TestNomadVersion(t *testing.T) {
	want := strings.TrimPrefix(os.Getenv("E2E_NOMAD_VERSION"), "v")
	if want == "" {
		t.Skip("E2E_NOMAD_VERSION is not set (make e2e-matrix sets it)")
	}
	a := shared(t)
	var self struct {
		Config struct {
			Version struct{ Version string }
		}
	}
	must.NoError(t, a.GetJSON("/v1/agent/self", &self))
	must.Eq(t, want, self.Config.Version.Version, must.Sprintf("the agent at %s (%s)", a.Addr, NomadBinary(a.Root)))
	t.Logf("agent version %s", self.Config.Version.Version)
}
