package supervisor

import (
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
)

// The terminal the exec stage takes is checked to be one the task's
// device filter lets the task open: across the majors devices.txt gives
// Unix98 PTY slaves (136-143), the check and cgroups.DefaultDevices agree.
func TestIsPtsDevice_AgreesWithDeviceFilter(t *testing.T) {
	allowed := func(major, minor uint32) bool {
		for _, r := range cgroups.DefaultDevices {
			if r.Type == 'c' && (r.Major == -1 || r.Major == int64(major)) && (r.Minor == -1 || r.Minor == int64(minor)) {
				return true
			}
		}
		return false
	}
	for major := uint32(136); major <= 143; major++ {
		for _, minor := range []uint32{0, 255, 1<<20 - 1} {
			must.Eq(t, allowed(major, minor), isPtsDevice(major, minor),
				must.Sprintf("device %d:%d: the filter allows it: %v", major, minor, allowed(major, minor)))
		}
	}
	must.True(t, isPtsDevice(136, 3))
}
