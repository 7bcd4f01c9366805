package csihook

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// needRoot skips a test that changes the group of files to a group the
// test's user is not in: only root may.
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: gives directories a group the test's user is not in")
	}
}

func statOf(t *testing.T, path string) *syscall.Stat_t {
	t.Helper()
	fi, err := os.Lstat(path)
	must.NoError(t, err)
	return fi.Sys().(*syscall.Stat_t)
}

func groupReq(name, vol, dest, group string, apply bool) VolumeRequest {
	r := req(name, vol, dest)
	r.AccessMode = AccessMultiNodeMultiWriter
	r.MountGroup, r.ApplyMountGroup = group, apply
	return r
}

// A plugin with VOLUME_MOUNT_GROUP gets the task's group in the volume
// capability of both NodeStageVolume and NodePublishVolume, and the
// driver changes nothing itself even with mount_group = true.
func TestMountGroup_SentToPluginWithCapability(t *testing.T) {
	needRoot(t)
	h := newHarness(t)
	p := fullPlugin("p")
	p.VolumeMountGroup = true
	h.setPlugin(p)
	target := h.m.TargetPath("t1", "data")
	must.NoError(t, os.MkdirAll(target, 0o755))
	before := statOf(t, target)

	_, err := h.m.Setup(context.Background(), "t1", []VolumeRequest{groupReq("data", "v1", "/data", "65534", true)})
	must.NoError(t, err)
	for _, c := range h.fake.Calls() {
		switch c.Method {
		case MethodNodeStageVolume, MethodNodePublishVolume:
			must.Eq(t, "65534", c.Capability.GetMount().GetVolumeMountGroup(), must.Sprintf("%s", c.Method))
		case MethodControllerPublishVolume:
			must.Eq(t, "", c.Capability.GetMount().GetVolumeMountGroup())
		}
	}
	after := statOf(t, target)
	must.Eq(t, before.Gid, after.Gid)
	must.Eq(t, before.Mode, after.Mode)

	// A restart and a restage (the staging mount is gone) send it again:
	// the journal keeps it.
	must.NoError(t, h.mnt.Unmount(h.m.StagingPath("p", "v1")))
	h.restart()
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	h.waitIdle()
	n := 0
	for _, c := range h.fake.Calls() {
		if c.Method == MethodNodeStageVolume {
			n++
			must.Eq(t, "65534", c.Capability.GetMount().GetVolumeMountGroup())
		}
	}
	must.Positive(t, n)
}

// Without the capability the group is never sent; with mount_group =
// true the driver gives the volume's root directory the group, setgid and
// g+rwx after publishing, and nothing below it; without it, nothing.
func TestMountGroup_AppliedByDriverWithoutCapability(t *testing.T) {
	needRoot(t)
	for _, apply := range []bool{true, false} {
		t.Run(map[bool]string{true: "mount_group", false: "no_option"}[apply], func(t *testing.T) {
			h := newHarness(t)
			target := h.m.TargetPath("t1", "data")
			must.NoError(t, os.MkdirAll(target, 0o755))
			inner := filepath.Join(target, "old-file")
			must.NoError(t, os.WriteFile(inner, nil, 0o644))

			_, err := h.m.Setup(context.Background(), "t1", []VolumeRequest{groupReq("data", "v1", "/data", "65534", apply)})
			must.NoError(t, err)
			for _, c := range h.fake.Calls() {
				if m := c.Capability.GetMount(); m != nil {
					must.Eq(t, "", m.GetVolumeMountGroup(), must.Sprintf("%s", c.Method))
				}
			}
			st := statOf(t, target)
			if apply {
				must.Eq(t, uint32(65534), st.Gid)
				must.Eq(t, uint32(unix.S_ISGID|0o775), st.Mode&0o7777)
			} else {
				must.Eq(t, uint32(0), st.Gid)
				must.Eq(t, uint32(0o755), st.Mode&0o7777)
			}
			// Not recursive: what is inside keeps its group.
			must.Eq(t, uint32(0), statOf(t, inner).Gid)
		})
	}
}

// applyVolumeGroup never follows a link at the target: a plugin (or a
// hostile volume) cannot point the change at a host path.
func TestApplyVolumeGroup_DoesNotFollowSymlink(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	host := filepath.Join(dir, "host-dir")
	must.NoError(t, os.Mkdir(host, 0o700))
	link := filepath.Join(dir, "target")
	must.NoError(t, os.Symlink(host, link))

	// O_NOFOLLOW with O_DIRECTORY answers a symlink with ENOTDIR.
	err := applyVolumeGroup(link, "65534")
	must.ErrorIs(t, err, unix.ENOTDIR)
	st := statOf(t, host)
	must.Eq(t, uint32(0), st.Gid)
	must.Eq(t, uint32(0o700), st.Mode&0o7777)

	must.ErrorContains(t, applyVolumeGroup(host, "nobody"), `the task's group "nobody" is not a numeric gid`)
}

// A failure to apply the group fails the setup and leaves nothing behind.
func TestMountGroup_ApplyFailureRollsBack(t *testing.T) {
	needRoot(t)
	h := newHarness(t)
	// The fake plugin makes no directory at the target: opening it fails.
	_, err := h.m.Setup(context.Background(), "t1", []VolumeRequest{groupReq("data", "v1", "/data", "65534", true)})
	must.ErrorContains(t, err, `volume "data": mount_group = true: failed to open the volume's root directory`)
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}

// Two tasks of different groups cannot share a volume; the same group can.
func TestMountGroup_ShareNeedsSameGroup(t *testing.T) {
	for _, capable := range []bool{true, false} {
		t.Run(map[bool]string{true: "capability", false: "applied"}[capable], func(t *testing.T) {
			h := newHarness(t)
			p := fullPlugin("p")
			p.VolumeMountGroup = capable
			h.setPlugin(p)
			if !capable {
				needRoot(t)
				for _, id := range []string{"t1", "t2", "t3"} {
					must.NoError(t, os.MkdirAll(h.m.TargetPath(id, "data"), 0o755))
				}
			}
			ctx := context.Background()
			_, err := h.m.Setup(ctx, "t1", []VolumeRequest{groupReq("data", "v1", "/data", "1000", true)})
			must.NoError(t, err)
			_, err = h.m.Setup(ctx, "t2", []VolumeRequest{groupReq("data", "v1", "/data", "1000", true)})
			must.NoError(t, err)
			_, err = h.m.Setup(ctx, "t3", []VolumeRequest{groupReq("data", "v1", "/data", "2000", true)})
			must.True(t, errors.Is(err, ErrConflict), must.Sprintf("%v", err))
			must.ErrorContains(t, err, "writable by group 1000; this task runs as group 2000")
		})
	}
}

func TestValidate_MountGroup(t *testing.T) {
	cases := []struct {
		name string
		set  func(r *VolumeRequest)
		want string
	}{
		{"block device", func(r *VolumeRequest) {
			r.AttachmentMode, r.FSType, r.MountFlags = AttachmentBlockDevice, "", nil
		}, `mount_group = true cannot be used with attachment_mode = "block-device"`},
		{"read only", func(r *VolumeRequest) {
			r.AccessMode, r.ReadOnly = AccessSingleNodeReaderOnly, true
		}, "mount_group = true makes the volume writable by the task's group, which a read-only volume cannot be"},
		{"bad group", func(r *VolumeRequest) { r.MountGroup = "wheel" }, `the task's group "wheel" is not a numeric gid`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := groupReq("data", "v1", "/data", "1000", true)
			tc.set(&r)
			err := validate([]VolumeRequest{r})
			must.ErrorIs(t, err, ErrInvalid)
			must.ErrorContains(t, err, tc.want)
		})
	}
	must.NoError(t, validate([]VolumeRequest{groupReq("data", "v1", "/data", "1000", true)}))
}

// A task that shares its allocation's publish of a single-node-writer
// volume with mount_group = true gets the volume's root its group, as its
// own publish would have, when the task that published it runs as root.
func TestMountGroup_AppliedForATaskSharingTheAllocationsPublish(t *testing.T) {
	needRoot(t)
	h := newHarness(t)
	target := h.m.TargetPath("alloc-a/app/1", "data")
	must.NoError(t, os.MkdirAll(target, 0o755))
	_, err := h.m.Setup(context.Background(), "alloc-a/app/1", []VolumeRequest{req("data", "v1", "/data")})
	must.NoError(t, err)
	must.Eq(t, uint32(0), statOf(t, target).Gid)

	r := req("data", "v1", "/data")
	r.MountGroup, r.ApplyMountGroup = "65534", true
	pubs, err := h.m.Setup(context.Background(), "alloc-a/sidecar/2", []VolumeRequest{r})
	must.NoError(t, err)
	must.Eq(t, target, pubs[0].HostPath)
	must.Len(t, 1, h.callsOf(MethodNodePublishVolume))
	st := statOf(t, target)
	must.Eq(t, uint32(65534), st.Gid)
	must.Eq(t, uint32(unix.S_ISGID|0o775), st.Mode&0o7777)
}
