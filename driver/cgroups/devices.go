package cgroups

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	ocgroups "github.com/opencontainers/cgroups"
	// Imported for its side effect: it sets ocgroups.DevicesSetV2, which
	// builds and attaches the cgroup v2 device program.
	_ "github.com/opencontainers/cgroups/devices"
	ocdevices "github.com/opencontainers/cgroups/devices/config"
	"golang.org/x/sys/unix"
)

// DeviceRule allows the processes of a group to use some devices. A group
// with rules (Limits.Devices) may use only the devices they allow.
type DeviceRule struct {
	// Type is 'c' (character device), 'b' (block device) or 'a' (every
	// device, whatever the numbers and the access: the kernel ignores both
	// for 'a').
	Type byte
	// Major and Minor are the device's numbers; -1 means any.
	Major int64
	Minor int64
	// Access is one or more of 'r' (open for reading), 'w' (open for
	// writing) and 'm' (mknod).
	Access string
}

// String is the rule as cgroup v1's devices.allow takes it: "c 1:3 rw",
// with "*" for any number.
func (r DeviceRule) String() string {
	num := func(n int64) string {
		if n == -1 {
			return "*"
		}
		return strconv.FormatInt(n, 10)
	}
	return fmt.Sprintf("%c %s:%s %s", r.Type, num(r.Major), num(r.Minor), r.Access)
}

func (r DeviceRule) validate() error {
	switch r.Type {
	case 'a', 'b', 'c':
	default:
		return fmt.Errorf("type %q must be 'c', 'b' or 'a'", r.Type)
	}
	for _, n := range []struct {
		name string
		v    int64
	}{{"major", r.Major}, {"minor", r.Minor}} {
		if n.v < -1 || n.v > math.MaxUint32 {
			return fmt.Errorf("%s %d must be a device number or -1 for any", n.name, n.v)
		}
	}
	if r.Access == "" || len(r.Access) > 3 {
		return fmt.Errorf("access %q must be one or more of r, w and m", r.Access)
	}
	for i, c := range r.Access {
		if !strings.ContainsRune("rwm", c) || strings.ContainsRune(r.Access[:i], c) {
			return fmt.Errorf("access %q must be one or more of r, w and m, each once", r.Access)
		}
	}
	return nil
}

// PtsMajor is the major of every terminal of a devpts (/dev/pts/N).
// Documentation/admin-guide/devices.txt reserves majors 136-143 for
// Unix98 PTY slaves, a range from when a minor had 8 bits; the kernel's
// devpts makes each terminal MKDEV(UNIX98_PTY_SLAVE_MAJOR, index) with its
// index below NR_UNIX98_PTY_MAX (1 << MINORBITS), so every one is 136 with
// its index as minor, and 137-143 are never used.
const PtsMajor = 136

// DefaultDevices is what every non-privileged task may open: /dev/null,
// zero, full, random, urandom, tty (the process's controlling terminal),
// ptmx and the pseudo-terminals of /dev/pts (major 136), for reading and
// writing.
//
// It is runc's default list (the one Nomad's exec driver uses) less three
// entries:
//   - mknod of every character and block device ("c *:* m", "b *:* m"):
//     a node that may not be opened is of no use to the task, while one
//     made in a volume or in the alloc dir could be opened through that
//     path by a process outside this filter (a privileged task, the host).
//     FIFOs and sockets are not devices and can still be made.
//   - /dev/net/tun (10:200), which runc keeps only for compatibility
//     with old Docker.
//   - /dev/console (5:1), which no runtime gives a task: runc makes the
//     task's console a pseudo-terminal.
var DefaultDevices = []DeviceRule{
	{Type: 'c', Major: 1, Minor: 3, Access: "rw"},         // /dev/null
	{Type: 'c', Major: 1, Minor: 5, Access: "rw"},         // /dev/zero
	{Type: 'c', Major: 1, Minor: 7, Access: "rw"},         // /dev/full
	{Type: 'c', Major: 1, Minor: 8, Access: "rw"},         // /dev/random
	{Type: 'c', Major: 1, Minor: 9, Access: "rw"},         // /dev/urandom
	{Type: 'c', Major: 5, Minor: 0, Access: "rw"},         // /dev/tty
	{Type: 'c', Major: 5, Minor: 2, Access: "rw"},         // /dev/ptmx, /dev/pts/ptmx
	{Type: 'c', Major: PtsMajor, Minor: -1, Access: "rw"}, // /dev/pts/*
}

// DeviceRuleFor returns the rule that allows access ("rwm" or part of it)
// to the device node at path on the host. A symbolic link is followed
// (device plugins may name /dev/disk/by-id links).
func DeviceRuleFor(path, access string) (DeviceRule, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return DeviceRule{}, fmt.Errorf("failed to stat device %s: %w", path, err)
	}
	r, ok := deviceRuleOf(&st, access)
	if !ok {
		return DeviceRule{}, fmt.Errorf("device %s must be a character or block device node", path)
	}
	if err := r.validate(); err != nil {
		return DeviceRule{}, fmt.Errorf("invalid rule for device %s: %w", path, err)
	}
	return r, nil
}

// DeviceRuleForFile is DeviceRuleFor for an open file (a mount tree whose
// root is a device node, say); ok is false when it is no device node.
func DeviceRuleForFile(f *os.File, access string) (r DeviceRule, ok bool, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return DeviceRule{}, false, fmt.Errorf("failed to stat %s: %w", f.Name(), err)
	}
	if r, ok = deviceRuleOf(&st, access); !ok {
		return DeviceRule{}, false, nil
	}
	if err := r.validate(); err != nil {
		return DeviceRule{}, false, fmt.Errorf("invalid rule for device %s: %w", f.Name(), err)
	}
	return r, true, nil
}

// deviceRuleOf is the rule for the device node st describes, if it is one.
func deviceRuleOf(st *unix.Stat_t, access string) (DeviceRule, bool) {
	r := DeviceRule{
		// Rdev is 32 bits wide on some architectures.
		Major:  int64(unix.Major(uint64(st.Rdev))),
		Minor:  int64(unix.Minor(uint64(st.Rdev))),
		Access: access,
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFCHR:
		r.Type = 'c'
	case unix.S_IFBLK:
		r.Type = 'b'
	default:
		return DeviceRule{}, false
	}
	return r, true
}

// setV1Devices denies every device to the v1 devices group dir, then
// allows the rules, one write each, as the kernel wants them.
func setV1Devices(dir string, rules []DeviceRule) error {
	if err := writeFile(filepath.Join(dir, "devices.deny"), "a"); err != nil {
		return err
	}
	for _, r := range rules {
		if err := writeFile(filepath.Join(dir, "devices.allow"), r.String()); err != nil {
			return err
		}
	}
	return nil
}

// setV2Devices attaches to the v2 group dir a BPF_PROG_TYPE_CGROUP_DEVICE
// program that allows the rules and denies everything else, in place of
// the one an earlier call attached. Tests on a fake tree replace it.
var setV2Devices = attachDeviceProgram

// attachDeviceProgram builds the program with opencontainers/cgroups, the
// library runc uses: its emulator gives the rules cgroup v1's meaning, and
// it attaches with BPF_PROG_ATTACH and BPF_F_ALLOW_MULTI, so the program
// stays attached (the cgroup holds it) after this process exits, until
// the group is removed. It fails rather than leave the group unfiltered:
// the library skips a failed load only in a user namespace or when every
// rule allows everything, and the deny-all rule first rules out both.
func attachDeviceProgram(dir string, rules []DeviceRule) error {
	if ocgroups.DevicesSetV2 == nil {
		return errors.New("the cgroup v2 device filter is not built in")
	}
	oc := make([]*ocdevices.Rule, 0, len(rules)+1)
	oc = append(oc, &ocdevices.Rule{Type: ocdevices.WildcardDevice, Major: -1, Minor: -1, Permissions: "rwm", Allow: false})
	for _, r := range rules {
		oc = append(oc, &ocdevices.Rule{
			Type:        ocdevices.Type(r.Type),
			Major:       r.Major,
			Minor:       r.Minor,
			Permissions: ocdevices.Permissions(r.Access),
			Allow:       true,
		})
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failed to open cgroup %s: %w", dir, err)
	}
	defer unix.Close(fd)
	before, err := deviceProgramIDs(fd)
	if err != nil {
		return fmt.Errorf("failed to list the device programs of cgroup %s: %w", dir, err)
	}
	// The library lifts RLIMIT_MEMLOCK to load the program on kernels
	// before 5.11; put it back, or every task started from this process
	// afterwards inherits an unlimited one.
	var memlock unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &memlock); err != nil {
		return fmt.Errorf("failed to read RLIMIT_MEMLOCK: %w", err)
	}
	err = ocgroups.DevicesSetV2(dir, &ocgroups.Resources{Devices: oc})
	if rerr := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &memlock); rerr != nil {
		err = errors.Join(err, fmt.Errorf("failed to restore RLIMIT_MEMLOCK: %w", rerr))
	}
	if err != nil {
		return fmt.Errorf("failed to attach the device filter to cgroup %s: %w", dir, err)
	}
	// The library replaces a group's one earlier program, but with
	// cilium/ebpf before v0.22.0 (cilium/ebpf#1994) that attach leaves the
	// old program in place beside the new one. Both apply, so nothing more
	// is allowed, but the new rules could not widen the old ones: detach
	// what was there before, now that the new program is attached.
	after, err := deviceProgramIDs(fd)
	if err != nil {
		return fmt.Errorf("failed to list the device programs of cgroup %s: %w", dir, err)
	}
	for _, id := range after {
		if slices.Contains(before, id) {
			if err := detachDeviceProgram(fd, id); err != nil {
				return fmt.Errorf("failed to detach the earlier device filter of cgroup %s: %w", dir, err)
			}
		}
	}
	return nil
}

// deviceProgramIDs lists the device programs attached to the cgroup
// directory fd itself (not those it inherits).
func deviceProgramIDs(fd int) ([]ebpf.ProgramID, error) {
	q, err := link.QueryPrograms(link.QueryOptions{Target: fd, Attach: ebpf.AttachCGroupDevice})
	if err != nil {
		return nil, err
	}
	ids := make([]ebpf.ProgramID, 0, len(q.Programs))
	for _, p := range q.Programs {
		ids = append(ids, p.ID)
	}
	return ids, nil
}

func detachDeviceProgram(fd int, id ebpf.ProgramID) error {
	prog, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return err
	}
	defer prog.Close()
	return link.RawDetachProgram(link.RawDetachProgramOptions{Target: fd, Program: prog, Attach: ebpf.AttachCGroupDevice})
}

// DeviceAllower opens, while the group's hierarchies are reachable by
// path, what it takes to let the group open more devices later: a task's
// launching thread calls allow once it has entered a root where cgroupfs
// is not mounted, with the block devices of its volumes (known only once
// they are published). done releases what was opened. A group without a
// device filter (or one Load found) gets an allow that does nothing.
func (g *Group) DeviceAllower() (allow func([]DeviceRule) error, done func(), err error) {
	nothing := func() {}
	if g.devices == nil {
		return func([]DeviceRule) error { return nil }, nothing, nil
	}
	switch g.version {
	case 1:
		dir := g.paths["devices"]
		fd, err := unix.Open(filepath.Join(dir, "devices.allow"), unix.O_WRONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, nil, fmt.Errorf("failed to open the device filter of cgroup %s: %w", dir, err)
		}
		allow := func(rules []DeviceRule) error {
			for _, r := range rules {
				if err := r.validate(); err != nil {
					return err
				}
				if _, err := unix.Write(fd, []byte(r.String())); err != nil {
					return fmt.Errorf("failed to allow device %s in cgroup %s: %w", r, dir, err)
				}
			}
			return nil
		}
		return allow, func() { _ = unix.Close(fd) }, nil
	default:
		dir := g.paths[unifiedKey]
		fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, nil, fmt.Errorf("failed to open cgroup %s: %w", dir, err)
		}
		allow := func(rules []DeviceRule) error {
			for _, r := range rules {
				if err := r.validate(); err != nil {
					return err
				}
			}
			all := append(append([]DeviceRule(nil), g.devices...), rules...)
			// The handle stands for the directory wherever this thread's
			// root now is.
			return setV2Devices(fmt.Sprintf("/proc/self/fd/%d", fd), all)
		}
		return allow, func() { _ = unix.Close(fd) }, nil
	}
}
