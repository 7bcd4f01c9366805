package executor

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// onExited has f run, on a goroutine of its own, once the process behind
// pidfd has exited. Every such wait of the process shares one goroutine,
// which waits in the runtime's poller on an epoll set of the pidfds (an
// epoll descriptor is readable while any of its set is): a driver waits
// for each task's supervisor for the task's whole life, and a goroutine
// each was 500 goroutines and their stacks at 500 tasks. pidfd stays the
// caller's; the set holds a duplicate. When the set cannot take the
// descriptor, the wait has a goroutine of its own, as waitExited does;
// should that wait fail too, failed (when not nil) is told why, and f runs
// at once, as it would once the process had exited.
func onExited(pidfd int, f func(), failed func(error)) {
	if exits.add(pidfd, f) == nil {
		return
	}
	fd, err := unix.FcntlInt(uintptr(pidfd), unix.F_DUPFD_CLOEXEC, 0)
	go func() {
		if err == nil {
			err = waitExited(fd)
			_ = unix.Close(fd)
		} else {
			err = fmt.Errorf("failed to duplicate a pidfd: %w", err)
		}
		if err != nil && failed != nil {
			failed(err)
		}
		f()
	}()
}

// exits is the process's one set of exit waits (onExited).
var exits exitSet

// exitSet is an epoll set of pidfds, each with what to run once its
// process has exited, and the goroutine that waits on it (started with the
// first wait, for the process's life).
type exitSet struct {
	once     sync.Once
	startErr error
	epfd     int
	file     *os.File
	// fail is called when the set can no longer be waited on (nil:
	// exitSetFailed).
	fail func(error)

	mu      sync.Mutex
	next    int32
	waiting map[int32]exitWait
}

// exitWait is one wait: the set's duplicate of the pidfd, and what runs
// once its process has exited.
type exitWait struct {
	fd int
	f  func()
}

// add puts a duplicate of pidfd in the set, with f to run once its process
// has exited (at once, on the set's goroutine, when it has already).
func (s *exitSet) add(pidfd int, f func()) error {
	s.once.Do(s.start)
	if s.startErr != nil {
		return s.startErr
	}
	fd, err := unix.FcntlInt(uintptr(pidfd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failed to duplicate a pidfd: %w", err)
	}
	s.mu.Lock()
	key := s.next
	s.next++
	s.waiting[key] = exitWait{fd: fd, f: f}
	s.mu.Unlock()
	// One-shot: a pidfd stays readable once its process has exited.
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLONESHOT, Fd: key}
	if err := unix.EpollCtl(s.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		s.mu.Lock()
		delete(s.waiting, key)
		s.mu.Unlock()
		_ = unix.Close(fd)
		return fmt.Errorf("failed to add a pidfd to the exit set: %w", err)
	}
	return nil
}

// start makes the set and its goroutine.
func (s *exitSet) start() {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		s.startErr = fmt.Errorf("failed to make the exit set: %w", err)
		return
	}
	if err := unix.SetNonblock(epfd, true); err != nil {
		_ = unix.Close(epfd)
		s.startErr = fmt.Errorf("failed to make the exit set non-blocking: %w", err)
		return
	}
	// In the runtime's poller: the goroutine sleeps as a socket read does.
	f := os.NewFile(uintptr(epfd), "exit-set")
	rc, err := f.SyscallConn()
	if err == nil {
		// Only a file in the poller takes a deadline: a wait outside it
		// would end at once.
		err = f.SetReadDeadline(time.Time{})
	}
	if err != nil {
		_ = f.Close()
		s.startErr = fmt.Errorf("failed to wait on the exit set: %w", err)
		return
	}
	s.epfd = epfd
	s.file = f
	s.waiting = map[int32]exitWait{}
	go s.run(rc)
}

// run runs each wait's f once its process has exited, for the process's
// life (the set's file stays open: nothing closes it). It returns only
// when the set can no longer be waited on, after calling s.fail.
func (s *exitSet) run(rc syscall.RawConn) {
	events := make([]unix.EpollEvent, 64)
	var waitErr error
	err := rc.Read(func(fd uintptr) bool {
		for {
			n, err := unix.EpollWait(int(fd), events, 0)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil {
				waitErr = err
				return true
			}
			for _, ev := range events[:n] {
				s.fire(ev.Fd)
			}
			if n < len(events) {
				// Drained: sleep until the set is readable again.
				return false
			}
		}
	})
	// The read ends only when epoll_wait(2) failed or the poller gave it
	// up (the file closed, a deadline set on it). Either is a bug, and
	// either way no wait left would ever end.
	if err == nil {
		err = waitErr
	}
	fail := s.fail
	if fail == nil {
		fail = exitSetFailed
	}
	fail(fmt.Errorf("failed to wait on the exit set: %w", err))
}

// exitSetFailed ends the process: with the exit set no longer waited on,
// no task's exit would be seen again. The driver exits instead, and Nomad
// starts it again and hands it its tasks to recover.
func exitSetFailed(err error) {
	panic(err.Error())
}

// fire ends the wait of key and runs its f.
func (s *exitSet) fire(key int32) {
	s.mu.Lock()
	w, ok := s.waiting[key]
	delete(s.waiting, key)
	s.mu.Unlock()
	if !ok {
		return
	}
	_ = unix.EpollCtl(s.epfd, unix.EPOLL_CTL_DEL, w.fd, nil)
	_ = unix.Close(w.fd)
	go w.f()
}

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

// onChildExited has f run once the child p of this process has exited
// (as onExited does), for f to reap it. Without a pidfd (a kernel before
// 5.3), f runs on a goroutine of its own at once, to reap the child as
// it waits.
func onChildExited(p *os.Process, f func()) {
	fd, err := unix.PidfdOpen(p.Pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		go f()
		return
	}
	// An unreaped child's pid is not reused: the pidfd is its.
	onExited(fd, f, nil)
	_ = unix.Close(fd)
}
