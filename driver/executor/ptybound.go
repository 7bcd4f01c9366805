package executor

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// ptyBound is what bounds the terminals of a task's /dev/pts, read on the
// host when `alloc exec -t` found none left there (the exec stage's open of
// /dev/pts/ptmx failed with ENOSPC). The kernel refuses a terminal when the
// devpts holds its max= of them, or when the node's terminals reach
// kernel.pty.max, less kernel.pty.reserve for every devpts but the one
// mounted in the host's first mount namespace (fs/devpts/inode.c,
// devpts_new_index).
type ptyBound struct {
	// DevptsMax is the max= option of the devpts at the task's /dev/pts:
	// an isolated task's own (the supervisor's taskPtyMax), or whatever
	// the host's carries. 0 when it has none.
	DevptsMax int
	// Host is set when the task's /dev/pts is the devpts the driver's own
	// /dev/pts is: the host's (a task that is not isolated, or a
	// privileged one), which may use kernel.pty.reserve.
	Host bool
	// PtyMax, PtyReserve and PtyNr are kernel.pty.max, kernel.pty.reserve
	// and kernel.pty.nr (the terminals the node holds).
	PtyMax, PtyReserve, PtyNr int
}

// String names the bound that was reached: the node's pool when it is
// used up (the kernel counts the new terminal first, so the pool is full
// at one less than its limit), the devpts's max= otherwise. A devpts
// without max= whose pool has room when it is read was refused by the
// pool, since emptied a little, and the text says that.
func (b ptyBound) String() string {
	pool, poolText := b.PtyMax, fmt.Sprintf("kernel.pty.max %d", b.PtyMax)
	if !b.Host {
		pool -= b.PtyReserve
		poolText = fmt.Sprintf("kernel.pty.max %d less kernel.pty.reserve %d", b.PtyMax, b.PtyReserve)
	}
	if b.DevptsMax > 0 && b.PtyNr+1 < pool {
		which := "its own devpts"
		if b.Host {
			which = "the host's devpts"
		}
		return fmt.Sprintf("%s holds at most %d terminals (its max=%d)", which, b.DevptsMax, b.DevptsMax)
	}
	if b.PtyNr+1 < pool {
		// No max= bounds this devpts and the pool has room now: it was
		// full when the open was refused, and terminals went since.
		return fmt.Sprintf("the node's terminals were all taken (%s; kernel.pty.nr %d now, some freed since)", poolText, b.PtyNr)
	}
	return fmt.Sprintf("the node's terminals are all taken (%s; kernel.pty.nr %d)", poolText, b.PtyNr)
}

// readPtyBound finds the devpts at /dev/pts in taskMounts (the task's
// mount table, paths relative to its root, or only its mount there) and
// the driver's own in hostMounts, and reads the kernel.pty sysctls with
// sysctl.
func readPtyBound(taskMounts, hostMounts []mounter.MountPoint, sysctl func(name string) (int, error)) (ptyBound, error) {
	var b ptyBound
	task, ok := devptsAt(taskMounts)
	if !ok {
		return b, fmt.Errorf("the task's mount table has no devpts at /dev/pts")
	}
	for _, o := range task.SuperOptions {
		v, found := strings.CutPrefix(o, "max=")
		if !found {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return b, fmt.Errorf("the task's devpts has option %q: %w", o, err)
		}
		b.DevptsMax = n
	}
	if host, ok := devptsAt(hostMounts); ok {
		b.Host = host.Major == task.Major && host.Minor == task.Minor
	}
	for _, s := range []struct {
		name string
		to   *int
	}{{"max", &b.PtyMax}, {"reserve", &b.PtyReserve}, {"nr", &b.PtyNr}} {
		n, err := sysctl(s.name)
		if err != nil {
			return b, err
		}
		*s.to = n
	}
	return b, nil
}

// devptsAt returns the topmost mount at /dev/pts, when it is a devpts.
func devptsAt(mounts []mounter.MountPoint) (mounter.MountPoint, bool) {
	mp, ok := mounter.FindMount(mounts, "/dev/pts")
	if !ok || mp.Path != "/dev/pts" || mp.FSType != "devpts" {
		return mounter.MountPoint{}, false
	}
	return mp, true
}

// ptySysctl reads kernel.pty.<name> from the host's /proc.
func ptySysctl(name string) (int, error) {
	path := filepath.Join("/proc/sys/kernel/pty", name)
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("failed to read kernel.pty.%s: %w", name, err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("kernel.pty.%s is %q: %w", name, b, err)
	}
	return n, nil
}

// noTerminalError is the error of `alloc exec -t` on a task out of
// terminals: it names the bound that was reached, read on the host (the
// task's mount table from the host's /proc, never its own /proc). The pid
// is the task's only while pidfd, the task's, says it is alive: a task
// that exited may have left its pid to another process (another task's, a
// host process), whose mount table would be read instead.
func noTerminalError(pidfd, taskPID int) error {
	b, err := func() (ptyBound, error) {
		task, ok, err := mounter.ProcessMountAt(taskPID, "/dev/pts")
		if err != nil {
			return ptyBound{}, err
		}
		if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil {
			return ptyBound{}, fmt.Errorf("the task exited: %w", err)
		}
		var taskMounts, hostMounts []mounter.MountPoint
		if ok {
			taskMounts = append(taskMounts, task)
		}
		host, ok, err := mounter.ProcessMountAt(os.Getpid(), "/dev/pts")
		if err != nil {
			return ptyBound{}, err
		}
		if ok {
			hostMounts = append(hostMounts, host)
		}
		return readPtyBound(taskMounts, hostMounts, ptySysctl)
	}()
	if err != nil {
		return fmt.Errorf("the task has no terminal left in its /dev/pts (which bound was reached is unknown: %v): %w", err, unix.ENOSPC)
	}
	return fmt.Errorf("the task has no terminal left in its /dev/pts: %s: %w", b, unix.ENOSPC)
}
