package supervisor

import (
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	securejoin "github.com/cyphar/filepath-securejoin"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// imageScratchDir, in the task's state directory, is where the in-memory
// writable layer of a read-only image root is mounted (in the task's mount
// namespace only).
const imageScratchDir = "scratch"

// buildImageRoot assembles a task's root from its image at root (a
// directory of the task's state directory, StateDir/root): an overlay of
// the image's layers under the task's writable layer, then, for a task
// that is not privileged (iso set), the same /dev, /proc and /sys as
// buildIsolatedRoot makes, and for a privileged one the host's /dev, /sys
// and /proc and, read-only, /lib/modules: what Docker's --privileged gives
// a container, inside the image instead of the host's root.
//
// The overlay of a task that is not privileged is nosuid and nodev: a
// setuid or file-capability binary of the image runs without gaining
// anything (no_new_privs already says so; nosuid says it again, for every
// process of the task), and a device node in the image opens nothing. A
// privileged task gets them as the image has them.
func buildImageRoot(m mounter.Interface, root string, img *wire.ImageRoot, iso *wire.Isolation) error {
	stateDir := filepath.Dir(root)
	if err := os.MkdirAll(root, 0o755); err != nil {
		return fmt.Errorf("failed to create the task's root %q: %w", root, err)
	}
	layerDir := stateDir
	if img.ReadOnly {
		// The overlay still needs an upper layer for the mount points made
		// below; it lives in memory, in this namespace, and the root is
		// made read-only once they are made.
		layerDir = filepath.Join(stateDir, imageScratchDir)
		if err := os.MkdirAll(layerDir, 0o700); err != nil {
			return fmt.Errorf("failed to make the task's read-only root: %w", err)
		}
		if err := m.Mount("tmpfs", layerDir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0700,size=1m"); err != nil {
			return fmt.Errorf("failed to make the task's read-only root: %w", err)
		}
	}
	upper, work := filepath.Join(layerDir, wire.ImageUpperDir), filepath.Join(layerDir, wire.ImageWorkDir)
	// The upper layer's own directory is the root directory the task sees.
	if err := os.MkdirAll(upper, 0o755); err != nil {
		return fmt.Errorf("failed to make the task's writable layer: %w", err)
	}
	if err := os.Chmod(upper, 0o755); err != nil {
		return fmt.Errorf("failed to make the task's writable layer: %w", err)
	}
	if err := os.MkdirAll(work, 0o700); err != nil {
		return fmt.Errorf("failed to make the task's writable layer: %w", err)
	}
	isolated := iso != nil
	err := m.MountOverlay(root, mounter.Overlay{Lower: img.Layers, Upper: upper, Work: work, NoSuid: isolated, NoDev: isolated})
	if err != nil {
		return fmt.Errorf("failed to make the task's root from image %s: %w", imageName(img), err)
	}
	// As the tmpfs of the other roots: recursive binds into it never copy
	// it into itself.
	if err := m.SetPropagation(root, mounter.PropagationUnbindable, false); err != nil {
		return fmt.Errorf("failed to make the task's root: %w", err)
	}
	for _, d := range []string{"dev", "proc", "sys"} {
		if err := imageDir(root, d); err != nil {
			return err
		}
	}
	if isolated {
		return buildKernelDirs(m, root, iso)
	}
	for _, d := range []string{"/dev", "/sys", "/proc"} {
		if err := m.BindMount(d, filepath.Join(root, d), false, true); err != nil {
			return fmt.Errorf("failed to give the task the host's %s: %w", d, err)
		}
	}
	if fi, err := os.Stat(hostModules); err == nil && fi.IsDir() {
		dst, err := inImage(root, modulesTarget)
		if err != nil {
			return fmt.Errorf("failed to give the task the host's %s: %w", hostModules, err)
		}
		if err := bindReadOnly(m, hostModules, root, dst, true); err != nil {
			return fmt.Errorf("failed to give the task the host's %s: %w", hostModules, err)
		}
	}
	return nil
}

// hostModules is the host's kernel modules, which a privileged task sees
// read-only at the same path (a plugin that loads nfs or iscsi_tcp with
// modprobe). A variable for tests.
var hostModules = "/lib/modules"

// modulesTarget is where a privileged image task sees them.
const modulesTarget = "/lib/modules"

// imageDir makes the directory name at the top of an image root, unless
// the image has it: an image whose /dev, /proc or /sys is anything but a
// directory (a symlink, a file) is refused.
func imageDir(root, name string) error {
	if err := mkdirOrDir(filepath.Join(root, name), 0o755); err != nil {
		return fmt.Errorf("the image's /%s cannot be the task's: %w", name, err)
	}
	return nil
}

// inImage resolves path in the image root at root as the task will see it
// (an absolute symlink from the root, ".." never above it), and returns
// the resolved path, relative to the root as an absolute path: /lib/modules
// is /usr/lib/modules in an image whose /lib is a symlink to usr/lib.
// Only for paths in the image's own directories, before the task runs:
// nothing of the task can have changed them yet.
func inImage(root, path string) (string, error) {
	real, err := securejoin.SecureJoin(root, path)
	if err != nil {
		return "", err
	}
	rel, err := filepath.Rel(root, real)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", fmt.Errorf("%q resolves outside the task's root", path)
	}
	return filepath.Join("/", rel), nil
}

// imageName names an image root in messages.
func imageName(img *wire.ImageRoot) string {
	switch {
	case img.Ref != "" && img.Digest != "":
		return fmt.Sprintf("%q (%s)", img.Ref, img.Digest)
	case img.Ref != "":
		return fmt.Sprintf("%q", img.Ref)
	case img.Digest != "":
		return img.Digest
	}
	return fmt.Sprintf("of %d layers", len(img.Layers))
}

// imageTargets is the mounter of an image task's launching thread: the
// targets of the task's mounts are opened as the task will see the image,
// with the image's own symlinks followed inside the root (/var/run ->
// /run, /lib -> usr/lib), while the target of a mount inside another of the
// task's mounts (Nomad's /alloc, which other tasks of the allocation can
// write, a volume), or inside /dev, /proc or /sys, is still never made
// through a symlink.
type imageTargets struct {
	mounter.Interface
	// root is the image root before pivot_root; "/" is it after.
	root string
	// mounted are the targets of the task's own mounts, and /dev, /proc
	// and /sys.
	mounted []string
}

func newImageTargets(m mounter.Interface, root string, spec *wire.Spec) *imageTargets {
	t := &imageTargets{Interface: m, root: root, mounted: []string{"/dev", "/proc", "/sys"}}
	for _, list := range [][]wire.Mount{spec.Mounts, spec.LateMounts} {
		for _, mnt := range list {
			t.mounted = append(t.mounted, filepath.Clean(mnt.Target))
		}
	}
	return t
}

func (t *imageTargets) OpenTarget(root, path string, isDir bool) (*os.File, error) {
	if root == t.root || root == "/" {
		clean := filepath.Clean("/" + path)
		inside := false
		for _, m := range t.mounted {
			if clean != m && mounter.PathWithin(clean, m) {
				inside = true
				break
			}
		}
		if !inside {
			real, err := inImage(root, clean)
			if err != nil {
				return nil, fmt.Errorf("mount target %q: %w", clean, err)
			}
			// The image's symlinks may not steer a mount onto or into
			// another of the task's mounts, /dev, /proc or /sys (a
			// symlink /etc/resolv.conf -> /proc/sys/kernel/core_pattern).
			if real != clean {
				for _, m := range t.mounted {
					if mounter.PathWithin(real, m) {
						return nil, fmt.Errorf("mount target %q leads through the image's symlinks to %q, inside the task's %s, which the image cannot take: %w",
							clean, real, m, mounter.ErrSymlinkTarget)
					}
				}
			}
			path = real
		}
	}
	return t.Interface.OpenTarget(root, path, isDir)
}

// checkStaticExe refuses a supervisor binary that needs a program
// interpreter (the dynamic loader): the seccomp stage is that binary, run
// as the task inside its root, and an image has no loader of the host's,
// or none at all. The driver's embedded supervisor (make dev) is static.
func checkStaticExe(exe *os.File) error {
	f, err := elf.NewFile(exe)
	if err != nil {
		return fmt.Errorf("failed to read the supervisor's binary: %w", err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return errors.New("the supervisor's binary is dynamically linked and cannot start a task inside an image: " +
				"install the driver built with its static supervisor (make dev embeds it)")
		}
	}
	return nil
}
