package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// ---- mountinfo ----

// mountPoints returns the set of mount points in /proc/self/mountinfo.
func mountPoints() (map[string]bool, error) {
	table, err := mounter.New().List()
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, mp := range table {
		out[mp.Path] = true
	}
	return out, nil
}

func isMountPoint(path string) bool {
	mps, err := mountPoints()
	return err == nil && mps[filepath.Clean(path)]
}

// ---- mounts ----

// mountFlagBits are the mount_flags the kernel takes as MS_* bits; any
// other flag is passed to the filesystem as data.
var mountFlagBits = map[string]struct {
	clear bool
	bit   uintptr
}{
	"ro": {false, unix.MS_RDONLY}, "rw": {true, unix.MS_RDONLY},
	"nosuid": {false, unix.MS_NOSUID}, "suid": {true, unix.MS_NOSUID},
	"nodev": {false, unix.MS_NODEV}, "dev": {true, unix.MS_NODEV},
	"noexec": {false, unix.MS_NOEXEC}, "exec": {true, unix.MS_NOEXEC},
	"sync": {false, unix.MS_SYNCHRONOUS}, "async": {true, unix.MS_SYNCHRONOUS},
	"dirsync": {false, unix.MS_DIRSYNC}, "noatime": {false, unix.MS_NOATIME},
	"nodiratime": {false, unix.MS_NODIRATIME}, "relatime": {false, unix.MS_RELATIME},
	"strictatime": {false, unix.MS_STRICTATIME}, "defaults": {true, 0},
}

// parseMountFlags splits CSI mount_flags (each may hold several
// comma-separated options) into MS_* bits and filesystem data.
func parseMountFlags(flags []string) (bits uintptr, data []string) {
	for _, f := range flags {
		for _, o := range strings.Split(f, ",") {
			o = strings.TrimSpace(o)
			if o == "" {
				continue
			}
			if m, ok := mountFlagBits[o]; ok {
				if m.clear {
					bits &^= m.bit
				} else {
					bits |= m.bit
				}
				continue
			}
			data = append(data, o)
		}
	}
	return bits, data
}

// bindMount binds src at dst and, when there are flags, remounts the bind
// with them (a bind takes its flags only on remount).
func bindMount(src, dst string, bits uintptr) error {
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("failed to bind %q at %q: %w", src, dst, err)
	}
	if bits == 0 {
		return nil
	}
	if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|bits, ""); err != nil {
		_ = unix.Unmount(dst, 0)
		return fmt.Errorf("failed to remount the bind at %q with flags %#x: %w", dst, bits, err)
	}
	return nil
}

// unmountAll unmounts everything stacked at path.
func unmountAll(path string) error {
	for i := 0; i < 8 && isMountPoint(path); i++ {
		if err := unix.Unmount(path, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("failed to unmount %q: %w", path, err)
		}
	}
	if isMountPoint(path) {
		return fmt.Errorf("%q is still mounted after unmounting it", path)
	}
	return nil
}

// statID returns the identity of path: its device and inode, and for a
// device node the device it stands for.
func statID(path string) (dev, ino uint64, rdev uint64, mode uint32, err error) {
	var st unix.Stat_t
	if err = unix.Stat(path, &st); err != nil {
		return
	}
	return st.Dev, st.Ino, st.Rdev, st.Mode, nil
}

// hasCapability reports whether this process has capability c effective.
func hasCapability(c int) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if hex, ok := strings.CutPrefix(line, "CapEff:"); ok {
			mask, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			return err == nil && mask&(1<<uint(c)) != 0
		}
	}
	return false
}

// ---- loop devices ----

// loopMu serialises attaching, so two stages cannot race for one free device.
var loopMu sync.Mutex

// loopBacking returns the file a loop device is attached to, or "".
func loopBacking(dev string) string {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// loopFor finds the loop device attached to image, or "".
func loopFor(image string) string {
	devs, _ := filepath.Glob("/sys/block/loop*")
	for _, d := range devs {
		if loopBacking(d) == image {
			return "/dev/" + filepath.Base(d)
		}
	}
	return ""
}

func loopAttach(ctx context.Context, image string) (string, error) {
	loopMu.Lock()
	defer loopMu.Unlock()
	if dev := loopFor(image); dev != "" {
		return dev, nil
	}
	out, err := runCmd(ctx, "losetup", "--find", "--show", image)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(out), nil
}

func loopDetach(ctx context.Context, dev string) error {
	if loopBacking(dev) == "" {
		return nil
	}
	_, err := runCmd(ctx, "losetup", "--detach", dev)
	return err
}

// loopSize is the size the kernel sees for a loop device.
func loopSize(dev string) int64 {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "size"))
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n * 512
}

// runCmd runs one of the few tools the fixture needs (mkfs.ext4, resize2fs,
// losetup) with a deadline, and puts its output in the error.
func runCmd(ctx context.Context, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s %s failed: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}
