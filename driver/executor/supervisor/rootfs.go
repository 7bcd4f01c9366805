package supervisor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// devNodes are the host's device nodes bound into a task's /dev: the
// minimal set every program may expect. The device filter of the task's
// cgroup allows exactly these (and what Nomad hands over).
var devNodes = []string{"null", "zero", "full", "random", "urandom", "tty"}

// devLinks are the symlinks of a task's /dev.
var devLinks = [][2]string{
	{"/proc/self/fd", "fd"},
	{"/proc/self/fd/0", "stdin"},
	{"/proc/self/fd/1", "stdout"},
	{"/proc/self/fd/2", "stderr"},
	{"pts/ptmx", "ptmx"},
}

// taskPtyMax is the most terminals a task's devpts holds. The kernel
// gives all devpts instances but the host's kernel.pty.max less
// kernel.pty.reserve (3072 by default) together.
const taskPtyMax = 128

// ttyGID is the group of the terminals of a task's devpts: 5, tty's by
// convention (Debian's base-passwd, the kernel's docs, runc's default).
const ttyGID = 5

// procReadOnly are parts of /proc a task may read but never write: a root
// task could otherwise change the host's kernel settings (/proc/sys, such
// as kernel.core_pattern, which runs a program on the host) or reboot it
// (/proc/sysrq-trigger), since these check only file permissions.
var procReadOnly = []string{"bus", "fs", "irq", "sys", "sysrq-trigger"}

// procMasked are parts of /proc a task does not see at all: kernel memory
// and keys, timing details of every process on the host, the counts of
// every interrupt of every device and CPU of the host (another task's
// disk and network traffic, timed by sampling them), its sound cards, and
// the state of every physical page of the host and the control group
// (another task's) it is charged to (kpage*, guarded by their mode alone:
// a root task reads them), and the kernel's own allocations: the slab
// caches' fill (slabinfo: what a heap exploit grooms by), the kernel's
// vmalloc areas with their callers and sizes (vmallocinfo), and the free
// pages by type (pagetypeinfo, whose read holds each zone's lock for
// long: made root's alone for that). All three are 0400, root's.
var procMasked = []string{"kcore", "keys", "timer_list", "sched_debug", "latency_stats", "acpi", "scsi",
	"interrupts", "asound", "kpageflags", "kpagecount", "kpagecgroup", "slabinfo", "vmallocinfo", "pagetypeinfo"}

// buildIsolatedRoot assembles the root of a task that is not privileged at
// root, in the task's mount namespace, before pivot_root: a tmpfs holding
// the chroot_env binds (read-only, nosuid, nodev), a minimal /dev, /proc
// for the calling thread's PID namespace, a read-only /sys and a /tmp.
// Nothing else of the host is there. Mounts of the task (Nomad's
// directories, volumes) are attached later, inside this root.
//
// The calling thread must be in the task's IPC namespace already, since
// /dev/mqueue belongs to the IPC namespace of whoever mounts it, and its
// active PID namespace must be the task's (the supervisor's own), since
// /proc shows the PID namespace of whoever mounts it.
func buildIsolatedRoot(m mounter.Interface, root string, iso *wire.Isolation) error {
	if err := mountRootTmpfs(m, root); err != nil {
		return err
	}
	if err := bindChrootEnv(m, root, iso.ChrootEnv); err != nil {
		return err
	}
	return buildKernelDirs(m, root, iso)
}

// buildKernelDirs makes an isolated task's /dev, /proc and /sys at root.
func buildKernelDirs(m mounter.Interface, root string, iso *wire.Isolation) error {
	if err := buildDev(m, root, iso.PrivateIPC); err != nil {
		return fmt.Errorf("failed to make the task's /dev: %w", err)
	}
	if err := buildProc(m, root, iso.PrivatePID); err != nil {
		return fmt.Errorf("failed to make the task's /proc: %w", err)
	}
	if err := buildSys(m, root); err != nil {
		return fmt.Errorf("failed to make the task's /sys: %w", err)
	}
	return nil
}

// bindChrootEnv binds each chroot_env entry, parents before children. A
// host path that is a symlink and keeps its name in the task (/lib ->
// usr/lib on merged-/usr hosts) is copied as the symlink; under another
// name its target is bound.
func bindChrootEnv(m mounter.Interface, root string, env map[string]string) error {
	type entry struct{ src, dst string }
	entries := make([]entry, 0, len(env))
	for src, dst := range env {
		entries = append(entries, entry{filepath.Clean(src), filepath.Clean(dst)})
	}
	sort.Slice(entries, func(i, j int) bool {
		if di, dj := depth(entries[i].dst), depth(entries[j].dst); di != dj {
			return di < dj
		}
		return entries[i].dst < entries[j].dst
	})
	for _, e := range entries {
		fi, err := os.Lstat(e.src)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("chroot_env %q: %w", e.src, err)
		}
		if fi.Mode()&os.ModeSymlink != 0 && e.src == e.dst {
			link, err := os.Readlink(e.src)
			if err != nil {
				return fmt.Errorf("chroot_env %q: %w", e.src, err)
			}
			parent, err := m.OpenTarget(root, filepath.Dir(e.dst), true)
			if err != nil {
				return fmt.Errorf("chroot_env %q: %w", e.src, err)
			}
			err = unix.Symlinkat(link, int(parent.Fd()), filepath.Base(e.dst))
			_ = parent.Close()
			if err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("chroot_env %q: failed to copy the symlink: %w", e.src, err)
			}
			continue
		}
		st, err := os.Stat(e.src)
		if errors.Is(err, os.ErrNotExist) {
			continue // a dangling symlink
		}
		if err != nil {
			return fmt.Errorf("chroot_env %q: %w", e.src, err)
		}
		if err := bindReadOnly(m, e.src, root, e.dst, st.IsDir()); err != nil {
			return fmt.Errorf("chroot_env %q: %w", e.src, err)
		}
	}
	return nil
}

// bindReadOnly binds the host's src (with its submounts) at dst below
// root, read-only, nosuid and nodev all the way down.
func bindReadOnly(m mounter.Interface, src, root, dst string, isDir bool) error {
	target, err := m.OpenTarget(root, dst, isDir)
	if err != nil {
		return err
	}
	defer target.Close()
	tree, err := m.CloneTree(src, true)
	if err != nil {
		return err
	}
	defer tree.Close()
	if err := m.LockTree(tree, true, true, true); err != nil {
		return err
	}
	if err := m.AttachTreeAt(tree, target); err != nil {
		return err
	}
	return m.SetPropagation(filepath.Join(root, dst), mounter.PropagationSlave, true)
}

// buildDev makes /dev: a tmpfs with the host's minimal device nodes bound
// in, a devpts of the task's own, /dev/shm and /dev/mqueue. It stays
// writable until the task's mounts are attached, since a device node
// handed to the task (Nomad's devices, a block-device volume at
// /dev/xvdb) may need its target made there; sealDev then makes it
// read-only (the mounts inside stay writable).
func buildDev(m mounter.Interface, root string, privateIPC bool) error {
	dev := filepath.Join(root, "dev")
	if err := mkdirOrDir(dev, 0o755); err != nil {
		return err
	}
	if err := m.Mount("tmpfs", dev, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "mode=0755,size=64k"); err != nil {
		return err
	}
	for _, name := range devNodes {
		src := "/dev/" + name
		fi, err := os.Stat(src)
		if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
			continue // not on this host
		}
		target, err := m.OpenTarget(dev, name, false)
		if err != nil {
			return err
		}
		// Read-only, as MountReadOnly has a device node, and whatever the
		// clone is: the node is the host's own inode, and one the host
		// swapped for a file since the check above is not the task's to
		// write either.
		tree, err := m.CloneTree(src, false)
		if err == nil {
			err = m.LockTree(tree, true, true, false)
			if err == nil {
				err = m.AttachTreeAt(tree, target)
			}
			_ = tree.Close()
		}
		_ = target.Close()
		if err != nil {
			return err
		}
	}
	for _, dir := range []string{"pts", "shm", "mqueue"} {
		if err := os.Mkdir(filepath.Join(dev, dir), 0o755); err != nil {
			return err
		}
	}
	for _, l := range devLinks {
		if err := os.Symlink(l[0], filepath.Join(dev, l[1])); err != nil {
			return err
		}
	}
	// A devpts of its own: the task sees its own terminals, not the host's,
	// and holds at most taskPtyMax of them: every devpts but the host's
	// draws on one pool for the node, and a task that took it all would
	// leave every other task without a terminal. Its terminals are of
	// group 5 (tty, by convention, as on the host and in runc), not of
	// the group of whoever opened them (the exec stage, still root).
	if err := m.Mount("devpts", filepath.Join(dev, "pts"), "devpts", unix.MS_NOSUID|unix.MS_NOEXEC,
		fmt.Sprintf("newinstance,ptmxmode=0666,mode=0620,gid=%d,max=%d", ttyGID, taskPtyMax)); err != nil {
		return err
	}
	if privateIPC {
		if err := m.Mount("shm", filepath.Join(dev, "shm"), "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC,
			"mode=1777,size=65536k"); err != nil {
			return err
		}
	} else if err := bindHostDir(m, "/dev/shm", filepath.Join(dev, "shm")); err != nil {
		return err
	}
	// mqueue shows the IPC namespace of the mounting thread: the task's.
	return m.Mount("mqueue", filepath.Join(dev, "mqueue"), "mqueue", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "")
}

// openDev opens the task's /dev tmpfs (from buildDev) in its entered root,
// before the task's mounts are attached: one of them may go on /dev itself.
func openDev() (*os.File, error) {
	fd, err := unix.Open("/dev", unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to open the task's /dev: %w", err)
	}
	return os.NewFile(uintptr(fd), "/dev"), nil
}

// sealDev makes the task's /dev tmpfs, opened by openDev, read-only once
// the task's mounts are attached: that mount alone, through its handle, so
// that neither a mount inside /dev nor one a volume put over /dev is
// touched.
func sealDev(dev *os.File) error {
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
	if err := unix.MountSetattr(int(dev.Fd()), "", unix.AT_EMPTY_PATH, &attr); err != nil {
		return fmt.Errorf("failed to seal the task's /dev: %w", err)
	}
	return nil
}

// mkdirOrDir makes the directory path, or takes the one there (an image's
// /dev, /proc or /sys): never a symlink or anything else.
func mkdirOrDir(path string, perm os.FileMode) error {
	err := os.Mkdir(path, perm)
	if err == nil || !errors.Is(err, os.ErrExist) {
		return err
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return fmt.Errorf("%q exists and is not a directory", path)
	}
	return nil
}

// bindHostDir binds a host directory that may be missing.
func bindHostDir(m mounter.Interface, src, dst string) error {
	if _, err := os.Stat(src); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return m.BindMount(src, dst, false, true)
}

// buildProc mounts /proc for the PID namespace of the calling thread, the
// kernel's settings read-only and its secrets masked. In a PID namespace
// of the task's, processes the task may not ptrace are hidden, so that it
// does not see its supervisor, the namespace's init; with the host's PID
// namespace (pid_mode "host") the task sees the host's processes, as it
// asked.
func buildProc(m mounter.Interface, root string, privatePID bool) error {
	proc := filepath.Join(root, "proc")
	if err := mkdirOrDir(proc, 0o555); err != nil {
		return err
	}
	// hidepid=4 (ptraceable, Linux 5.8) shows a process only to whoever
	// may ptrace it, whatever their groups (hidepid=2 lets gid 0 see all).
	// The supervisor holds capabilities the task does not: it is hidden.
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
	options := []string{""}
	if privatePID {
		options = []string{"hidepid=4", "hidepid=2", ""}
	}
	var err error
	for _, opts := range options {
		if err = m.Mount("proc", proc, "proc", flags, opts); err == nil {
			break
		}
	}
	if err != nil {
		return err
	}
	for _, name := range procReadOnly {
		p := filepath.Join(proc, name)
		fi, err := os.Stat(p)
		if err != nil {
			continue
		}
		if err := m.BindMount(p, p, true, fi.IsDir()); err != nil {
			return err
		}
	}
	for _, name := range procMasked {
		p := filepath.Join(proc, name)
		fi, err := os.Stat(p)
		if err != nil {
			continue
		}
		if fi.IsDir() {
			err = m.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=0")
		} else {
			err = m.BindMount("/dev/null", p, true, false)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// buildSys mounts a sysfs of the task's own, read-only: it shows no
// cgroup file system, so a task cannot move itself out of its group. A
// kernel that refuses a new sysfs here gets the host's, read-only. Either
// way sysMasked is hidden.
func buildSys(m mounter.Interface, root string) error {
	sys := filepath.Join(root, "sys")
	if err := mkdirOrDir(sys, 0o555); err != nil {
		return err
	}
	flags := uintptr(unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
	if err := m.Mount("sysfs", sys, "sysfs", flags, ""); err != nil {
		if err := bindReadOnly(m, "/sys", root, "/sys", true); err != nil {
			return err
		}
	}
	return maskSys(m, sys)
}

// sysMasked are parts of /sys a task does not see: the machine's firmware
// tables (ACPI's are root's alone, which a root task would read) and its
// power meters (powercap: Intel RAPL's energy counters are root's alone
// since they were shown to leak what another process computes).
var sysMasked = []string{"firmware", "devices/virtual/powercap"}

// maskSys hides sysMasked under empty read-only tmpfs mounts.
func maskSys(m mounter.Interface, sys string) error {
	for _, name := range sysMasked {
		p := filepath.Join(sys, name)
		if fi, err := os.Stat(p); err != nil || !fi.IsDir() {
			continue
		}
		if err := m.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=0"); err != nil {
			return err
		}
	}
	return nil
}

// mountTmp gives the task a /tmp of its own when none of its mounts is
// one: a tmpfs, charged to the task's memory, of iso.TmpSize bytes and
// iso.TmpInodes inodes when set (the driver then leaves Nomad's task tmp/
// out of the mounts).
func mountTmp(m mounter.Interface, iso *wire.Isolation, mounts ...[]wire.Mount) error {
	for _, list := range mounts {
		for _, mnt := range list {
			if filepath.Clean(mnt.Target) == "/tmp" {
				return nil
			}
		}
	}
	target, err := m.OpenTarget("/", "/tmp", true)
	if err != nil {
		return err
	}
	_ = target.Close()
	if err := m.Mount("tmpfs", "/tmp", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, tmpOptions(iso)); err != nil {
		return fmt.Errorf("failed to make the task's /tmp: %w", err)
	}
	return nil
}

// tmpOptions are the mount options of the task's /tmp.
func tmpOptions(iso *wire.Isolation) string {
	opts := "mode=1777"
	if iso != nil && iso.TmpSize > 0 {
		opts += fmt.Sprintf(",size=%d", iso.TmpSize)
	}
	if iso != nil && iso.TmpInodes > 0 {
		opts += fmt.Sprintf(",nr_inodes=%d", iso.TmpInodes)
	}
	return opts
}
