package mounter

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Overlay is an overlay file system for MountOverlay.
type Overlay struct {
	// Lower are the read-only layers, lowest (the base) first. Their
	// paths must not hold ':', ',' or '\' (overlay's option syntax).
	Lower []string
	// Upper and Work are the writable layer and overlay's work directory,
	// empty directories on one file system.
	Upper, Work string
	// NoSuid and NoDev make the mount nosuid and nodev.
	NoSuid, NoDev bool
}

// overlayOptions are set on every overlay the driver mounts: its lower
// layers are images, content from outside, so overlay follows no redirect
// and no metacopy a layer could carry in its trusted.overlay xattrs, and
// keeps no index (the layers are shared by overlays with other uppers).
var overlayOptions = [][2]string{{"redirect_dir", "nofollow"}, {"metacopy", "off"}, {"index", "off"}}

// legacyDataMax is the longest option string mount(2) takes: one page,
// with its terminating NUL.
var legacyDataMax = os.Getpagesize() - 1

func checkOverlay(o Overlay) error {
	if len(o.Lower) == 0 {
		return errors.New("an overlay needs at least one lower layer")
	}
	if o.Upper == "" || o.Work == "" {
		return errors.New("an overlay needs an upper and a work directory")
	}
	for _, p := range append([]string{o.Upper, o.Work}, o.Lower...) {
		if !strings.HasPrefix(p, "/") {
			return fmt.Errorf("overlay layer %q must be an absolute path", p)
		}
		if strings.ContainsAny(p, ":,\\") {
			return fmt.Errorf("overlay layer %q holds ':', ',' or '\\', which overlay's options cannot carry", p)
		}
	}
	return nil
}

// MountOverlay mounts the overlay o at target.
//
// Where the kernel has overlay's "lowerdir+" (Linux 6.8), the overlay is
// made with the new mount API (fsopen, one fsconfig per layer, fsmount,
// move_mount): no limit on the number of layers but overlay's own (500),
// and the kernel's own message on an error. Older kernels get mount(2),
// whose option string must fit in a page: when the layers' paths do not,
// each layer is named by a descriptor, as "N" relative to /proc/self/fd,
// the calling thread's working directory for the call (so call it only
// on a locked OS thread with a filesystem context of its own, as for
// DetachAt).
func (m *mounter) MountOverlay(target string, o Overlay) error {
	if err := checkOverlay(o); err != nil {
		return fmt.Errorf("failed to mount an overlay on %q: %w", target, err)
	}
	m.logger.Debug("mounting overlay", "target", target, "layers", len(o.Lower), "upper", o.Upper)
	err := mountOverlayFS(target, o)
	if errors.Is(err, errNoLowerdirPlus) {
		err = mountOverlayLegacy(target, o, legacyDataMax)
	}
	if err != nil {
		return fmt.Errorf("failed to mount an overlay of %d layers on %q: %w", len(o.Lower), target, err)
	}
	return nil
}

// errNoLowerdirPlus says the kernel's overlay lacks "lowerdir+".
var errNoLowerdirPlus = errors.New("overlay has no lowerdir+ (Linux 6.8)")

// mountOverlayFS mounts o with the new mount API and lowerdir+.
func mountOverlayFS(target string, o Overlay) error {
	fsfd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("fsopen: %w", err)
	}
	defer unix.Close(fsfd)
	set := func(key, value string) error {
		if err := unix.FsconfigSetString(fsfd, key, value); err != nil {
			return fmt.Errorf("fsconfig %s=%q: %w%s", key, value, err, fsLog(fsfd))
		}
		return nil
	}
	// lowerdir+ appends below the layers given before: the top first.
	for i := len(o.Lower) - 1; i >= 0; i-- {
		err := unix.FsconfigSetString(fsfd, "lowerdir+", o.Lower[i])
		if err == nil {
			continue
		}
		msg := fsLog(fsfd)
		// A kernel without it calls the parameter unknown (or, older
		// still, logs nothing).
		if i == len(o.Lower)-1 && errors.Is(err, unix.EINVAL) && (msg == "" || strings.Contains(msg, "nknown parameter")) {
			return errNoLowerdirPlus
		}
		return fmt.Errorf("fsconfig lowerdir+=%q: %w%s", o.Lower[i], err, msg)
	}
	if err := set("upperdir", o.Upper); err != nil {
		return err
	}
	if err := set("workdir", o.Work); err != nil {
		return err
	}
	for _, opt := range overlayOptions {
		if err := set(opt[0], opt[1]); err != nil {
			return err
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		msg := fsLog(fsfd)
		// Before Linux 6.5 overlay takes its options the legacy way:
		// fsconfig stores any key, lowerdir+ too, and only the create
		// fails, with EINVAL and nothing logged (overlay's reason goes to
		// the kernel log). Overlay on the new API logs its reason.
		if errors.Is(err, unix.EINVAL) && msg == "" {
			return errNoLowerdirPlus
		}
		return fmt.Errorf("fsconfig create: %w%s", err, msg)
	}
	var attrs int
	if o.NoSuid {
		attrs |= unix.MOUNT_ATTR_NOSUID
	}
	if o.NoDev {
		attrs |= unix.MOUNT_ATTR_NODEV
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, attrs)
	if err != nil {
		return fmt.Errorf("fsmount: %w%s", err, fsLog(fsfd))
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("move_mount: %w", err)
	}
	return nil
}

// fsLog reads what the kernel logged on a file system context (its
// reason for an EINVAL), as ": e overlay: ..." lines, or "".
func fsLog(fsfd int) string {
	var out []string
	buf := make([]byte, 1024)
	for range 16 {
		n, err := unix.Read(fsfd, buf)
		if err != nil || n <= 0 {
			break
		}
		out = append(out, strings.TrimSpace(string(buf[:n])))
	}
	if len(out) == 0 {
		return ""
	}
	return " (" + strings.Join(out, "; ") + ")"
}

// overlayData is mount(2)'s option string for o, with lower as the
// lowerdir names (top first).
func overlayData(o Overlay, lower []string) string {
	var b strings.Builder
	b.WriteString("lowerdir=")
	b.WriteString(strings.Join(lower, ":"))
	b.WriteString(",upperdir=" + o.Upper + ",workdir=" + o.Work)
	for _, opt := range overlayOptions {
		b.WriteString("," + opt[0] + "=" + opt[1])
	}
	return b.String()
}

// mountOverlayLegacy mounts o with mount(2), whose options must fit in max
// bytes: by the layers' paths when they do, else by descriptors named
// relative to /proc/self/fd.
func mountOverlayLegacy(target string, o Overlay, max int) error {
	var flags uintptr
	if o.NoSuid {
		flags |= unix.MS_NOSUID
	}
	if o.NoDev {
		flags |= unix.MS_NODEV
	}
	top := make([]string, 0, len(o.Lower))
	for i := len(o.Lower) - 1; i >= 0; i-- {
		top = append(top, o.Lower[i])
	}
	if data := overlayData(o, top); len(data) <= max {
		if err := unix.Mount("overlay", target, "overlay", flags, data); err != nil {
			return fmt.Errorf("mount: %w", err)
		}
		return nil
	}
	names := make([]string, 0, len(top))
	for _, p := range top {
		fd, err := unix.Open(p, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("failed to open layer %q: %w", p, err)
		}
		defer unix.Close(fd)
		names = append(names, strconv.Itoa(fd))
	}
	data := overlayData(o, names)
	if len(data) > max {
		return fmt.Errorf("the options of %d layers take %d bytes even by descriptor, more than mount(2) takes (%d): the kernel needs lowerdir+ (Linux 6.8) for so many", len(top), len(data), max)
	}
	// target may be relative: it is resolved before the working directory
	// moves.
	tfd, err := unix.Open(target, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failed to open the overlay's target: %w", err)
	}
	defer unix.Close(tfd)
	cwd, err := unix.Open(".", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failed to open the working directory: %w", err)
	}
	defer unix.Close(cwd)
	if err := unix.Chdir("/proc/self/fd"); err != nil {
		return fmt.Errorf("failed to enter /proc/self/fd: %w", err)
	}
	err = unix.Mount("overlay", fmt.Sprintf("/proc/self/fd/%d", tfd), "overlay", flags, data)
	if cerr := unix.Fchdir(cwd); cerr != nil && err == nil {
		err = fmt.Errorf("failed to return to the working directory: %w", cerr)
	}
	if err != nil {
		return fmt.Errorf("mount (layers by descriptor): %w", err)
	}
	return nil
}
