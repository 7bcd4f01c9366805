package driver

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
)

// canCreate follows the kernel's order: the owner's bits for the owner
// (even when the group's would allow), else the group's for a member (by
// primary or supplementary group), else the others'; creating needs write
// and search.
func TestCanCreate(t *testing.T) {
	nobody := &taskuser.Credential{UID: 65534, GID: 65534}
	member := &taskuser.Credential{UID: 1000, GID: 1000, Groups: []uint32{27, 44}}
	cases := []struct {
		name string
		cred *taskuser.Credential
		ri   rootInfo
		want bool
	}{
		{"root's 0755, nobody", nobody, rootInfo{uid: 0, gid: 0, mode: 0o755}, false},
		{"root's 0777, nobody", nobody, rootInfo{uid: 0, gid: 0, mode: 0o777}, true},
		{"root's 1777 (sticky), nobody", nobody, rootInfo{uid: 0, gid: 0, mode: 0o1777}, true},
		{"owner 0755", nobody, rootInfo{uid: 65534, gid: 0, mode: 0o755}, true},
		{"owner without write, group with", nobody, rootInfo{uid: 65534, gid: 65534, mode: 0o575}, false},
		{"primary group 2775", nobody, rootInfo{uid: 0, gid: 65534, mode: 0o2775}, true},
		{"supplementary group 0770", member, rootInfo{uid: 0, gid: 44, mode: 0o770}, true},
		{"group write without search", member, rootInfo{uid: 0, gid: 44, mode: 0o760}, false},
		{"other group 0775", member, rootInfo{uid: 0, gid: 45, mode: 0o775}, false},
		{"others write and search", member, rootInfo{uid: 0, gid: 45, mode: 0o703}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			must.Eq(t, tc.want, canCreate(tc.cred, tc.ri))
		})
	}
}

func TestWriteHint(t *testing.T) {
	req := csihook.VolumeRequest{Name: "data", PluginID: "fx", VolumeID: "acc-hold-1", AccessMode: csihook.AccessSingleNodeWriter}
	rootDir := rootInfo{uid: 0, gid: 0, mode: 0o755}
	nobody := volumeWriter{user: "nobody", caps: []string{"DAC_OVERRIDE", "CHOWN"}}
	nobodyCred := &taskuser.Credential{UID: 65534, GID: 65534}
	root := volumeWriter{user: "root", caps: []string{"DAC_OVERRIDE"}}
	rootCred := &taskuser.Credential{}

	// The case of the issue: nobody, a plugin without VOLUME_MOUNT_GROUP, no
	// mount_group. The event names the volume, the owner and mode, and
	// both fixes.
	got := writeHint(req, false, nobody, nobodyCred, rootDir)
	must.Eq(t, `Volume "data" (volume_id "acc-hold-1") is not writable by the task's user nobody (uid 65534, groups 65534): `+
		`its root directory is owned by 0:0 with mode 0755. Set mount_group = true in the volume block (the driver then gives the root the task's group), `+
		`or set the task's user to one that can write it (its owner, uid 0)`, got)

	withGroup := req
	withGroup.ApplyMountGroup = true
	must.StrNotContains(t, writeHint(withGroup, false, nobody, nobodyCred, rootDir), "mount_group")
	must.StrContains(t, writeHint(req, true, nobody, nobodyCred, rootDir), "The plugin was given the task's group (VOLUME_MOUNT_GROUP)")

	// No hint: root with DAC_OVERRIDE (exec's default set), a writable
	// root, an ACL the mode does not show, a non-root task given
	// dac_override by cap_add.
	must.Eq(t, "", writeHint(req, false, root, rootCred, rootInfo{uid: 1000, gid: 1000, mode: 0o700}))
	must.Eq(t, "", writeHint(req, false, nobody, nobodyCred, rootInfo{uid: 0, gid: 0, mode: 0o777}))
	must.Eq(t, "", writeHint(req, false, nobody, nobodyCred, rootInfo{uid: 0, gid: 0, mode: 0o755, acl: true}))
	must.Eq(t, "", writeHint(req, false, volumeWriter{user: "nobody", ambient: []string{"DAC_OVERRIDE"}}, nobodyCred, rootDir))

	// Root without dac_override (cap_drop) on another user's volume:
	// mount_group is not for root, so only the user and the capability.
	noDAC := writeHint(req, false, volumeWriter{user: "root"}, rootCred, rootInfo{uid: 1000, gid: 1000, mode: 0o755})
	must.StrContains(t, noDAC, "is not writable by the task's user root (uid 0, groups 0)")
	must.StrContains(t, noDAC, "Set the task's user to the volume's owner (uid 1000), or keep dac_override in its capabilities")
	must.StrNotContains(t, noDAC, "mount_group")
}

// hintUnwritable reads the real root of each published volume (owner,
// mode, ACL) and says something only of the writable file-system volumes
// the task cannot write; it writes nothing into them. Needs root to give
// the directories their owners.
func TestHintUnwritable(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown the volume roots")
	}
	base := t.TempDir()
	dir := func(name string, uid, gid int, mode os.FileMode) string {
		p := filepath.Join(base, name)
		must.NoError(t, os.Mkdir(p, 0o700))
		must.NoError(t, os.Chown(p, uid, gid))
		must.NoError(t, os.Chmod(p, mode))
		return p
	}
	vol := func(name, access string, readOnly bool) csihook.VolumeRequest {
		return csihook.VolumeRequest{Name: name, PluginID: "fx", VolumeID: "id-" + name, AccessMode: access, ReadOnly: readOnly,
			AttachmentMode: csihook.AttachmentFileSystem}
	}
	reqs := []csihook.VolumeRequest{
		vol("rootowned", csihook.AccessSingleNodeWriter, false),
		vol("grouped", csihook.AccessSingleNodeWriter, false),
		vol("reader", csihook.AccessSingleNodeReaderOnly, true),
		vol("acl", csihook.AccessMultiNodeMultiWriter, false),
	}
	pubs := []csihook.Published{
		{Name: "rootowned", HostPath: dir("rootowned", 0, 0, 0o755)},
		{Name: "grouped", HostPath: dir("grouped", 0, 65534, 0o2775)},
		{Name: "reader", HostPath: dir("reader", 0, 0, 0o755), ReadOnly: true},
		{Name: "acl", HostPath: dir("acl", 0, 0, 0o755)},
	}
	aclErr := setUserACL(pubs[3].HostPath, 65534)
	aclOK := aclErr == nil
	t.Logf("POSIX ACL set on the acl volume's root: %v (%v)", aclOK, aclErr)
	before := snapshotDirs(t, base)

	d := &Driver{logger: hclog.NewNullLogger()}
	var got []map[string]string
	d.hintUnwritable(func(msg string, ann map[string]string) { got = append(got, ann) }, reqs, pubs,
		volumeWriter{user: "nobody", caps: []string{"DAC_OVERRIDE"}})
	want := []map[string]string{{"volume": "rootowned", "plugin_id": "fx", "volume_id": "id-rootowned"}}
	if !aclOK {
		t.Log("this file system takes no POSIX ACL: the ACL case is not checked")
		want = append(want, map[string]string{"volume": "acl", "plugin_id": "fx", "volume_id": "id-acl"})
	}
	must.Eq(t, want, got)
	must.Eq(t, before, snapshotDirs(t, base), must.Sprint("the check wrote into a volume"))

	// A task that runs as root (exec's default capabilities) is told
	// nothing.
	got = nil
	d.hintUnwritable(func(msg string, ann map[string]string) { got = append(got, ann) }, reqs, pubs,
		volumeWriter{user: "root", caps: []string{"DAC_OVERRIDE"}})
	must.SliceEmpty(t, got)
}

// setUserACL gives dir a POSIX access ACL granting uid rwx (the binary
// form of system.posix_acl_access: version 2, then tag, perm, id).
func setUserACL(dir string, uid uint32) error {
	entry := func(tag, perm uint16, id uint32) []byte {
		b := make([]byte, 8)
		binary.LittleEndian.PutUint16(b, tag)
		binary.LittleEndian.PutUint16(b[2:], perm)
		binary.LittleEndian.PutUint32(b[4:], id)
		return b
	}
	const undefined = ^uint32(0)
	acl := binary.LittleEndian.AppendUint32(nil, 2)
	acl = append(acl, entry(0x01, 7, undefined)...) // user::rwx
	acl = append(acl, entry(0x02, 7, uid)...)       // user:uid:rwx
	acl = append(acl, entry(0x04, 5, undefined)...) // group::r-x
	acl = append(acl, entry(0x10, 7, undefined)...) // mask::rwx
	acl = append(acl, entry(0x20, 5, undefined)...) // other::r-x
	return unix.Setxattr(dir, "system.posix_acl_access", acl, 0)
}

// snapshotDirs lists every entry under base with its mode and size.
func snapshotDirs(t *testing.T, base string) map[string]string {
	t.Helper()
	out := map[string]string{}
	must.NoError(t, filepath.Walk(base, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		out[p] = fi.Mode().String()
		return nil
	}))
	return out
}
