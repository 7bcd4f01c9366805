package shimtest_test

import (
	"os"
	"strings"
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/shimtest"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor"
)

// The shim the tests build, and the one make dev and make dist build,
// start at the seccomp stage's entry point: without it every task that is
// not privileged pays a Go runtime's start in its seccomp stage, and the
// tests of that entry point test nothing the driver ships.
func TestLDFlags(t *testing.T) {
	must.StrHasSuffix(t, " -E "+supervisor.StageEntrySymbol, shimtest.LDFlags)
	mk, err := os.ReadFile("../../../GNUmakefile")
	must.NoError(t, err)
	must.StrContains(t, string(mk), "SHIM_LDFLAGS := "+shimtest.LDFlags+"\n")
	builds := 0
	for _, line := range strings.Split(string(mk), "\n") {
		if strings.Contains(line, "go build") && strings.Contains(line, "./driver/executor/shim") {
			builds++
			must.StrContains(t, line, `-ldflags "$(SHIM_LDFLAGS)"`, must.Sprintf("a shim built without the stage's entry point: %s", line))
		}
	}
	must.Eq(t, 2, builds, must.Sprint("make dev and make dist build the shim"))
	// The cgroup v2 run builds its own.
	run, err := os.ReadFile("../../../e2e/cgroup2/run.sh")
	must.NoError(t, err)
	must.StrContains(t, string(run), `-ldflags "`+shimtest.LDFlags+`"`)
	// So does the arm64 guest's (make stage-arm64).
	run, err = os.ReadFile("../../../e2e/arm64/run.sh")
	must.NoError(t, err)
	must.StrContains(t, string(run), `ldflags="`+shimtest.LDFlags+`"`)
	must.StrContains(t, string(run), `go build -trimpath -ldflags "$ldflags"`)
}
