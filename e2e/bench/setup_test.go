//go:build e2e

package bench

import (
	"os"
	"testing"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

// setup is the start of every benchmark here: it runs once whatever b.N,
// checks what the agent needs, sweeps what an earlier run left, and builds
// the driver (unless E2E_SKIP_BUILD is set) and whatever else build lists.
// It returns the repository's root.
func setup(b *testing.B, build ...func(root string) error) string {
	b.Helper()
	if b.N > 1 {
		b.Skip("runs once; use -benchtime 1x")
	}
	root, err := e2e.RepoRoot()
	if err != nil {
		b.Fatal(err)
	}
	if err := e2e.CheckPrerequisites(root); err != nil {
		b.Fatal(err)
	}
	e2e.SweepStale(b.Logf)
	if os.Getenv("E2E_SKIP_BUILD") == "" {
		for _, step := range append([]func(string) error{e2e.BuildDriver}, build...) {
			if err := step(root); err != nil {
				b.Fatal(err)
			}
		}
	}
	return root
}
