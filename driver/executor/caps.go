package executor

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// capNames maps capability names (without "CAP_", upper case) to numbers.
var capNames = map[string]int{
	"CHOWN":              unix.CAP_CHOWN,
	"DAC_OVERRIDE":       unix.CAP_DAC_OVERRIDE,
	"DAC_READ_SEARCH":    unix.CAP_DAC_READ_SEARCH,
	"FOWNER":             unix.CAP_FOWNER,
	"FSETID":             unix.CAP_FSETID,
	"KILL":               unix.CAP_KILL,
	"SETGID":             unix.CAP_SETGID,
	"SETUID":             unix.CAP_SETUID,
	"SETPCAP":            unix.CAP_SETPCAP,
	"LINUX_IMMUTABLE":    unix.CAP_LINUX_IMMUTABLE,
	"NET_BIND_SERVICE":   unix.CAP_NET_BIND_SERVICE,
	"NET_BROADCAST":      unix.CAP_NET_BROADCAST,
	"NET_ADMIN":          unix.CAP_NET_ADMIN,
	"NET_RAW":            unix.CAP_NET_RAW,
	"IPC_LOCK":           unix.CAP_IPC_LOCK,
	"IPC_OWNER":          unix.CAP_IPC_OWNER,
	"SYS_MODULE":         unix.CAP_SYS_MODULE,
	"SYS_RAWIO":          unix.CAP_SYS_RAWIO,
	"SYS_CHROOT":         unix.CAP_SYS_CHROOT,
	"SYS_PTRACE":         unix.CAP_SYS_PTRACE,
	"SYS_PACCT":          unix.CAP_SYS_PACCT,
	"SYS_ADMIN":          unix.CAP_SYS_ADMIN,
	"SYS_BOOT":           unix.CAP_SYS_BOOT,
	"SYS_NICE":           unix.CAP_SYS_NICE,
	"SYS_RESOURCE":       unix.CAP_SYS_RESOURCE,
	"SYS_TIME":           unix.CAP_SYS_TIME,
	"SYS_TTY_CONFIG":     unix.CAP_SYS_TTY_CONFIG,
	"MKNOD":              unix.CAP_MKNOD,
	"LEASE":              unix.CAP_LEASE,
	"AUDIT_WRITE":        unix.CAP_AUDIT_WRITE,
	"AUDIT_CONTROL":      unix.CAP_AUDIT_CONTROL,
	"SETFCAP":            unix.CAP_SETFCAP,
	"MAC_OVERRIDE":       unix.CAP_MAC_OVERRIDE,
	"MAC_ADMIN":          unix.CAP_MAC_ADMIN,
	"SYSLOG":             unix.CAP_SYSLOG,
	"WAKE_ALARM":         unix.CAP_WAKE_ALARM,
	"BLOCK_SUSPEND":      unix.CAP_BLOCK_SUSPEND,
	"AUDIT_READ":         unix.CAP_AUDIT_READ,
	"PERFMON":            unix.CAP_PERFMON,
	"BPF":                unix.CAP_BPF,
	"CHECKPOINT_RESTORE": unix.CAP_CHECKPOINT_RESTORE,
}

// DefaultCapabilities are kept by a task that is not privileged and that
// does not set Spec.Capabilities: Docker's default set without NET_RAW.
var DefaultCapabilities = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

// ParseCapabilities checks capability names ("CAP_SYS_ADMIN" or
// "sys_admin", any case) and returns their numbers, without duplicates. An
// unknown name is an error naming it.
func ParseCapabilities(names []string) ([]int, error) {
	seen := make(map[int]bool, len(names))
	out := make([]int, 0, len(names))
	for _, name := range names {
		key := strings.ToUpper(strings.TrimSpace(name))
		key = strings.TrimPrefix(key, "CAP_")
		n, ok := capNames[key]
		if !ok {
			return nil, fmt.Errorf("unknown capability %q", name)
		}
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	return out, nil
}

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
		names = DefaultCapabilities
	}
	nums, err := ParseCapabilities(names)
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
	nums, err := ParseCapabilities(names)
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

// KnownCapabilities lists the capability names (without "CAP_") this
// package knows.
func KnownCapabilities() []string {
	out := make([]string, 0, len(capNames))
	for n := range capNames {
		out = append(out, n)
	}
	return out
}
