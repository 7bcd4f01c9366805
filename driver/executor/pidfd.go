package executor

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// waitExited returns once the process behind pidfd has exited. It waits in
// the runtime's poller, as a socket read does: no OS thread sits in a
// blocking system call for it. A driver holds one such wait per task (on
// the task's supervisor), and a thread blocked in poll(2) or waitid(2) for
// each would cost every task a thread (its stacks, a scheduler hand-off)
// for its whole life. pidfd stays open and is the caller's; the wait uses
// a duplicate of it, made non-blocking (which only waitid(2) on the pidfd
// would notice, and nothing here calls it). When the poller does not take
// the descriptor, it waits in poll(2).
func waitExited(pidfd int) error {
	fd, err := unix.FcntlInt(uintptr(pidfd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failed to duplicate a pidfd: %w", err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		_ = unix.Close(fd)
		return fmt.Errorf("failed to make a pidfd non-blocking: %w", err)
	}
	f := os.NewFile(uintptr(fd), "pidfd")
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("failed to wait on a pidfd: %w", err)
	}
	var pollErr error
	err = rc.Read(func(fd uintptr) bool {
		var ready bool
		ready, pollErr = pidfdReady(int(fd), 0)
		return ready || pollErr != nil
	})
	if err != nil {
		// Not in the poller: wait in poll(2).
		for {
			ready, perr := pidfdReady(pidfd, -1)
			if ready || perr != nil {
				return perr
			}
		}
	}
	return pollErr
}

// pidfdReady polls pidfd for up to timeout milliseconds (-1: without end):
// true once its process has exited.
func pidfdReady(pidfd, timeout int) (bool, error) {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, timeout)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return false, fmt.Errorf("failed to poll a pidfd: %w", err)
		}
		return n > 0, nil
	}
}

// waitChild reaps a child of this process once it has exited, waiting as
// waitExited does, and returns what wait returns.
func waitChild(p *os.Process, wait func() error) error {
	if fd, err := unix.PidfdOpen(p.Pid, unix.PIDFD_NONBLOCK); err == nil {
		// An unreaped child's pid is not reused: the pidfd is its.
		_ = waitExited(fd)
		_ = unix.Close(fd)
	}
	return wait()
}
