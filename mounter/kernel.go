package mounter

import (
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// KernelSupport is nil when the kernel has every mount call the driver
// makes, or one sentence naming the first it lacks. The newest is
// mount_setattr(2) (Linux 5.12): it sets a task's mounts read-only,
// nosuid and nodev, whole trees at once; open_tree(2) and move_mount(2)
// (5.2) are older. Without it a task would start with some of its mounts
// set and others not, so the driver starts none (see the README's
// Requirements). The answer is probed once, with a call the kernel refuses
// for its bad descriptor when it knows the call and with ENOSYS when not.
func KernelSupport() error {
	kernelOnce.Do(func() { kernelErr = probeKernel(unix.MountSetattr) })
	return kernelErr
}

var (
	kernelOnce sync.Once
	kernelErr  error
)

// probeKernel is KernelSupport with the call passed in, for tests.
func probeKernel(setattr func(dirfd int, path string, flags uint, attr *unix.MountAttr) error) error {
	err := setattr(-1, "", unix.AT_EMPTY_PATH, &unix.MountAttr{})
	if !errors.Is(err, unix.ENOSYS) {
		return nil
	}
	release := "unknown"
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		release = unix.ByteSliceToString(u.Release[:])
	}
	return fmt.Errorf("the kernel (Linux %s) has no mount_setattr(2), which the csi driver needs to make a task's mounts read-only, nosuid and nodev: it needs Linux 5.12 or later", release)
}
