package driver

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
)

// A hint before the failure. A CSI volume is mounted as its plugin made
// it, usually a root directory owned by root with mode 0755, and a task
// that is not privileged runs as nobody unless it names its user: its
// program then fails with "Permission denied" and nothing says why. Once a
// writable file-system volume is published, the driver compares the
// published root's owner, group and mode with the credential the task
// will run as (taskuser.Resolve, as the supervisor sets it) and, when the
// task cannot create files there, emits a task event that names the volume
// and the fixes: mount_group = true, or a user that can write it.
//
// The check only reads: one lstat and one getxattr of the root, never a
// write into the volume. A root with a POSIX ACL is not judged (the ACL
// may grant what the mode does not), nor is a task that holds
// CAP_DAC_OVERRIDE, nor a privileged one. The task starts either way: the
// hint may be wrong where the kernel knows more (an NFS server's own
// mapping, an id-mapped mount), and a task may not need to write its
// volume's root.
//
// What a hostile job can do with it: make its own task get an event that
// tells the owner, group and mode of its own volume's root, which the task
// can read itself. The root is read with lstat and lgetxattr on the
// publish target the driver made, so a plugin or an earlier user of the
// volume cannot point the check at another path with a symlink.

// volumeWriter is who a task's volumes are written by: its user and the
// capabilities that user holds after exec.
type volumeWriter struct {
	user string
	// cred is the credential the driver resolved for an image task (nil:
	// user is looked up on the host).
	cred *executor.Credential
	// caps is the task's capability set, which a root task holds;
	// ambient what a task of another user holds (its cap_add).
	caps, ambient []string
}

// canOverride reports whether the writer, once resolved to cred, holds
// CAP_DAC_OVERRIDE: it writes any directory whatever its mode.
func (w volumeWriter) canOverride(cred *taskuser.Credential) bool {
	held := w.ambient
	if cred.UID == 0 {
		held = w.caps
	}
	return slices.Contains(held, "DAC_OVERRIDE")
}

// rootInfo is what the hint reads of a published volume's root directory.
type rootInfo struct {
	uid, gid, mode uint32
	// acl is set when the directory has a POSIX access ACL.
	acl bool
}

// statVolumeRoot reads the root directory of a published volume without
// following a symlink; ok is false when it is not a directory or cannot be
// read, which the hint leaves alone.
func statVolumeRoot(path string) (rootInfo, bool) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return rootInfo{}, false
	}
	ri := rootInfo{uid: st.Uid, gid: st.Gid, mode: st.Mode & 0o7777}
	_, err := unix.Lgetxattr(path, "system.posix_acl_access", nil)
	switch {
	case err == nil:
		ri.acl = true
	case errors.Is(err, unix.ENODATA), errors.Is(err, unix.ENOTSUP), errors.Is(err, unix.EOPNOTSUPP):
	default:
		return rootInfo{}, false
	}
	return ri, true
}

// canCreate reports whether a process of cred (without CAP_DAC_OVERRIDE)
// may create entries in a directory of ri: the kernel checks the owner's
// bits for its owner, else the group's for a member of its group, else
// the others', and creating needs write and search.
func canCreate(cred *taskuser.Credential, ri rootInfo) bool {
	bits := ri.mode & 0o7
	switch {
	case cred.UID == ri.uid:
		bits = ri.mode >> 6 & 0o7
	case cred.GID == ri.gid || slices.Contains(cred.Groups, ri.gid):
		bits = ri.mode >> 3 & 0o7
	}
	return bits&0o3 == 0o3
}

// writeHint returns the event for a task that cannot create files in the
// root of its writable volume req, or "". vmg says the plugin has
// VOLUME_MOUNT_GROUP (it was given the task's group to apply).
func writeHint(req csihook.VolumeRequest, vmg bool, w volumeWriter, cred *taskuser.Credential, ri rootInfo) string {
	if ri.acl || w.canOverride(cred) || canCreate(cred, ri) {
		return ""
	}
	who := fmt.Sprintf("%s (uid %d, groups %s)", userOrRoot(w.user), cred.UID, groupList(cred))
	msg := fmt.Sprintf("Volume %q (volume_id %s) is not writable by the task's user %s: its root directory is owned by %d:%d with mode %04o.",
		req.Name, shortQuote(req.VolumeID), who, ri.uid, ri.gid, ri.mode)
	switch {
	case cred.UID == 0:
		// mount_group is refused for a root task.
		return msg + " Set the task's user to the volume's owner (uid " + strconv.FormatUint(uint64(ri.uid), 10) + "), or keep dac_override in its capabilities"
	case vmg:
		return msg + " The plugin was given the task's group (VOLUME_MOUNT_GROUP) but did not make the root writable by it: set the task's user to one that can write the volume (its owner, uid " + strconv.FormatUint(uint64(ri.uid), 10) + ")"
	case req.ApplyMountGroup:
		return msg + " Set the task's user to one that can write the volume (its owner, uid " + strconv.FormatUint(uint64(ri.uid), 10) + ")"
	}
	return msg + " Set mount_group = true in the volume block (the driver then gives the root the task's group), or set the task's user to one that can write it (its owner, uid " + strconv.FormatUint(uint64(ri.uid), 10) + ")"
}

func groupList(cred *taskuser.Credential) string {
	gs := []string{strconv.FormatUint(uint64(cred.GID), 10)}
	for _, g := range cred.Groups {
		gs = append(gs, strconv.FormatUint(uint64(g), 10))
	}
	return strings.Join(gs, ",")
}

// shortQuote quotes a job's string for an event, cut short when long.
func shortQuote(s string) string {
	const n = 64
	if len(s) > n {
		return fmt.Sprintf("%q...", s[:n])
	}
	return fmt.Sprintf("%q", s)
}

// writableFileSystem reports whether a request asks for a volume the task
// writes as a file system.
func writableFileSystem(req csihook.VolumeRequest) bool {
	if req.ReadOnly || req.AttachmentMode == csihook.AttachmentBlockDevice {
		return false
	}
	switch req.AccessMode {
	case csihook.AccessSingleNodeWriter, csihook.AccessMultiNodeSingleWriter, csihook.AccessMultiNodeMultiWriter:
		return true
	}
	return false
}

// hintUnwritable emits writeHint's event for each published volume the
// task w cannot write. Only tasks that are not privileged are checked.
func (d *Driver) hintUnwritable(emit func(msg string, annotations map[string]string), reqs []csihook.VolumeRequest,
	pubs []csihook.Published, w volumeWriter) {
	cred, err := credentialOf(w.user, w.cred)
	if err != nil {
		return // the supervisor reports the user
	}
	byName := make(map[string]csihook.VolumeRequest, len(reqs))
	for _, r := range reqs {
		byName[r.Name] = r
	}
	for _, p := range pubs {
		req, ok := byName[p.Name]
		if !ok || p.Block || !writableFileSystem(req) {
			continue
		}
		ri, ok := statVolumeRoot(p.HostPath)
		if !ok {
			continue
		}
		var vmg bool
		if info, err := d.lookupPlugin(req.PluginID); err == nil {
			vmg = info.VolumeMountGroup
		}
		if msg := writeHint(req, vmg, w, cred, ri); msg != "" {
			d.logger.Info("task cannot write its volume's root", "volume", req.Name, "volume_id", req.VolumeID,
				"uid", cred.UID, "owner", ri.uid, "group", ri.gid, "mode", fmt.Sprintf("%04o", ri.mode))
			emit(msg, map[string]string{"volume": req.Name, "plugin_id": req.PluginID, "volume_id": req.VolumeID})
		}
	}
}
