// Package shimtest builds the supervisor shim for tests and benchmarks the
// way make dev builds it: static, stripped, with the seccomp stage's entry
// point (supervisor.StageEntrySymbol). Only tests import it.
package shimtest

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// Package is the shim's import path.
const Package = "github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/shim"

// LDFlags are the linker flags make dev and make dist build the shim with:
// its entry point is supervisor.StageEntrySymbol (spelled out here, since
// the supervisor's own tests import this package; TestLDFlags checks it).
const LDFlags = "-s -w -E github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor.stageEntry"

// PrebuiltEnv names, in the environment, a shim built as make builds it
// for this machine's architecture, which Build returns instead of building
// one: for a test binary run where there is no go command (the arm64 guest
// of e2e/arm64/run.sh). It must be in a directory every user may search.
const PrebuiltEnv = "SHIMTEST_PREBUILT"

// Build builds the shim for goarch ("" for this machine's), with the
// build tags of the calling tests (see buildTags), into a new
// directory that every user may search (a task's seccomp stage runs from
// it, as the task's user), removed when t ends. It skips t without the go
// command, unless PrebuiltEnv names the shim for this machine.
func Build(t testing.TB, goarch string) string {
	t.Helper()
	if p := os.Getenv(PrebuiltEnv); p != "" && (goarch == "" || goarch == runtime.GOARCH) {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%s: %v", PrebuiltEnv, err)
		}
		return p
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command to build the shim")
	}
	dir, err := os.MkdirTemp("", "shim-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "nomad-driver-csi-shim")
	args := []string{"build", "-trimpath", "-ldflags", LDFlags, "-o", out}
	if buildTags != "" {
		args = append(args, "-tags", buildTags)
	}
	cmd := exec.Command(goBin, append(args, Package)...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if goarch != "" {
		cmd.Env = append(cmd.Env, "GOARCH="+goarch)
	}
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v: %s", Package, err, b)
	}
	return out
}
