package mounter

import (
	"fmt"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

func TestProbeKernel(t *testing.T) {
	// A kernel that knows the call refuses the bad descriptor.
	must.NoError(t, probeKernel(func(int, string, uint, *unix.MountAttr) error { return unix.EBADF }))
	err := probeKernel(func(int, string, uint, *unix.MountAttr) error { return unix.ENOSYS })
	must.ErrorContains(t, err, "has no mount_setattr(2)")
	must.ErrorContains(t, err, "Linux 5.12 or later")
}

func TestKernelSupport(t *testing.T) {
	// This host's own answer, against what uname says: before 5.12 the
	// call is missing.
	var u unix.Utsname
	must.NoError(t, unix.Uname(&u))
	release := unix.ByteSliceToString(u.Release[:])
	var major, minor int
	_, _ = fmt.Sscanf(release, "%d.%d", &major, &minor)
	err := KernelSupport()
	if major > 5 || major == 5 && minor >= 12 {
		must.NoError(t, err, must.Sprintf("Linux %s", release))
	} else {
		must.ErrorContains(t, err, "Linux "+release)
	}
}
