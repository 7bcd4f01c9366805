package wire

import (
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"

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

// MountReadOnly says whether a task's mount of a tree whose root has mode
// is read-only: when asked (readOnly), and always for a device node
// (character or block: one of the task's /dev, a device Nomad hands over,
// a block-device volume) in an isolated task. The node is the host's own
// inode, whose mode, owner and times a root task (CHOWN, FOWNER) would
// otherwise change on the host (mode 0666 on a volume's node gives every
// user of the host its device; mode 000 on /dev/null breaks the node). The
// device is still read and written through a read-only mount: what the
// task may do with it is the device filter's to say. A privileged task,
// which could remount it and has the host's /dev, gets it as asked.
// attachTree and ReplaceMount, which bind what they are handed, ask this;
// the nodes of an isolated task's own /dev (buildDev) are bound read-only
// whatever they turn out to be.
func MountReadOnly(readOnly, isolated bool, mode uint32) bool {
	device := mode&unix.S_IFMT == unix.S_IFCHR || mode&unix.S_IFMT == unix.S_IFBLK
	return readOnly || isolated && device
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
