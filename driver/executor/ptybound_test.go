package executor

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// The error of `alloc exec -t` on a task out of terminals names the bound
// the kernel applied: the task's own devpts max= for an isolated task, the
// node's kernel.pty.max (and any max= of the host's devpts) for a task on
// the host's devpts, never the isolated task's 128 for everyone.
func TestPtyBound(t *testing.T) {
	const (
		hostLine = "26 24 0:24 / /dev/pts rw,nosuid,noexec,relatime shared:3 - devpts devpts rw,gid=5,mode=620,ptmxmode=000%s\n"
		ownLine  = "900 880 0:77 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666,max=128\n"
		rootLine = "24 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
	)
	parse := func(t *testing.T, s string) []mounter.MountPoint {
		t.Helper()
		mps, err := mounter.ParseMountInfo(strings.NewReader(s))
		must.NoError(t, err)
		return mps
	}
	sysctls := func(nr int) func(string) (int, error) {
		return func(name string) (int, error) {
			switch name {
			case "max":
				return 4096, nil
			case "reserve":
				return 1024, nil
			case "nr":
				return nr, nil
			}
			return 0, fmt.Errorf("unexpected kernel.pty.%s", name)
		}
	}
	host := rootLine + fmt.Sprintf(hostLine, "")
	for _, tc := range []struct {
		name string
		task string
		host string
		nr   int
		want string
	}{{
		name: "isolated task at its own max",
		task: rootLine + ownLine,
		host: host,
		nr:   130,
		want: "its own devpts holds at most 128 terminals (its max=128)",
	}, {
		name: "isolated task when the pool of every devpts but the host's is used up",
		task: rootLine + ownLine,
		host: host,
		nr:   3071,
		want: "the node's terminals are all taken (kernel.pty.max 4096 less kernel.pty.reserve 1024; kernel.pty.nr 3071)",
	}, {
		name: "task on the host's devpts",
		task: host,
		host: host,
		nr:   4095,
		want: "the node's terminals are all taken (kernel.pty.max 4096; kernel.pty.nr 4095)",
	}, {
		// Terminals freed between the refused open and the read: the
		// bound that applied is still the pool, but it is not full now.
		name: "task on the host's devpts, terminals freed since",
		task: host,
		host: host,
		nr:   4000,
		want: "the node's terminals were all taken (kernel.pty.max 4096; kernel.pty.nr 4000 now, some freed since)",
	}, {
		name: "task on the host's devpts that has a max",
		task: rootLine + fmt.Sprintf(hostLine, ",max=64"),
		host: rootLine + fmt.Sprintf(hostLine, ",max=64"),
		nr:   70,
		want: "the host's devpts holds at most 64 terminals (its max=64)",
	}, {
		name: "own devpts stacked on the host's",
		task: host + ownLine,
		host: host,
		nr:   200,
		want: "its own devpts holds at most 128 terminals (its max=128)",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := readPtyBound(parse(t, tc.task), parse(t, tc.host), sysctls(tc.nr))
			must.NoError(t, err)
			must.Eq(t, tc.want, b.String())
		})
	}

	t.Run("no devpts at /dev/pts", func(t *testing.T) {
		_, err := readPtyBound(parse(t, rootLine), parse(t, host), sysctls(0))
		must.ErrorContains(t, err, "the task's mount table has no devpts at /dev/pts")
	})
	t.Run("a sysctl that cannot be read", func(t *testing.T) {
		_, err := readPtyBound(parse(t, host), parse(t, host), func(name string) (int, error) {
			return 0, fmt.Errorf("failed to read kernel.pty.%s", name)
		})
		must.ErrorContains(t, err, "failed to read kernel.pty.max")
	})
}

// The task's pid names the task only while its pidfd says it is alive: a
// task that exited may have left its pid to another process (here, the
// test's own, on the host's devpts), whose mount table would be read and
// told to the user of `alloc exec` as the task's.
func TestNoTerminalError_TaskExited(t *testing.T) {
	cmd := exec.Command("true")
	must.NoError(t, cmd.Start())
	pidfd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
	must.NoError(t, err)
	t.Cleanup(func() { unix.Close(pidfd) })
	must.NoError(t, cmd.Wait())

	err = noTerminalError(pidfd, os.Getpid())
	must.ErrorIs(t, err, unix.ENOSPC)
	must.ErrorContains(t, err, "which bound was reached is unknown: the task exited")
	must.StrNotContains(t, err.Error(), "devpts")
	must.StrNotContains(t, err.Error(), "kernel.pty")
}
