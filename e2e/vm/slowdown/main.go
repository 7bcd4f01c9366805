// Command slowdown times three things a node's work is made of, so that
// make e2e-vm can say how much slower the guest is than the host that runs
// it: CPU (hashing memory), fork and exec (running /bin/true), and mount
// calls (a tmpfs mounted and unmounted). It prints one "name nanoseconds"
// line per measure, the median of several rounds. Mounting needs root.
package main

import (
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

const rounds = 5

func main() {
	buf := make([]byte, 4<<20)
	for i := range buf {
		buf[i] = byte(i)
	}
	report("cpu_sha256_4MiB", func() error {
		_ = sha256.Sum256(buf)
		return nil
	}, 4)
	report("fork_exec_true", func() error {
		return exec.Command("/bin/true").Run()
	}, 20)
	dir, err := os.MkdirTemp("", "slowdown-")
	if err != nil {
		fail(err)
	}
	defer os.Remove(dir)
	report("mount_umount_tmpfs", func() error {
		if err := unix.Mount("slowdown", dir, "tmpfs", 0, "size=1m"); err != nil {
			return fmt.Errorf("mount: %w", err)
		}
		return unix.Unmount(dir, 0)
	}, 20)
}

// report prints the median time of one call of f, over rounds of n calls.
func report(name string, f func() error, n int) {
	var per []time.Duration
	for range rounds {
		start := time.Now()
		for range n {
			if err := f(); err != nil {
				fail(fmt.Errorf("%s: %w", name, err))
			}
		}
		per = append(per, time.Since(start)/time.Duration(n))
	}
	slices.Sort(per)
	fmt.Printf("%s %d\n", name, per[len(per)/2].Nanoseconds())
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "slowdown:", err)
	os.Exit(1)
}
