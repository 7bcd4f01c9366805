package csihook

import (
	"fmt"
	"strconv"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
)

// Non-root writers. A task that runs as a user other than root can write
// its volume in one of two ways:
//
//   - the plugin has the node capability VOLUME_MOUNT_GROUP: the task's
//     group goes to it in VolumeCapability.MountVolume.volume_mount_group
//     of NodeStageVolume and NodePublishVolume, and the plugin makes the
//     volume writable by that group (CSI spec; always sent, no option);
//   - otherwise, with mount_group = true in the volume block, the driver
//     gives the volume's root directory the task's group, the setgid bit
//     and g+rwx after each publish, as the kubelet's fsGroup does, but on
//     the root directory only (applyVolumeGroup).
//
// What a hostile job can do with it: the group is always the task's own
// resolved primary group (a job can choose it, as user = "name:gid" does,
// but only a gid its user passed denied_host_uids/denied_host_gids with,
// the gid the task runs as anyway), and only the root
// directory of the volume its own task is given changes. Nothing is
// followed: the publish target is opened with O_NOFOLLOW, so a plugin (or
// an earlier user of the volume) cannot point the change at a host path,
// and nothing inside the volume is walked, so links planted in a volume's
// content are never touched. Two tasks of different groups cannot share a
// volume (checkShare), so one cannot take a volume from the other.

// withMountGroup fits a request to its plugin: the group is sent only to
// a plugin with VOLUME_MOUNT_GROUP; to others it is applied by the driver
// when the job asked for it, or dropped.
func withMountGroup(req VolumeRequest, info PluginInfo) VolumeRequest {
	if req.MountGroup == "" {
		return req
	}
	if !info.VolumeMountGroup {
		if req.ApplyMountGroup && attachment(req) == AttachmentFileSystem && !req.ReadOnly && writerMode(req.AccessMode) {
			req.applyGroup = req.MountGroup
		}
		req.MountGroup = ""
	}
	return req
}

// effectiveGroup is the group a request makes its volume writable by, sent
// or applied; "" for none.
func effectiveGroup(mountGroup, applyGroup string) string {
	if mountGroup != "" {
		return mountGroup
	}
	return applyGroup
}

// withGroup sets a mount capability's volume_mount_group.
func withGroup(vc *csi.VolumeCapability, group string) *csi.VolumeCapability {
	if group == "" {
		return vc
	}
	if mv := vc.GetMount(); mv != nil {
		mv.VolumeMountGroup = group
	}
	return vc
}

// checkGroup checks a MountGroup the driver filled in: a gid in decimal.
func checkGroup(group string) error {
	if group == "" {
		return nil
	}
	if _, err := strconv.ParseUint(group, 10, 32); err != nil {
		return fmt.Errorf("the task's group %q is not a numeric gid", group)
	}
	return nil
}

// volumeGroupMode is what applyVolumeGroup adds to the root directory's
// mode: setgid, so that what the task creates inherits the group, and
// group read, write and search.
const volumeGroupMode = unix.S_ISGID | 0o070

// applyVolumeGroup gives the directory at path (a publish target) the group
// gid and adds volumeGroupMode to its mode. Only that directory changes:
// path's last component is not followed (O_NOFOLLOW with O_DIRECTORY: a
// symlink fails with ENOTDIR), the change goes through the opened descriptor, and nothing below
// it is walked. A recursive change as the kubelet makes costs a walk of the
// whole volume on every publish and would act on whatever an earlier user
// left inside it; the setgid bit makes new files take the group instead.
func applyVolumeGroup(path, group string) error {
	gid, err := strconv.ParseUint(group, 10, 32)
	if err != nil {
		return fmt.Errorf("the task's group %q is not a numeric gid", group)
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("failed to open the volume's root directory %q without following links: %w", path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("failed to stat the volume's root directory %q: %w", path, err)
	}
	if st.Gid != uint32(gid) {
		if err := unix.Fchown(fd, -1, int(gid)); err != nil {
			return fmt.Errorf("failed to give the volume's root directory %q group %d: %w", path, gid, err)
		}
	}
	mode := st.Mode & 0o7777
	if mode&volumeGroupMode != volumeGroupMode {
		if err := unix.Fchmod(fd, mode|volumeGroupMode); err != nil {
			return fmt.Errorf("failed to make the volume's root directory %q group-writable: %w", path, err)
		}
	}
	return nil
}

// checkGroupShareLocked refuses a request whose group differs from the
// group another task on this node uses the volume with: the volume's root
// can be writable by one group only. The caller holds m.mu.
func (m *Manager) checkGroupShareLocked(taskID string, req VolumeRequest, k volKey) error {
	want := effectiveGroup(req.MountGroup, req.applyGroup)
	if want == "" {
		return nil
	}
	for _, ref := range m.otherUsersLocked(k, taskID) {
		t := m.tasks[ref.taskID][ref.name]
		if got := effectiveGroup(t.MountGroup, t.ApplyGroup); got != "" && got != want {
			tid := ref.taskID
			return &conflictError{msg: fmt.Sprintf("volume %q: volume_id %q is in use on this node by task %q, writable by group %s; this task runs as group %s: run both tasks with the same group (the task's user) or stop task %q",
				req.Name, k.volume, tid, got, want, tid)}
		}
	}
	return nil
}
