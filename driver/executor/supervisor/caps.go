package supervisor

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// lastCap reads the highest capability number the kernel knows.
func lastCap() (int, error) {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 0, fmt.Errorf("failed to read the last capability: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("failed to parse /proc/sys/kernel/cap_last_cap %q: %w", b, err)
	}
	return n, nil
}

// capSet is a set of capabilities as the kernel's 64-bit mask.
type capSet uint64

func (c capSet) has(n int) bool { return n >= 0 && n < 64 && c&(1<<uint(n)) != 0 }

// keptCaps returns the capabilities a task keeps.
func keptCaps(privileged bool, names []string, last int) (capSet, error) {
	if privileged {
		var all capSet
		for n := 0; n <= last && n < 64; n++ {
			all |= 1 << uint(n)
		}
		return all, nil
	}
	if names == nil {
		names = wire.DefaultCapabilities
	}
	nums, err := wire.ParseCapabilities(names)
	if err != nil {
		return 0, err
	}
	var set capSet
	for _, n := range nums {
		if n <= last {
			set |= 1 << uint(n)
		}
	}
	return set, nil
}

// dropBoundingSet removes every capability not in keep from the bounding
// set of the calling process, which needs CAP_SETPCAP.
func dropBoundingSet(keep capSet, last int) error {
	for n := 0; n <= last; n++ {
		if keep.has(n) {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(n), 0, 0, 0); err != nil {
			return fmt.Errorf("failed to drop capability %d from the bounding set: %w", n, err)
		}
	}
	return nil
}

// setThreadCaps clears the calling thread's ambient set and sets its
// inheritable set to keep, and with narrow its effective and permitted
// sets too (otherwise they stay as they are). capset(2) is per thread: the
// caller must hold its OS thread and exec or fork the task from it. A
// capability the thread does not hold cannot be granted: a privileged
// task gets everything the host lets us have.
func setThreadCaps(keep capSet, narrow bool) error {
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("failed to clear ambient capabilities: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("failed to read capabilities: %w", err)
	}
	keep &= capSet(data[0].Permitted) | capSet(data[1].Permitted)<<32
	lo, hi := uint32(keep), uint32(keep>>32)
	data[0].Inheritable, data[1].Inheritable = lo, hi
	if narrow {
		data[0].Effective, data[0].Permitted = lo, lo
		data[1].Effective, data[1].Permitted = hi, hi
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("failed to set capabilities %#x: %w", uint64(keep), err)
	}
	return nil
}

// capsOf is the set of the named capabilities that are also in keep.
func capsOf(names []string, keep capSet) (capSet, error) {
	nums, err := wire.ParseCapabilities(names)
	if err != nil {
		return 0, err
	}
	var set capSet
	for _, n := range nums {
		if keep.has(n) {
			set |= 1 << uint(n)
		}
	}
	return set, nil
}

// raiseAmbient raises set in the calling thread's ambient set; each must
// be in its permitted and inheritable sets already.
func raiseAmbient(set capSet) error {
	for n := 0; n < 64; n++ {
		if !set.has(n) {
			continue
		}
		if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_RAISE, uintptr(n), 0, 0); err != nil {
			return fmt.Errorf("failed to raise ambient capability %d: %w", n, err)
		}
	}
	return nil
}
