package wire

import (
	"fmt"
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

// KnownCapabilities lists the capability names (without "CAP_") this
// package knows.
func KnownCapabilities() []string {
	out := make([]string, 0, len(capNames))
	for n := range capNames {
		out = append(out, n)
	}
	return out
}
