package wire

import (
	"fmt"
	"path/filepath"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// DefaultChrootEnv is what a task that is not privileged sees of the host
// when the operator does not set chroot_env: the same list as Nomad's exec
// driver, bound read-only instead of copied.
var DefaultChrootEnv = map[string]string{
	"/bin":                 "/bin",
	"/etc":                 "/etc",
	"/lib":                 "/lib",
	"/lib32":               "/lib32",
	"/lib64":               "/lib64",
	"/run/resolvconf":      "/run/resolvconf",
	"/sbin":                "/sbin",
	"/usr":                 "/usr",
	"/run/systemd/resolve": "/run/systemd/resolve",
}

// ReservedTarget says why a task that is not privileged cannot have a mount
// at target, or "" when it can: a mount on or above what the driver builds
// for the task would hide it (a host /dev with the host's terminals, the
// host's /proc or /sys).
func ReservedTarget(target string) string {
	t := filepath.Clean(target)
	for _, kept := range []string{"/proc", "/sys", "/dev/pts", "/dev/shm", "/dev/mqueue"} {
		if mounter.PathWithin(t, kept) || mounter.PathWithin(kept, t) {
			return fmt.Sprintf("mount target %q would hide the task's own %s", target, kept)
		}
	}
	return ""
}
