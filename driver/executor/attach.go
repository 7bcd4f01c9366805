package executor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// ReplaceMount gives the running task a fresh copy of what is mounted at
// source on the host now, in place of its own copy of an earlier mount at
// target (one of the task's mounts, found by its target in the task's
// spec, which lives outside the task's view, with the flags it had).
// readOnly makes the fresh mount read-only too (a volume's read_only is
// not in the spec: its mount comes with the late mounts). It is how a volume whose mount
// died (a FUSE plugin's daemon killed) and was published again on the host
// reaches a task that is still running: the task's mount namespace holds
// a copy of the dead mount, which no host mount reaches.
//
// The fresh tree is cloned on the host (open_tree), made read-only, nosuid
// and nodev as the task's mount was (nosuid and nodev always for an
// isolated task) and private, all before it is attached. Then, on a thread
// of its own that joins the task's mount namespace (whose root is the
// task's root), the dead mount at the target is detached lazily by its
// name inside its parent directory and the tree attached at the target,
// both reached from the task's root one element at a time without
// following any symlink: whatever the task did to the path meanwhile
// (a symlink in place of a directory, a directory moved away), nothing is
// ever detached or mounted outside the task's root, and a symlink on the
// way is an error. It returns the target inside the task.
func (p *Process) ReplaceMount(source, target string, readOnly bool) (string, error) {
	source = filepath.Clean(source)
	target = filepath.Clean("/" + target)
	var spec Spec
	if err := wire.ReadJSON(filepath.Join(p.state.StateDir, wire.SpecFile), &spec); err != nil {
		return "", fmt.Errorf("failed to replace the mount at %q in task pid %d: %w", target, p.state.TaskPID, err)
	}
	// A volume's source comes only with the late mounts (it is published
	// while the task is set up): the spec names its target and flags.
	var (
		mnt   Mount
		found bool
	)
	for _, m := range append(append([]Mount{}, spec.Mounts...), spec.LateMounts...) {
		if filepath.Clean("/"+m.Target) == target {
			mnt, found = m, true
		}
	}
	if !found {
		return "", fmt.Errorf("failed to replace the mount at %q in task pid %d: the task has no mount there", target, p.state.TaskPID)
	}
	if target == "/" {
		return "", fmt.Errorf("failed to replace the mount of %q in task pid %d: its target is the task's root", source, p.state.TaskPID)
	}
	fail := func(err error) (string, error) {
		return target, fmt.Errorf("failed to replace the mount at %q in task pid %d: %w", target, p.state.TaskPID, err)
	}
	if mnt.Propagation == PropagationBidirectional {
		// A peer of the host's source: the host's fresh mount reached the
		// task already, and detaching would take it.
		return fail(errors.New("a bidirectional mount is never replaced"))
	}

	p.mu.Lock()
	pidFD := -1
	if p.taskFD >= 0 {
		pidFD, _ = unix.FcntlInt(uintptr(p.taskFD), unix.F_DUPFD_CLOEXEC, 0)
	}
	p.mu.Unlock()
	if pidFD < 0 {
		return fail(errors.New("the task is not running"))
	}
	defer unix.Close(pidFD)
	nsFD, err := taskMountNS(pidFD, p.state.TaskPID)
	if err != nil {
		return fail(err)
	}
	defer unix.Close(nsFD)

	m := mounter.NewWithLogger(p.logger)
	tree, err := m.CloneTree(source, true)
	if err != nil {
		return fail(err)
	}
	defer tree.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(tree.Fd()), &st); err != nil {
		return fail(fmt.Errorf("the fresh mount at %q cannot be read: %w", source, err))
	}
	isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	noSuid, noDev := replaceFlags(mnt, spec.Isolation != nil, st.Mode)
	// A device node is read-only in a task that is not privileged, as at
	// its start (the supervisor's attachTree): not the task's to chmod.
	readOnly = wire.MountReadOnly(mnt.ReadOnly || readOnly, spec.Isolation != nil, st.Mode)
	if err := m.LockTree(tree, readOnly, noSuid, noDev); err != nil {
		return fail(err)
	}
	if err := m.PrivateTree(tree); err != nil {
		return fail(err)
	}

	errc := make(chan error, 1)
	go func() {
		// The thread joins the task's mount namespace and is never
		// unlocked: the runtime throws it away when this goroutine ends.
		runtime.LockOSThread()
		errc <- attachInTask(m, nsFD, tree, target, isDir)
	}()
	if err := <-errc; err != nil {
		return fail(err)
	}
	p.logger.Info("replaced a mount in the running task", "source", source, "target", target, "read_only", readOnly)
	return target, nil
}

// replaceFlags are the nosuid and nodev of a fresh copy of mnt, a tree
// whose root has mode: as the task's mount had them, and for an isolated
// task always nosuid, and nodev but for a block-device volume, as its first
// mount was (the driver's volumeMounts): the spec keeps a volume's target
// only, and a repaired block-device volume made nodev could no longer be
// opened by the task it was published for.
func replaceFlags(mnt Mount, isolated bool, mode uint32) (noSuid, noDev bool) {
	block := mode&unix.S_IFMT == unix.S_IFBLK
	return mnt.NoSuid || isolated, mnt.NoDev || (isolated && !block)
}

// taskMountNS opens the mount namespace the task's main process is in now
// and makes sure the driver may act in it. A task can move itself: with
// unprivileged user namespaces, `unshare -Urm` puts it in a mount namespace
// its own user namespace owns, where a mount moved in carries none of the
// locks a copied namespace puts on read-only, nosuid and nodev, so the task
// could make its read-only volume writable. Only a namespace owned by the
// driver's own user namespace, and not the driver's own mount namespace,
// is joined; anything else is refused, and the task keeps its dead mount
// until it restarts.
func taskMountNS(pidFD, pid int) (int, error) {
	nsFD, err := unix.Open(fmt.Sprintf("/proc/%d/ns/mnt", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("failed to open the task's mount namespace: %w", err)
	}
	// The pid is the task's only while its pidfd says it is alive: the
	// namespace was opened from the right process.
	if err := unix.PidfdSendSignal(pidFD, 0, nil, 0); err != nil {
		unix.Close(nsFD)
		return -1, fmt.Errorf("the task exited: %w", err)
	}
	same := func(a int, path string) (bool, error) {
		var sa, sb unix.Stat_t
		if err := unix.Fstat(a, &sa); err != nil {
			return false, err
		}
		if err := unix.Stat(path, &sb); err != nil {
			return false, err
		}
		return sa.Dev == sb.Dev && sa.Ino == sb.Ino, nil
	}
	if own, err := same(nsFD, "/proc/self/ns/mnt"); err != nil || own {
		unix.Close(nsFD)
		if err == nil {
			err = errors.New("the task runs in the driver's own mount namespace")
		}
		return -1, fmt.Errorf("refusing to replace a mount in the task's mount namespace: %w", err)
	}
	owner, err := unix.IoctlRetInt(nsFD, unix.NS_GET_USERNS)
	if err != nil {
		unix.Close(nsFD)
		return -1, fmt.Errorf("failed to find the owner of the task's mount namespace: %w", err)
	}
	defer unix.Close(owner)
	if ok, err := same(owner, "/proc/self/ns/user"); err != nil || !ok {
		unix.Close(nsFD)
		if err == nil {
			err = errors.New("the task moved into a mount namespace of a user namespace of its own (unshare): restart the task to get the volume back")
		}
		return -1, fmt.Errorf("refusing to replace a mount in the task's mount namespace: %w", err)
	}
	return nsFD, nil
}

// attachInTask runs on a locked thread that it moves into the mount
// namespace nsFD (from taskMountNS).
func attachInTask(m mounter.Interface, nsFD int, tree *os.File, target string, isDir bool) error {
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("failed to unshare the filesystem context: %w", err)
	}
	if err := unix.Setns(nsFD, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("failed to join the task's mount namespace: %w", err)
	}
	// The namespace's root is the task's root: "/" below is inside it.
	parent, err := m.OpenTarget("/", filepath.Dir(target), true)
	if err != nil {
		return err
	}
	err = m.DetachAt(parent, filepath.Base(target))
	_ = parent.Close()
	if err != nil {
		return err
	}
	tf, err := m.OpenTarget("/", target, isDir)
	if err != nil {
		return err
	}
	defer tf.Close()
	return m.AttachTreeAt(tree, tf)
}
