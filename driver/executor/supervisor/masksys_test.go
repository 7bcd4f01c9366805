package supervisor

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// maskSys hides each part of /sys that a task does not see and the host
// has, under an empty read-only tmpfs: the firmware tables and the power
// meters of powercap (Intel RAPL's energy counters, root's alone since
// they were shown to leak what a CPU computes, which a root task reads),
// as Docker and runc mask them. What the host lacks is skipped.
func TestMaskSys_HidesFirmwareAndPowercap_Fake(t *testing.T) {
	sys := t.TempDir()
	for _, d := range []string{"firmware", "devices/virtual/powercap", "devices/virtual/net"} {
		must.NoError(t, os.MkdirAll(filepath.Join(sys, d), 0o755))
	}
	f := mounter.NewFake(mounter.MountPoint{ID: 1, Path: "/"})
	must.NoError(t, maskSys(f, sys))
	masked := map[string]bool{}
	for _, a := range f.GetActions() {
		must.Eq(t, mounter.ActionMount, a.Kind)
		must.Eq(t, "tmpfs", a.FSType)
		masked[a.Target] = true
	}
	must.MapContainsKeys(t, masked, []string{filepath.Join(sys, "firmware"), filepath.Join(sys, "devices/virtual/powercap")})
	must.MapLen(t, 2, masked)
}
