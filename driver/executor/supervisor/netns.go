package supervisor

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// A task in a group network namespace (Spec.NetNS, the file Nomad made for
// the allocation's network, as for exec in bridge mode) runs in it: its
// launching thread joins the namespace, and the task forked from that
// thread starts there. The thread joins it right after its unshare of the
// mount namespace, before the task's root is built, because a fresh sysfs
// shows the network devices of the namespace of the thread that mounts it:
// /sys/class/net in the task lists the group's interfaces, not the host's.
//
// A spare supervisor's prebuilt thread (see prebuilt) mounted its sysfs
// before its task was known, in the host's network namespace: a task with
// a network namespace of its own never takes it (see prebuilt.take), and
// its supervisor builds the namespace on a fresh thread instead. That costs
// such a task the few milliseconds the spare would have saved; joining late
// would need the sysfs remounted inside an entered, sealed root.
//
// Privileged tasks join the namespace too: it is Nomad's network for the
// group, and the host's view they keep is of files, not of the network.

// joinNetNS makes the calling thread join the network namespace at path
// ("" leaves it in the one it is in). It must run on a locked thread that
// is never unlocked, like the launching thread.
func joinNetNS(path string) error {
	if path == "" {
		return nil
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failed to open the task's network namespace %q: %w", path, err)
	}
	defer unix.Close(fd)
	// setns(2) refuses a file that is not a network namespace.
	if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("failed to join the task's network namespace %q: %w", path, err)
	}
	return nil
}
