package csihook

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/wal"
)

// nsReq is req in a namespace, shareable between tasks.
func nsReq(namespace, name, volumeID string) VolumeRequest {
	r := req(name, volumeID, "/"+name)
	r.AccessMode = AccessMultiNodeMultiWriter
	r.Namespace = namespace
	return r
}

// A volume belongs to the namespace that first used it: another namespace
// is refused before anything is called, also once the volume is released
// and after a restart; the owner's namespace goes on using it.
func TestNamespace_otherNamespaceRefused(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{nsReq("team-a", "data", "vol1")})
	must.NoError(t, err)
	owner, ok := h.m.Owner("p", "vol1")
	must.True(t, ok)
	must.Eq(t, "team-a", owner)

	refused := func() {
		t.Helper()
		h.fake.ResetCalls()
		_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{nsReq("team-b", "data", "vol1")})
		must.ErrorIs(t, err, ErrOtherNamespace)
		must.ErrorContains(t, err, `volume_id "vol1" of CSI plugin "p" belongs to namespace "team-a"`)
		must.ErrorContains(t, err, `not to namespace "team-b"`)
		must.ErrorContains(t, err, "allow_cross_namespace_volumes = true")
		must.SliceEmpty(t, h.fake.Methods())
		must.Eq(t, 0, len(h.m.taskRecs("task-b")))
	}
	refused()

	// Released: the volume still belongs to team-a.
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.journalRecords())
	refused()
	h.restart()
	refused()

	_, err = h.m.Setup(ctx, "task-c", []VolumeRequest{nsReq("team-a", "data", "vol1")})
	must.NoError(t, err)
	must.NoError(t, h.m.Teardown(ctx, "task-c"))

	// A request without a namespace claims nothing and is not checked.
	_, err = h.m.Setup(ctx, "task-d", []VolumeRequest{nsReq("", "data", "vol2")})
	must.NoError(t, err)
	_, ok = h.m.Owner("p", "vol2")
	must.False(t, ok)
}

// With allow_cross_namespace_volumes the other namespace may use the
// volume, and the owner stays recorded.
func TestNamespace_allowCrossNamespace(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.AllowCrossNamespace = true })
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{nsReq("team-a", "data", "vol1")})
	must.NoError(t, err)
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{nsReq("team-b", "data", "vol1")})
	must.NoError(t, err)
	owner, _ := h.m.Owner("p", "vol1")
	must.Eq(t, "team-a", owner)
	must.Eq(t, 2, h.m.Users("p", "vol1"))
}

// A created volume belongs to the namespace that created it, by its name
// and by the id the plugin gave it.
func TestNamespace_createdVolumeBelongsToCreator(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := nsReq("team-a", "data", "my-vol")
	r.Create = &CreateRequest{CapacityMin: 1 << 20}
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{r})
	must.NoError(t, err)
	c, ok := h.m.journal.created("p", "my-vol")
	must.True(t, ok)
	owner, ok := h.m.Owner("p", c.VolumeID)
	must.True(t, ok)
	must.Eq(t, "team-a", owner)

	h.fake.ResetCalls()
	other := nsReq("team-b", "data", "my-vol")
	other.Create = &CreateRequest{CapacityMin: 1 << 20}
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{other})
	must.ErrorIs(t, err, ErrOtherNamespace)
	must.ErrorContains(t, err, fmt.Sprintf(`volume_id %q (created on this node as "my-vol") of CSI plugin "p" belongs to namespace "team-a"`, c.VolumeID))
	must.Eq(t, 0, h.fake.Count(MethodCreateVolume), must.Sprint("the other namespace's create reached the plugin"))

	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{nsReq("team-b", "data", c.VolumeID)})
	must.ErrorIs(t, err, ErrOtherNamespace)
	must.SliceEmpty(t, h.fake.Methods())
}

// rawFrame frames a payload as the journal does, for logs written by
// hand as an earlier driver wrote them. It is written apart from
// package wal's framing, so that it guards the format too.
func rawFrame(payload string) []byte {
	castagnoli := crc32.MakeTable(crc32.Castagnoli)
	buf := make([]byte, wal.HeaderSize, wal.HeaderSize+len(payload))
	copy(buf, wal.Magic)
	binary.LittleEndian.PutUint32(buf[4:], uint32(len(payload)))
	buf = append(buf, payload...)
	sum := crc32.Update(crc32.Checksum(buf[:8], castagnoli), castagnoli, []byte(payload))
	binary.LittleEndian.PutUint32(buf[8:], sum)
	return buf
}

// A journal written before namespaces and servers were recorded replays
// as it is; its volume is adopted by the first namespace that uses it,
// and takes the server of its next Setup.
func TestJournal_recordsWithoutNamespaceReplayAndAreAdopted(t *testing.T) {
	h := newHarness(t)
	h.m.Close()
	dir := filepath.Join(h.root, "journal")
	staging := h.m.StagingPath("p", "old-vol")
	target := h.m.TargetPath("old-task", "data")
	// Exactly what the driver before this change wrote: no "server", no
	// "namespace", no put_owner.
	payload := `{"ops":[` +
		`{"op":"put_vol","vol":{"version":1,"plugin_id":"p","volume_id":"old-vol","staging_path":"` + staging + `","node_id":"node-1","access_mode":"multi-node-multi-writer","attachment_mode":"file-system","fs_type":"ext4","mount_flags":["noatime"],"volume_context":{"ctx":"v"},"secrets":{"token":"` + canary + `"},"controller":"published","stage":"staged","updated":"2026-11-01T10:00:00Z"}},` +
		`{"op":"put_task","task":{"version":1,"task_id":"old-task","name":"data","seq":0,"plugin_id":"p","volume_id":"old-vol","target":"` + target + `","destination":"/data","read_only":false,"access_mode":"multi-node-multi-writer","attachment_mode":"file-system","fs_type":"ext4","mount_flags":["noatime"],"volume_context":{"ctx":"v"},"secrets":{"token":"` + canary + `"},"state":"published","updated":"2026-11-01T10:00:01Z"}}` +
		`]}`
	must.NoError(t, os.WriteFile(filepath.Join(dir, logName), rawFrame(payload), 0o600))
	must.NoError(t, h.mnt.Mount("fake", staging, "ext4", 0, ""))
	must.NoError(t, h.mnt.Mount("fake", target, "ext4", 0, ""))

	p := fullPlugin("p")
	p.Server = `job "plugins" in namespace "default"`
	h.setPlugin(p)
	h.m = h.newManager()
	must.Eq(t, []string{"task old-task/data published", "vol p/old-vol staged/published"}, h.journalRecords())
	must.Eq(t, 1, h.m.Users("p", "old-vol"))
	_, ok := h.m.Owner("p", "old-vol")
	must.False(t, ok)
	must.SliceEmpty(t, h.m.PluginServers("p"))

	ctx := context.Background()
	r := nsReq("team-b", "data", "old-vol")
	r.MountFlags, r.FSType = []string{"noatime"}, "ext4"
	_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{r})
	must.NoError(t, err)
	owner, _ := h.m.Owner("p", "old-vol")
	must.Eq(t, "team-b", owner)
	must.Eq(t, []string{p.Server}, h.m.PluginServers("p"))

	r.Namespace = "team-c"
	_, err = h.m.Setup(ctx, "task-c", []VolumeRequest{r})
	must.ErrorIs(t, err, ErrOtherNamespace)
	must.ErrorContains(t, err, `belongs to namespace "team-b"`)

	// The owner survives a restart, in the log the new driver writes.
	h.restart()
	owner, _ = h.m.Owner("p", "old-vol")
	must.Eq(t, "team-b", owner)
	st, err := ReadJournal(dir)
	must.NoError(t, err)
	must.Len(t, 1, st.Volumes)
	must.Eq(t, "team-b", st.Volumes[0].Namespace)
	must.Eq(t, p.Server, st.Volumes[0].Server)
}

// PluginServers names what served the plugin id for the volumes recorded
// now, and nothing once they are released.
func TestPluginServers(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	p := fullPlugin("p")
	p.Server = `job "a" in namespace "default"`
	h.setPlugin(p)
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{nsReq("default", "one", "vol1")})
	must.NoError(t, err)
	p.Server = `socket "/run/csi/p.sock"`
	h.setPlugin(p)
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{nsReq("default", "two", "vol2")})
	must.NoError(t, err)
	must.Eq(t, []string{`job "a" in namespace "default"`, `socket "/run/csi/p.sock"`}, h.m.PluginServers("p"))
	must.SliceEmpty(t, h.m.PluginServers("other"))

	// Each volume's teardown goes through the server that set it up.
	must.NoError(t, h.m.Teardown(ctx, "task-b"))
	must.Eq(t, []string{`job "a" in namespace "default"`}, h.m.PluginServers("p"))
	p.Server = `job "a" in namespace "default"`
	h.setPlugin(p)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.m.PluginServers("p"))
}

// A plugin without the CSI Node service never gets a volume: Setup names
// the plugin and what to use instead, and calls nothing; a teardown does
// not go to it either.
func TestSetup_controllerOnlyPluginRefused(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	ctl := fullPlugin("ctl")
	ctl.ControllerOnly = true
	h.setPlugin(ctl)
	r := req("data", "vol1", "/data")
	r.PluginID = "ctl"
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{r})
	must.ErrorIs(t, err, ErrInvalid)
	must.ErrorContains(t, err, `CSI plugin "ctl" is a controller plugin`)
	must.ErrorContains(t, err, "set plugin_id to a plugin of type node or monolith")
	must.SliceEmpty(t, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())

	// The id moves to a controller-only plugin while a volume of it is
	// published: its teardown waits rather than calling it.
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{req("data", "vol2", "/data")})
	must.NoError(t, err)
	p := fullPlugin("p")
	p.ControllerOnly = true
	h.setPlugin(p)
	h.fake.ResetCalls()
	err = h.m.teardownTask(ctx, "task-b")
	must.ErrorContains(t, err, "without the CSI Node service")
	must.Eq(t, 0, h.fake.Count(MethodNodeUnpublishVolume))
}

// A namespace whose setup of a volume fails before the plugin staged or
// published anything (the volume is not there, or its secrets are wrong)
// has not used the volume: it must not become its owner on this node.
// Otherwise a hostile job names the volume ids of another namespace once,
// with calls bound to fail, and that namespace is refused its own volumes
// here from then on (and every such try is a record kept as long as the
// journal).
func TestNamespace_failedSetupClaimsNothing(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	for _, method := range []string{MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodePublishVolume} {
		h.fake.SetNextError(method, status.Error(codes.NotFound, "no such volume"))
		_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{nsReq("team-b", "data", "prod-db")})
		must.Error(t, err)
		_, ok := h.m.Owner("p", "prod-db")
		must.False(t, ok, must.Sprintf("a setup failing at %s made namespace team-b the volume's owner", method))
	}
	h.restart()
	_, ok := h.m.Owner("p", "prod-db")
	must.False(t, ok)
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{nsReq("team-a", "data", "prod-db")})
	must.NoError(t, err)
	owner, ok := h.m.Owner("p", "prod-db")
	must.True(t, ok)
	must.Eq(t, "team-a", owner)
}

// A failed setup's claim lives exactly as long as the volume's record: a
// release that fails too keeps the record, and with it the claim, across
// a restart, without making it an owner record; once recovery releases
// the volume, the claim is gone and another namespace may use it.
func TestNamespace_claimLivesWithVolumeRecord(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	dir := filepath.Join(h.root, "journal")
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.NotFound, "no such volume"))
	h.fake.SetError(MethodNodeUnstageVolume, status.Error(codes.InvalidArgument, "plugin refuses"))
	_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{nsReq("team-b", "data", "prod-db")})
	must.ErrorContains(t, err, "no such volume")
	must.Eq(t, []string{"vol p/prod-db unstaging/published"}, h.journalRecords())

	claimed := func() {
		t.Helper()
		owner, ok := h.m.Owner("p", "prod-db")
		must.True(t, ok)
		must.Eq(t, "team-b", owner)
		_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{nsReq("team-a", "data", "prod-db")})
		must.ErrorIs(t, err, ErrOtherNamespace)
		must.ErrorContains(t, err, `belongs to namespace "team-b"`)
		disk := diskJournal(t, dir)
		must.MapEmpty(t, disk.owners, must.Sprint("a setup that failed left a lasting owner record"))
		must.Eq(t, "team-b", disk.vols[volKey{"p", "prod-db"}].Namespace)
		st, err := ReadJournal(dir)
		must.NoError(t, err)
		must.Len(t, 1, st.Volumes)
		must.Eq(t, "team-b", st.Volumes[0].Namespace)
	}
	claimed()
	h.restart()
	claimed()

	h.fake.SetError(MethodNodeUnstageVolume, nil)
	must.NoError(t, h.m.Recover(func(string) bool { return false }))
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())
	_, ok := h.m.Owner("p", "prod-db")
	must.False(t, ok)
	h.restart()
	_, ok = h.m.Owner("p", "prod-db")
	must.False(t, ok)
	must.MapEmpty(t, diskJournal(t, dir).owners)

	_, err = h.m.Setup(ctx, "task-a", []VolumeRequest{nsReq("team-a", "data", "prod-db")})
	must.NoError(t, err)
	owner, _ := h.m.Owner("p", "prod-db")
	must.Eq(t, "team-a", owner)
}

// A volume that was published keeps its owner once it is torn down and
// its record dropped: in memory, after a replay of the log, and after a
// compaction, which must carry the owner record.
func TestNamespace_publishedVolumeKeepsOwner(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	dir := filepath.Join(h.root, "journal")
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{nsReq("team-a", "data", "vol1")})
	must.NoError(t, err)
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.journalRecords())

	owned := func(when string) {
		t.Helper()
		owner, ok := h.m.Owner("p", "vol1")
		must.True(t, ok, must.Sprintf("no owner %s", when))
		must.Eq(t, "team-a", owner)
		must.Eq(t, "team-a", diskJournal(t, dir).owners[volKey{"p", "vol1"}].Namespace, must.Sprintf("no owner record on disk %s", when))
		h.fake.ResetCalls()
		_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{nsReq("team-b", "data", "vol1")})
		must.ErrorIs(t, err, ErrOtherNamespace, must.Sprintf("another namespace took the volume %s", when))
		must.SliceEmpty(t, h.fake.Methods())
	}
	owned("after the teardown")
	h.restart()
	owned("after a replay")
	must.NoError(t, h.m.journal.log.Compact())
	owned("after a compaction")
	h.restart()
	owned("after a replay of the compaction")
}

// A crash can lose the lazy batch of a successful NodePublishVolume, and
// the owner record in it, while the task used the volume: the claim of
// the volume's record, whose task record may have been published, is
// made its owner at start, and stays once recovery releases the volume,
// across replays and a compaction. The owner record goes out with the
// first commit when the compaction asked for at start cannot be written
// (a full disk). A task record whose publish had not begun leaves the
// claim to go with the record.
func TestNamespace_crashAfterPublishKeepsOwner(t *testing.T) {
	for _, tc := range []struct {
		state         string
		owned         bool
		noCompactions bool
	}{{phasePublishing, true, false}, {phasePublishing, true, true}, {phaseUnpublishing, true, false}, {phasePending, false, false}} {
		t.Run(fmt.Sprintf("%s/compactions_fail=%t", tc.state, tc.noCompactions), func(t *testing.T) {
			h := newHarness(t)
			dir := filepath.Join(h.root, "journal")
			vol := volRecord{PluginID: "p", VolumeID: "vol1", StagingPath: h.m.StagingPath("p", "vol1"), NodeID: "node-1",
				AccessMode: AccessMultiNodeMultiWriter, AttachmentMode: AttachmentFileSystem, FSType: "ext4",
				Controller: phasePublished, Stage: phaseStaged, Namespace: "team-a"}
			tr := taskRecord{TaskID: "task-a", Name: "data", PluginID: "p", VolumeID: "vol1", Target: h.m.TargetPath("task-a", "data"),
				Destination: "/data", AccessMode: AccessMultiNodeMultiWriter, AttachmentMode: AttachmentFileSystem, FSType: "ext4",
				State: tc.state}
			// What the disk held when the host crashed: the synced batch
			// before NodePublishVolume, and the mounts.
			must.NoError(t, h.m.journal.commit(volPut(vol), taskPut(tr)))
			must.NoError(t, h.mnt.Mount("fake", vol.StagingPath, "ext4", 0, ""))
			if tc.state != phasePending {
				must.NoError(t, h.mnt.Mount("fake", tr.Target, "ext4", 0, ""))
			}
			restore := createTemp
			if tc.noCompactions {
				failCompactions(t)
			}
			h.restart()
			owner, ok := h.m.Owner("p", "vol1")
			must.True(t, ok)
			must.Eq(t, "team-a", owner)

			must.NoError(t, h.m.Recover(func(string) bool { return false }))
			h.waitIdle()
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
			check := func(when string) {
				t.Helper()
				owner, ok := h.m.Owner("p", "vol1")
				must.Eq(t, tc.owned, ok, must.Sprintf("owner %s", when))
				disk, onDisk := diskJournal(t, dir).owners[volKey{"p", "vol1"}]
				must.Eq(t, tc.owned, onDisk, must.Sprintf("owner record on disk %s", when))
				if tc.owned {
					must.Eq(t, "team-a", owner)
					must.Eq(t, "team-a", disk.Namespace)
				}
				if tc.owned {
					_, err := h.m.Setup(context.Background(), "task-b", []VolumeRequest{nsReq("team-b", "data", "vol1")})
					must.ErrorIs(t, err, ErrOtherNamespace)
				}
			}
			check("after recovery released the volume")
			createTemp = restore
			h.restart()
			check("after a replay")
			must.NoError(t, h.m.journal.log.Compact())
			h.restart()
			check("after a compaction")
			if !tc.owned {
				_, err := h.m.Setup(context.Background(), "task-b", []VolumeRequest{nsReq("team-b", "data", "vol1")})
				must.NoError(t, err)
			}
		})
	}
}

// A failed setup of a volume other tasks use, recorded before namespaces
// were (no owner, no claim), claims nothing either: the volume's record
// outlives the failed setup, and a claim written into it would refuse the
// namespace whose tasks use the volume, then become a lasting owner
// record at the next start (a task record of the volume is published).
func TestNamespace_failedSetupOfSharedVolumeClaimsNothing(t *testing.T) {
	h := newHarness(t)
	h.m.Close()
	dir := filepath.Join(h.root, "journal")
	staging := h.m.StagingPath("p", "old-vol")
	target := h.m.TargetPath("old-task", "data")
	// A volume of team-a's task, as the driver before owners wrote it.
	payload := `{"ops":[` +
		`{"op":"put_vol","vol":{"version":1,"plugin_id":"p","volume_id":"old-vol","staging_path":"` + staging + `","node_id":"node-1","access_mode":"multi-node-multi-writer","attachment_mode":"file-system","fs_type":"ext4","controller":"published","stage":"staged","updated":"2026-11-01T10:00:00Z"}},` +
		`{"op":"put_task","task":{"version":1,"task_id":"old-task","name":"data","seq":0,"plugin_id":"p","volume_id":"old-vol","target":"` + target + `","destination":"/data","read_only":false,"access_mode":"multi-node-multi-writer","attachment_mode":"file-system","fs_type":"ext4","state":"published","updated":"2026-11-01T10:00:01Z"}}` +
		`]}`
	must.NoError(t, os.WriteFile(filepath.Join(dir, logName), rawFrame(payload), 0o600))
	must.NoError(t, h.mnt.Mount("fake", staging, "ext4", 0, ""))
	must.NoError(t, h.mnt.Mount("fake", target, "ext4", 0, ""))
	h.m = h.newManager()

	ctx := context.Background()
	r := nsReq("team-b", "data", "old-vol")
	r.FSType = "ext4"
	h.fake.SetNextError(MethodNodePublishVolume, status.Error(codes.InvalidArgument, "bad mount option"))
	_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{r})
	must.ErrorContains(t, err, "bad mount option")
	must.Eq(t, 1, h.m.Users("p", "old-vol"))

	unowned := func(when string) {
		t.Helper()
		owner, ok := h.m.Owner("p", "old-vol")
		must.False(t, ok, must.Sprintf("a failed setup made namespace %q the owner %s", owner, when))
		must.MapEmpty(t, diskJournal(t, dir).owners, must.Sprintf("owner record on disk %s", when))
		must.Eq(t, "", diskJournal(t, dir).vols[volKey{"p", "old-vol"}].Namespace, must.Sprintf("claim on disk %s", when))
	}
	unowned("after the setup failed")
	h.restart()
	unowned("after a restart")

	// The namespace whose task uses the volume goes on sharing it, and
	// owns it from its publish on.
	r.Namespace = "team-a"
	_, err = h.m.Setup(ctx, "task-a", []VolumeRequest{r})
	must.NoError(t, err)
	owner, ok := h.m.Owner("p", "old-vol")
	must.True(t, ok)
	must.Eq(t, "team-a", owner)
	h.restart()
	owner, _ = h.m.Owner("p", "old-vol")
	must.Eq(t, "team-a", owner)
	r.Namespace = "team-b"
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{r})
	must.ErrorIs(t, err, ErrOtherNamespace)
}
