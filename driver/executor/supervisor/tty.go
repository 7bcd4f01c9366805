package supervisor

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// ptmxMajor and ptmxMinor are the device of a devpts's ptmx (and of
// /dev/ptmx): its multiplexer.
const (
	ptmxMajor = 5
	ptmxMinor = 2
)

// isPtsDevice reports whether major:minor is a devpts's terminal: major
// cgroups.PtsMajor (136), the only one the kernel gives them and the only
// one an isolated task's device filter allows (see cgroups.PtsMajor for
// why not the 136-143 of devices.txt).
func isPtsDevice(major, _ uint32) bool { return major == cgroups.PtsMajor }

// takeTerminal gives the exec stage, in the task's mount namespace and
// still holding every capability, a terminal of the task's own devpts as
// its stdin, stdout, stderr and controlling terminal, owned by uid (the
// command's user, who may then open it by its name too); it hands the
// multiplexer to the driver over wire.StageTtyFD. The stage must lead a
// session of its own without a terminal.
//
// The task's root is hostile: /dev and what is in it may be the task's own
// files (a volume at /dev, or a /dev a task allowed CAP_SYS_ADMIN
// remounted). Nothing here follows a symlink or goes by /dev/ptmx (a
// symlink a task may replace): the multiplexer is /dev/pts/ptmx, taken
// only where /dev/pts is a devpts, opened without blocking (a FIFO) and
// checked on the open descriptor to be a devpts's ptmx. The terminal is
// its peer (TIOCGPTPEER), never looked up by name.
func takeTerminal(uid uint32) error {
	ptmx, err := openTaskPtmx()
	if err != nil {
		return err
	}
	defer unix.Close(ptmx)
	if err := unix.IoctlSetPointerInt(ptmx, unix.TIOCSPTLCK, 0); err != nil {
		return fmt.Errorf("failed to unlock the task's terminal: %w", err)
	}
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(ptmx), unix.TIOCGPTPEER,
		uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	if errno != 0 {
		return fmt.Errorf("failed to open the task's terminal: %w", errno)
	}
	pts := int(r)
	defer unix.Close(pts)
	if err := checkDevpts(pts, isPtsDevice); err != nil {
		return fmt.Errorf("the task's terminal: %w", err)
	}
	// Given to the command's user, unless it has it already (a task may
	// have remounted its devpts read-only, where a change fails).
	var st unix.Stat_t
	if err := unix.Fstat(pts, &st); err != nil {
		return fmt.Errorf("failed to stat the task's terminal: %w", err)
	}
	if st.Uid != uid {
		if err := unix.Fchown(pts, int(uid), -1); err != nil {
			return fmt.Errorf("failed to give the task's terminal to uid %d: %w", uid, err)
		}
	}
	if err := unix.Sendmsg(wire.StageTtyFD, []byte{0}, unix.UnixRights(ptmx), nil, 0); err != nil {
		return fmt.Errorf("failed to hand the task's terminal to the driver: %w", err)
	}
	for fd := 0; fd < 3; fd++ {
		if err := unix.Dup3(pts, fd, 0); err != nil {
			return fmt.Errorf("failed to take the task's terminal: %w", err)
		}
	}
	if err := unix.IoctlSetInt(0, unix.TIOCSCTTY, 0); err != nil {
		return fmt.Errorf("failed to make the task's terminal the controlling terminal: %w", err)
	}
	return nil
}

// openTaskPtmx opens the multiplexer of the devpts at /dev/pts of the
// calling process's root (see takeTerminal).
func openTaskPtmx() (int, error) {
	how := unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	}
	// Relative to the working directory, which the stage changed to the
	// task's root: RESOLVE_BENEATH takes no absolute path.
	dir, err := unix.Openat2(unix.AT_FDCWD, "dev/pts", &how)
	if err != nil {
		return -1, fmt.Errorf("the task has no devpts at /dev/pts to take a terminal from: %w", err)
	}
	defer unix.Close(dir)
	var fs unix.Statfs_t
	if err := unix.Fstatfs(dir, &fs); err != nil {
		return -1, fmt.Errorf("failed to check the task's /dev/pts: %w", err)
	}
	if fs.Type != unix.DEVPTS_SUPER_MAGIC {
		return -1, errors.New("the task has no devpts at /dev/pts to take a terminal from: it is not a devpts mount")
	}
	how = unix.OpenHow{
		Flags: unix.O_RDWR | unix.O_NOCTTY | unix.O_NONBLOCK | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS |
			unix.RESOLVE_NO_XDEV,
	}
	ptmx, err := unix.Openat2(dir, "ptmx", &how)
	if errors.Is(err, unix.ENOSPC) {
		// Which bound was reached (the devpts's max= or the node's
		// kernel.pty.max) is read by the driver, on the host.
		return -1, fmt.Errorf("%s: %w", wire.StageNoTerminal, err)
	}
	if err != nil {
		return -1, fmt.Errorf("failed to open the task's devpts multiplexer /dev/pts/ptmx: %w", err)
	}
	if err := checkDevpts(ptmx, func(major, minor uint32) bool {
		return major == ptmxMajor && minor == ptmxMinor
	}); err != nil {
		_ = unix.Close(ptmx)
		return -1, fmt.Errorf("the task's /dev/pts/ptmx: %w", err)
	}
	return ptmx, nil
}

// checkDevpts checks that fd is a character device on a devpts whose
// number dev accepts.
func checkDevpts(fd int, dev func(major, minor uint32) bool) error {
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return fmt.Errorf("failed to check its file system: %w", err)
	}
	if fs.Type != unix.DEVPTS_SUPER_MAGIC {
		return fmt.Errorf("not on a devpts (file system magic %#x)", fs.Type)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("failed to check it: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR {
		return fmt.Errorf("not a character device (mode %#o)", st.Mode)
	}
	if !dev(unix.Major(st.Rdev), unix.Minor(st.Rdev)) {
		return fmt.Errorf("unexpected device %d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	}
	return nil
}
