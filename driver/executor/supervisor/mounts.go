package supervisor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// prepareNamespace and bindAll make the task's mounts in its fresh mount
// namespace (a copy of the host's, where the copies of shared mounts are
// still peers of the host's).
//
//  1. Every shared mount that is not a bidirectional source, nor inside one,
//     becomes a slave. Without bidirectional mounts (every task but a CSI
//     plugin's) that is one "rslave /", whatever the host mounts; with them
//     it is one mount at a time, since "rslave /" would cut the
//     bidirectional sources off the host too. From then on, new mounts in
//     the task do not reach the host, and host mounts still reach the
//     task.
//  2. Each Mount is bound onto its target (recursively). A bind of a shared
//     source joins the source's peer group; the bind itself does not leak
//     because the target's parent is now a slave. Then private mounts become
//     rprivate, host-to-task mounts rslave, and bidirectional ones stay
//     shared peers of the host. A target equal to its source that is
//     already a mount point is not bound again: only its propagation (and
//     read-only flag) is set.
//
// Any error ends the launching thread (see launchTask); the namespace, and
// every mount in it, dies with it, so nothing reaches the host.
//
// With root set, the task also gets a root of its own, assembled at root (a
// directory on the host, in the task's state directory) between the two
// steps and entered with pivot_root: see buildRoot, buildIsolatedRoot and,
// for a task whose root is an image, buildImageRoot. Mount targets are then
// made under it, so a missing top-level target ("/csi", "/local/csi",
// "/data") lands on the task's own tmpfs instead of the host's disk.
//
// prepareNamespace is step 1, and the assembly of the task's root at root
// when it is set.
func prepareNamespace(m mounter.Interface, mounts []wire.Mount, root string, iso *wire.Isolation, img *wire.ImageRoot) error {
	var bidi []string
	for _, mnt := range mounts {
		if mnt.Propagation != wire.PropagationBidirectional {
			continue
		}
		src, err := filepath.EvalSymlinks(mnt.Source)
		if err != nil {
			return fmt.Errorf("mount %q: %w", mnt.Source, err)
		}
		bidi = append(bidi, src)
	}

	if len(bidi) == 0 {
		// One call, where a mount at a time cost every task a mount(2)
		// per shared mount of the host: two per CSI volume published on
		// the node (under root_dir/mnt, which is shared), so that each
		// start took longer the more tasks ran, and hundreds of tasks
		// starting together took time in the square of their number.
		// MS_SLAVE leaves private and unbindable mounts as they are.
		if err := m.SetPropagation("/", mounter.PropagationSlave, true); err != nil {
			return err
		}
		return enterNewRoot(m, root, iso, img)
	}

	table, err := m.List()
	if err != nil {
		return err
	}
	// Deepest first, so that a parent's change never races a child's.
	sort.SliceStable(table, func(i, j int) bool {
		return strings.Count(table[i].Path, "/") > strings.Count(table[j].Path, "/")
	})
	for _, mp := range table {
		if !mp.Shared || mounter.WithinAny(mp.Path, bidi) {
			continue
		}
		if err := m.SetPropagation(mp.Path, mounter.PropagationSlave, false); err != nil {
			if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.EINVAL) {
				// Overmounted or deleted, or unmounted on the host since the
				// table was read (the path is no mount point any more, and
				// the mount, gone, can no longer reach the host):
				// unreachable by path from the task.
				continue
			}
			return err
		}
	}

	return enterNewRoot(m, root, iso, img)
}

// enterNewRoot assembles the task's root at root, when it is set: from
// its image (img), or of the host's paths.
func enterNewRoot(m mounter.Interface, root string, iso *wire.Isolation, img *wire.ImageRoot) error {
	switch {
	case root == "":
		return nil
	case img != nil:
		return buildImageRoot(m, root, img, iso)
	case iso != nil:
		return buildIsolatedRoot(m, root, iso)
	default:
		return buildRoot(m, root)
	}
}

// bindAll is step 2: parents before children, so that a
// target inside another mount's target lands on top of it.
func bindAll(m mounter.Interface, mounts []wire.Mount, root string) error {
	ordered := append([]wire.Mount(nil), mounts...)
	sort.SliceStable(ordered, func(i, j int) bool {
		return depth(ordered[i].Target) < depth(ordered[j].Target)
	})
	for _, mnt := range ordered {
		if err := bindOne(m, mnt, root); err != nil {
			return err
		}
	}
	return nil
}

func depth(target string) int { return strings.Count(filepath.Clean(target), "/") }

// mountRootTmpfs makes root, an existing directory on the host, the tmpfs
// of a task's root: unbindable, so that recursive binds into it never copy
// it into itself.
//
// root is never made here, nor is anything else on the way to it: a
// spare's root is a directory the driver made, and the driver (or a reset
// of the spares directory) may remove it while the spare prepares. A
// removal detaches the tmpfs from this namespace too (rmdir(2) of a
// directory that is a mount point elsewhere unmounts it there), and a
// directory made again would be the host's, outside the namespace's
// mounts: every entry the build made next would land on the host's disk,
// under a directory that nobody removes. The build fails instead.
func mountRootTmpfs(m mounter.Interface, root string) error {
	if err := m.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755"); err != nil {
		return fmt.Errorf("failed to make the task's root: %w", err)
	}
	if err := m.SetPropagation(root, mounter.PropagationUnbindable, false); err != nil {
		return fmt.Errorf("failed to make the task's root: %w", err)
	}
	return nil
}

// buildRoot assembles the task's root at root: a tmpfs holding a recursive
// bind of every top-level entry of the host's root (and its symlinks as
// they are), so the task sees the host's files and, through the binds
// (slaves of the host's mounts by now), the host's later mounts under
// them. The tmpfs is unbindable, so the recursive binds do not copy it into
// itself; binds of shared mounts (the bidirectional sources) join their
// peer groups as before.
func buildRoot(m mounter.Interface, root string) error {
	if err := mountRootTmpfs(m, root); err != nil {
		return err
	}
	entries, err := os.ReadDir("/")
	if err != nil {
		return fmt.Errorf("failed to list the host's root: %w", err)
	}
	for _, e := range entries {
		src := "/" + e.Name()
		dst := filepath.Join(root, e.Name())
		fi, err := os.Lstat(src)
		if err != nil {
			continue // gone meanwhile
		}
		switch {
		case fi.Mode()&os.ModeSymlink != 0:
			link, err := os.Readlink(src)
			if err != nil {
				return fmt.Errorf("failed to read the host's %q: %w", src, err)
			}
			if err := os.Symlink(link, dst); err != nil {
				return fmt.Errorf("failed to make the task's %q: %w", src, err)
			}
			continue
		case fi.IsDir():
			if err := os.Mkdir(dst, fi.Mode().Perm()); err != nil {
				return fmt.Errorf("failed to make the task's %q: %w", src, err)
			}
		default:
			// Made in root, never with its parents: see mountRootTmpfs.
			f, err := m.OpenTarget(root, e.Name(), false)
			if err != nil {
				return fmt.Errorf("failed to make the task's %q: %w", src, err)
			}
			_ = f.Close()
		}
		if err := m.BindMount(src, dst, false, true); err != nil {
			return fmt.Errorf("failed to make the task's %q: %w", src, err)
		}
	}
	return nil
}

// enterRoot makes the assembled root read-only (nothing the task writes at
// its top level would outlive it anyway) and the task's root directory,
// dropping the host's root from the namespace.
func enterRoot(m mounter.Interface, root string) error {
	if err := pivotRoot(root); err != nil {
		return err
	}
	return sealRoot(m)
}

// pivotRoot makes root the calling thread's root directory, dropping the
// host's root from the namespace.
func pivotRoot(root string) error {
	oldRoot, err := unix.Open("/", unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failed to open the host's root: %w", err)
	}
	defer unix.Close(oldRoot)
	if err := os.Chdir(root); err != nil {
		return fmt.Errorf("failed to enter the task's root: %w", err)
	}
	// pivot_root(".", ".") stacks the old root on top of the new one;
	// detaching it leaves the new root alone, with no directory for the
	// old one to live in.
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("failed to enter the task's root: pivot_root: %w", err)
	}
	// The old root's copies of bidirectional sources, and of the mounts
	// inside them (CSI staging and publish mounts), are still shared peers
	// of the host's: detaching them as they are would unmount the host's
	// too. As slaves their unmount stays here. Only the old root's tree is
	// changed (through its descriptor: "." is the new root, under it); the
	// task's own binds of those sources stay peers.
	if err := unix.Fchdir(oldRoot); err != nil {
		return fmt.Errorf("failed to drop the host's root: %w", err)
	}
	if err := unix.Mount("", ".", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("failed to drop the host's root: making it a slave: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("failed to drop the host's root: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return fmt.Errorf("failed to enter the task's root: %w", err)
	}
	return nil
}

// sealRoot makes the task's root read-only, once it has been entered:
// only the root's own mount, not the mounts under it.
func sealRoot(m mounter.Interface) error {
	if err := m.RemountReadOnly("/", false); err != nil {
		return fmt.Errorf("failed to seal the task's root: %w", err)
	}
	return nil
}

func bindOne(m mounter.Interface, mnt wire.Mount, root string) error {
	source, target := filepath.Clean(mnt.Source), filepath.Clean(mnt.Target)
	same := source == target
	if root == "" {
		root = "/"
	}
	if !same {
		fi, err := os.Stat(source)
		if err != nil {
			return fmt.Errorf("mount %q: %w", mnt.Source, err)
		}
		// Made without following symlinks; the bind itself goes by path,
		// as a bind of a shared source must join its peer group.
		tf, err := m.OpenTarget(root, target, fi.IsDir())
		if err != nil {
			return fmt.Errorf("mount %q: %w", mnt.Source, err)
		}
		_ = tf.Close()
		// The path OpenTarget walked (in an image, with the image's own
		// symlinks resolved in the root): none is left on the way.
		target = tf.Name()
		if err := m.BindMount(source, target, mnt.ReadOnly, true); err != nil {
			return fmt.Errorf("mount %q: %w", mnt.Source, err)
		}
	} else {
		if it, ok := m.(*imageTargets); ok {
			// An image has no mount point of the host's here: made as above.
			fi, err := os.Stat(source)
			if err != nil {
				return fmt.Errorf("mount %q: %w", mnt.Source, err)
			}
			tf, err := it.OpenTarget(root, target, fi.IsDir())
			if err != nil {
				return fmt.Errorf("mount %q: %w", mnt.Source, err)
			}
			_ = tf.Close()
			target = tf.Name()
		} else {
			target = filepath.Join(root, target)
		}
		isMount, err := m.IsMountPoint(target)
		if err != nil {
			return fmt.Errorf("mount %q: %w", mnt.Source, err)
		}
		switch {
		case !isMount:
			// Propagation is a property of a mount: make one. Its parent
			// is a slave by now, so the self-bind stays in the task.
			if err := m.BindMount(source, target, mnt.ReadOnly, true); err != nil {
				return fmt.Errorf("mount %q: %w", mnt.Source, err)
			}
		case mnt.ReadOnly:
			if err := m.RemountReadOnly(target, true); err != nil {
				return fmt.Errorf("mount %q: %w", mnt.Source, err)
			}
		}
	}

	if err := setPropagation(m, mnt.Propagation, target); err != nil {
		return fmt.Errorf("mount %q: %w", mnt.Source, err)
	}
	return nil
}

// setPropagation gives the mount at target (and its submounts) the
// propagation a Mount asks for.
func setPropagation(m mounter.Interface, propagation, target string) error {
	mode, err := propagationMode(propagation)
	if err != nil || mode == "" {
		return err
	}
	return m.SetPropagation(target, mode, true)
}

// propagationMode is the mounter's mode for a mount's propagation, "" for
// a bidirectional one, which stays a peer of the host's source.
func propagationMode(propagation string) (string, error) {
	switch propagation {
	case "", wire.PropagationPrivate:
		return mounter.PropagationPrivate, nil
	case wire.PropagationHostToTask:
		return mounter.PropagationSlave, nil
	case wire.PropagationBidirectional:
		return "", nil
	default:
		return "", fmt.Errorf("unknown propagation %q", propagation)
	}
}

// attachTree mounts a volume's tree (from mounter.CloneTree on the host) at
// its target in the task's namespace, like bindOne does a bind: read-only
// when asked, with the propagation asked for. isolated: the task is not
// privileged.
func attachTree(m mounter.Interface, tree *os.File, mnt wire.Mount, root string, isolated bool) error {
	if root == "" {
		root = "/"
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(tree.Fd()), &st); err != nil {
		return fmt.Errorf("mount %q: %w", mnt.Target, err)
	}
	// The flags and the propagation go on the detached tree: the target's
	// path may lie where another task of the allocation can swap it (under
	// /alloc), or lead through an image's symlink to /proc/self/root, the
	// supervisor's root in the host's mount namespace, so nothing is done
	// by the target's path.
	// A device node (one of Nomad's devices, a block-device volume) is
	// read-only in an isolated task whatever the volume (MountReadOnly); a
	// privileged task gets it as bindOne binds Nomad's devices for it: as
	// asked.
	if err := m.LockTree(tree, wire.MountReadOnly(mnt.ReadOnly, isolated, st.Mode), mnt.NoSuid, mnt.NoDev); err != nil {
		return fmt.Errorf("mount %q: %w", mnt.Target, err)
	}
	if err := setTreePropagation(m, mnt.Propagation, tree); err != nil {
		return fmt.Errorf("mount %q: %w", mnt.Target, err)
	}
	tf, err := m.OpenTarget(root, filepath.Clean(mnt.Target), st.Mode&unix.S_IFMT == unix.S_IFDIR)
	if err != nil {
		return fmt.Errorf("mount %q: %w", mnt.Target, err)
	}
	err = m.AttachTreeAt(tree, tf)
	_ = tf.Close()
	if err != nil {
		return fmt.Errorf("mount %q: %w", mnt.Target, err)
	}
	// Attached in a shared mount (a privileged task's bidirectional
	// mount), the tree was made shared with it, a peer of the copy the
	// attach left there on the host: set again, through the handle, which
	// now names the attached tree.
	if err := setTreePropagation(m, mnt.Propagation, tree); err != nil {
		return fmt.Errorf("mount %q: %w", mnt.Target, err)
	}
	return nil
}

// setTreePropagation is setPropagation of a tree from CloneTree, by its
// handle.
func setTreePropagation(m mounter.Interface, propagation string, tree *os.File) error {
	mode, err := propagationMode(propagation)
	if err != nil || mode == "" {
		return err
	}
	return m.SetTreePropagation(tree, mode)
}
