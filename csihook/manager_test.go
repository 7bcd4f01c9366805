package csihook

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

func TestSetupTeardown_CallOrder(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()

	pubs, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.Len(t, 1, pubs)
	target := h.m.TargetPath("task-a", "data")
	staging := h.m.StagingPath("p", "vol1")
	must.Eq(t, Published{Name: "data", HostPath: target, Destination: "/data"}, pubs[0])
	must.StrHasPrefix(t, filepath.Join(h.root, "publish")+"/", target)
	must.Eq(t, filepath.Join(h.root, "staging", "p", ShortHash("vol1")), staging)

	must.Eq(t, []string{MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodePublishVolume}, h.fake.Methods())
	calls := h.fake.Calls()
	must.Eq(t, "node-1", calls[0].NodeID)
	must.Eq(t, canary, calls[0].Secrets["token"])
	must.Eq(t, staging, calls[1].StagingPath)
	must.Eq(t, "/dev/fake-vol1", calls[1].PublishContext["device"])
	must.Eq(t, "ext4", calls[1].Capability.GetMount().GetFsType())
	must.Eq(t, []string{"noatime"}, calls[1].Capability.GetMount().GetMountFlags())
	must.Eq(t, canary, calls[1].Secrets["token"])
	must.Eq(t, "v", calls[2].VolumeContext["ctx"])
	must.Eq(t, target, calls[2].TargetPath)
	must.Eq(t, staging, calls[2].StagingPath)
	must.Eq(t, "/dev/fake-vol1", calls[2].PublishContext["device"])
	must.Eq(t, canary, calls[2].Secrets["token"])
	must.False(t, calls[2].Readonly)
	must.Eq(t, []string{staging, target}, h.mountPaths())
	must.Eq(t, 1, h.m.Users("p", "vol1"))
	must.Len(t, 2, h.journalRecords())

	ev := h.eventMsgs()
	must.True(t, containsEvent(ev, `Staging volume "data"`), must.Sprint(ev))
	must.True(t, containsEvent(ev, `Published volume "data" at /data`), must.Sprint(ev))

	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}, h.fake.Methods())
	must.Eq(t, "node-1", h.fake.Calls()[2].NodeID)
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, h.journalRecords())
	must.Eq(t, 0, h.m.Users("p", "vol1"))
	_, err = os.Stat(filepath.Dir(target))
	must.True(t, errors.Is(err, os.ErrNotExist), must.Sprint("publish dir of the task is removed"))

	// A second teardown is a no-op.
	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.fake.Methods())
}

// A plugin that answers NodePublishVolume with OK but never makes the
// target (csi-test's and gocsi's mocks do this) published nothing: the
// setup fails naming the target, and what was done is undone.
func TestSetup_PluginDidNotCreateTarget(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	target := h.m.TargetPath("task-a", "data")
	h.mnt.IsMountPointErrs = map[string]error{target: fmt.Errorf("failed to resolve %q: %w", target, fs.ErrNotExist)}

	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	var oe *OpError
	must.True(t, errors.As(err, &oe), must.Sprintf("error %v", err))
	must.Eq(t, MethodNodePublishVolume, oe.Method)
	must.StrContains(t, err.Error(), "did not create the target path \""+target+"\"")
	must.StrContains(t, err.Error(), `plugin "p" did not publish the volume`)
	must.Eq(t, []string{MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodePublishVolume,
		MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())
	must.Eq(t, 0, h.m.Users("p", "vol1"))
}

func TestSetup_PluginWithoutControllerOrStaging(t *testing.T) {
	h := newHarness(t)
	p := fullPlugin("p")
	p.ControllerPublish, p.StageUnstage = false, false
	h.setPlugin(p)
	_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.Eq(t, []string{MethodNodePublishVolume}, h.fake.Methods())
	must.Eq(t, "", h.fake.Calls()[0].StagingPath)
	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(context.Background(), "t"))
	must.Eq(t, []string{MethodNodeUnpublishVolume}, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())
}

func TestSetup_NodeIDFromNodeGetInfo(t *testing.T) {
	h := newHarness(t)
	p := fullPlugin("p")
	p.NodeID = ""
	h.setPlugin(p)
	h.fake.NodeID = "from-plugin"
	_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.Eq(t, []string{MethodNodeGetInfo, MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodePublishVolume}, h.fake.Methods())
	must.Eq(t, "from-plugin", h.fake.Calls()[1].NodeID)
	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(context.Background(), "t"))
	must.Eq(t, "from-plugin", h.fake.Calls()[2].NodeID)
}

func TestSetup_CreateVolumeUsesReturnedID(t *testing.T) {
	h := newHarness(t)
	r := req("data", "myvol", "/data")
	r.Create = &CreateRequest{CapacityMin: 1 << 20, CapacityMax: 2 << 20, Parameters: map[string]string{"type": "dir"}}
	r.Context = map[string]string{"ctx": "v", "created": "mine"}
	_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{r})
	must.NoError(t, err)
	calls := h.fake.Calls()
	must.Eq(t, MethodCreateVolume, calls[0].Method)
	must.Eq(t, "myvol", calls[0].VolumeID)
	must.Eq(t, int64(1<<20), calls[0].CapacityRange.GetRequiredBytes())
	must.Eq(t, int64(2<<20), calls[0].CapacityRange.GetLimitBytes())
	must.Eq(t, "dir", calls[0].Parameters["type"])
	must.Eq(t, canary, calls[0].Secrets["token"])
	for _, c := range calls[1:] {
		must.Eq(t, "id-myvol", c.VolumeID, must.Sprint(c.Method))
	}
	// The plugin's context wins over the request's; the rest is merged.
	must.Eq(t, "myvol", calls[1].VolumeContext["created"])
	must.Eq(t, "v", calls[3].VolumeContext["ctx"])
	must.Eq(t, "myvol", calls[3].VolumeContext["created"])
	must.Eq(t, 1, h.m.Users("p", "id-myvol"))
	must.NoError(t, h.m.Teardown(context.Background(), "t"))
	must.Eq(t, "id-myvol", h.fake.Calls()[len(h.fake.Calls())-1].VolumeID)
}

// After a volume was created under a name, a request for that name
// without a create block uses the plugin's id and context, also after a
// restart.
func TestSetup_CreatedVolumeResolvedByName(t *testing.T) {
	h := newHarness(t)
	r := req("data", "myvol", "/data")
	r.Create = &CreateRequest{Parameters: map[string]string{"type": "dir"}}
	_, err := h.m.Setup(context.Background(), "t1", []VolumeRequest{r})
	must.NoError(t, err)
	must.NoError(t, h.m.Teardown(context.Background(), "t1"))

	h.restart()
	h.fake.ResetCalls()
	plain := req("data", "myvol", "/data")
	plain.Context = map[string]string{"ctx": "v"}
	_, err = h.m.Setup(context.Background(), "t2", []VolumeRequest{plain})
	must.NoError(t, err)
	for _, c := range h.fake.Calls() {
		must.NotEq(t, MethodCreateVolume, c.Method)
		must.Eq(t, "id-myvol", c.VolumeID, must.Sprint(c.Method))
	}
	last := h.fake.Calls()[len(h.fake.Calls())-1]
	must.Eq(t, "myvol", last.VolumeContext["created"])
	must.Eq(t, "v", last.VolumeContext["ctx"])
	must.Eq(t, 1, h.m.Users("p", "id-myvol"))
	must.NoError(t, h.m.Teardown(context.Background(), "t2"))

	// A name never created here is used as the plugin's id.
	h.fake.ResetCalls()
	_, err = h.m.Setup(context.Background(), "t3", []VolumeRequest{req("data", "other", "/data")})
	must.NoError(t, err)
	must.Eq(t, "other", h.fake.Calls()[len(h.fake.Calls())-1].VolumeID)
	must.NoError(t, h.m.Teardown(context.Background(), "t3"))
}

func TestSetup_BlockDevice(t *testing.T) {
	h := newHarness(t)
	r := req("dev", "vol1", "/dev/xvdb")
	r.AttachmentMode, r.FSType, r.MountFlags = AttachmentBlockDevice, "", nil
	pubs, err := h.m.Setup(context.Background(), "t", []VolumeRequest{r})
	must.NoError(t, err)
	must.True(t, pubs[0].Block)
	for _, c := range h.fake.Calls() {
		must.NotNil(t, c.Capability.GetBlock(), must.Sprint(c.Method))
		must.Nil(t, c.Capability.GetMount())
	}
	must.NoError(t, h.m.Teardown(context.Background(), "t"))
}

func TestRefcount_SharedStaging(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "shared", "/data")
	r.AccessMode, r.ReadOnly = AccessMultiNodeReaderOnly, true

	pa, err := h.m.Setup(ctx, "task-a", []VolumeRequest{r})
	must.NoError(t, err)
	pb, err := h.m.Setup(ctx, "task-b", []VolumeRequest{r})
	must.NoError(t, err)
	must.NotEq(t, pa[0].HostPath, pb[0].HostPath)
	must.True(t, pa[0].ReadOnly)
	must.Eq(t, 1, h.fake.Count(MethodControllerPublishVolume))
	must.Eq(t, 1, h.fake.Count(MethodNodeStageVolume))
	must.Eq(t, 2, h.fake.Count(MethodNodePublishVolume))
	must.Eq(t, 2, h.m.Users("p", "shared"))
	for _, c := range h.fake.Calls() {
		if c.Method == MethodNodePublishVolume || c.Method == MethodControllerPublishVolume {
			must.True(t, c.Readonly)
		}
	}

	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.Eq(t, []string{MethodNodeUnpublishVolume}, h.fake.Methods())
	must.Eq(t, 1, h.m.Users("p", "shared"))
	must.SliceContains(t, h.mountPaths(), h.m.StagingPath("p", "shared"))

	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, "task-b"))
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}

func TestRestart_NoRepeatedCallsAndTeardownWorks(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	reqs := []VolumeRequest{req("data", "vol1", "/data"), req("logs", "vol2", "/logs")}
	first, err := h.m.Setup(ctx, "task-a", reqs)
	must.NoError(t, err)

	h.restart()
	h.fake.ResetCalls()
	must.Eq(t, 1, h.m.Users("p", "vol1"))
	must.NoError(t, h.m.Recover(func(id string) bool { return id == "task-a" }))
	h.waitIdle()
	must.SliceEmpty(t, h.fake.Methods())

	again, err := h.m.Setup(ctx, "task-a", reqs)
	must.NoError(t, err)
	must.Eq(t, first, again)
	must.SliceEmpty(t, h.fake.Methods())

	h.restart()
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	// Reverse order: logs first, then data.
	must.Eq(t, []string{
		MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume,
		MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume,
	}, h.fake.Methods())
	must.Eq(t, "vol2", h.fake.Calls()[0].VolumeID)
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}

func TestJournal_FormatAndPermissions(t *testing.T) {
	h := newHarness(t)
	_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	dir := filepath.Join(h.root, "journal")
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	must.Eq(t, []string{".lock", logName}, names)
	fi, err := os.Stat(dir)
	must.NoError(t, err)
	must.Eq(t, os.FileMode(0o700), fi.Mode().Perm())
	fi, err = os.Stat(filepath.Join(dir, logName))
	must.NoError(t, err)
	must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())

	s := diskJournal(t, dir)
	v := s.vols[volKey{"p", "vol1"}]
	must.Eq(t, journalVersion, v.Version)
	must.Eq(t, phasePublished, v.Controller)
	must.Eq(t, phaseStaged, v.Stage)
	must.Eq(t, "node-1", v.NodeID)
	must.Eq(t, h.m.StagingPath("p", "vol1"), v.StagingPath)
	must.Eq(t, canary, v.Secrets["token"])
	tr := s.task("task-a", "data")
	must.Eq(t, phasePublished, tr.State)
	must.Eq(t, h.m.TargetPath("task-a", "data"), tr.Target)

	// A second manager on the same journal is refused.
	_, err = New(h.config())
	must.ErrorContains(t, err, "in use by another volume manager")
}

func TestJournal_WrittenBeforeEachCall(t *testing.T) {
	h := newHarness(t)
	// Replay the journal on disk as each call starts: the call's "-ing"
	// record and the results of the calls before it must be there.
	dir := filepath.Join(h.root, "journal")
	seen := map[string]string{}
	for _, method := range []string{MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodePublishVolume} {
		release := h.fake.HangMethod(method)
		done := make(chan error, 1)
		go func() {
			_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
			done <- err
		}()
		must.Wait(t, waitFor(func() bool { return h.fake.Count(method) == 1 }))
		s := diskJournal(t, dir)
		v, tr := s.vols[volKey{"p", "vol1"}], s.task("t", "data")
		seen[method] = v.Controller + "/" + v.Stage + "/" + tr.State
		release()
		must.NoError(t, <-done)
		must.NoError(t, h.m.Teardown(context.Background(), "t"))
		h.fake.ResetCalls()
	}
	// The task's intent to publish goes out with the first record, and
	// the stage's result with the publish's: at NodePublishVolume the
	// stage is still uncertain on disk, which recovery settles by calling
	// again.
	must.Eq(t, map[string]string{
		MethodControllerPublishVolume: "publishing//publishing",
		MethodNodeStageVolume:         "published/staging/publishing",
		MethodNodePublishVolume:       "published/staging/publishing",
	}, seen)
	_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.Eq(t, []string{"task t/data published", "vol p/vol1 staged/published"}, h.journalRecords())

	// Teardown: the task's record goes with the volume's "unstaging", the
	// unstage's result with "unpublishing" of the controller.
	seen = map[string]string{}
	for _, method := range []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume} {
		_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
		must.NoError(t, err)
		release := h.fake.HangMethod(method)
		done := make(chan error, 1)
		go func() { done <- h.m.Teardown(context.Background(), "t") }()
		must.Wait(t, waitFor(func() bool { return h.fake.Count(method) == 1 }))
		seen[method] = strings.Join(h.journalRecords(), ", ")
		release()
		must.NoError(t, <-done)
		must.SliceEmpty(t, h.journalRecords())
		h.fake.ResetCalls()
	}
	must.Eq(t, map[string]string{
		MethodNodeUnpublishVolume:       "task t/data unpublishing, vol p/vol1 staged/published",
		MethodNodeUnstageVolume:         "vol p/vol1 unstaging/published",
		MethodControllerUnpublishVolume: "vol p/vol1 /unpublishing",
	}, seen)
}

func TestRecover_UncertainStage(t *testing.T) {
	cases := []struct {
		name      string
		live      bool
		withTask  bool
		taskState string
		want      []string
		wantUsers int
	}{
		{name: "task gone: unstage and detach", live: false, withTask: true, taskState: phasePending,
			want: []string{MethodNodeUnstageVolume, MethodControllerUnpublishVolume}},
		{name: "no task record: unstage and detach", withTask: false,
			want: []string{MethodNodeUnstageVolume, MethodControllerUnpublishVolume}},
		{name: "task live: stage again and publish", live: true, withTask: true, taskState: phasePending,
			want: []string{MethodNodeStageVolume, MethodNodePublishVolume}, wantUsers: 1},
		{name: "task gone while publishing: unpublish then unstage", live: false, withTask: true, taskState: phasePublishing,
			want: []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			k := volKey{"p", "vol1"}
			v := volRecord{PluginID: "p", VolumeID: "vol1", StagingPath: h.m.StagingPath("p", "vol1"), NodeID: "node-1",
				AccessMode: AccessSingleNodeWriter, AttachmentMode: AttachmentFileSystem, FSType: "ext4",
				Secrets: map[string]string{"token": canary}, Controller: phasePublished, Stage: phaseStaging,
				PublishContext: map[string]string{"device": "/dev/x"}}
			must.NoError(t, h.m.journal.commit(volPut(v)))
			if tc.withTask {
				must.NoError(t, h.m.journal.commit(taskPut(taskRecord{TaskID: "task-a", Name: "data", PluginID: "p", VolumeID: "vol1",
					Target: h.m.TargetPath("task-a", "data"), Destination: "/data", AccessMode: AccessSingleNodeWriter,
					AttachmentMode: AttachmentFileSystem, FSType: "ext4", State: tc.taskState})))
			}
			h.restart()
			must.NoError(t, h.m.Recover(func(string) bool { return tc.live }))
			h.waitIdle()
			must.Eq(t, tc.want, h.fake.Methods())
			must.Eq(t, tc.wantUsers, h.m.Users(k.plugin, k.volume))
			if tc.wantUsers == 0 {
				must.SliceEmpty(t, h.journalRecords())
				return
			}
			stage := h.fake.Calls()[0]
			must.Eq(t, canary, stage.Secrets["token"])
			must.Eq(t, "/dev/x", stage.PublishContext["device"])
			vol, _ := h.m.vol(k)
			must.Eq(t, phaseStaged, vol.Stage)
			tr, _ := h.m.taskRec("task-a", "data")
			must.Eq(t, phasePublished, tr.State)
		})
	}
}

func TestRecover_OrphansAndLostMounts(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "shared", "/data")
	r.AccessMode = AccessMultiNodeMultiWriter
	for _, id := range []string{"task-a", "task-b", "task-c"} {
		_, err := h.m.Setup(ctx, id, []VolumeRequest{r})
		must.NoError(t, err)
	}
	other := req("x", "solo", "/x")
	_, err := h.m.Setup(ctx, "task-d", []VolumeRequest{other})
	must.NoError(t, err)

	h.restart()
	h.fake.ResetCalls()
	h.mu.Lock()
	h.events = nil
	h.mu.Unlock()
	// task-c's mount vanished behind our back.
	must.NoError(t, h.mnt.Unmount(h.m.TargetPath("task-c", "data")))
	live := map[string]bool{"task-b": true, "task-c": true}
	must.NoError(t, h.m.Recover(func(id string) bool { return live[id] }))
	h.waitIdle()

	// Each gone task hears of its volume's teardown once, when it is done.
	var gone []string
	h.mu.Lock()
	for _, e := range h.events {
		if !live[e.TaskID] {
			gone = append(gone, e.TaskID+": "+e.Msg)
		}
	}
	h.mu.Unlock()
	sort.Strings(gone)
	must.Eq(t, []string{
		`task-a: Unpublished volume "data"; it stays staged for other tasks on this node`,
		`task-d: Unpublished, unstaged and detached volume "x"`,
	}, gone)

	must.Eq(t, 2, h.m.Users("p", "shared"))
	must.Eq(t, 0, h.m.Users("p", "solo"))
	var got []string
	for _, c := range h.fake.Calls() {
		got = append(got, c.Method+" "+c.VolumeID+" "+filepath.Base(filepath.Dir(c.TargetPath)))
	}
	must.SliceContainsAll(t, []string{
		MethodNodeUnpublishVolume + " shared " + ShortHash("task-a"),
		MethodNodeStageVolume + " shared .",
		MethodNodePublishVolume + " shared " + ShortHash("task-c"),
		MethodNodeUnpublishVolume + " solo " + ShortHash("task-d"),
		MethodNodeUnstageVolume + " solo .",
		MethodControllerUnpublishVolume + " solo .",
	}, got)
	must.SliceContains(t, h.mountPaths(), h.m.TargetPath("task-c", "data"))
	must.True(t, containsEvent(h.eventMsgs(), `Re-publishing volume "data"`))
}

// A gone task's volume whose release fails at recovery: the task still
// hears of the unpublish done for it (merged into the release's event
// when the release goes through), then of the failure, then of what the
// retry did, each by the volume's name in the task.
func TestRecover_ReleaseFailsAfterUnpublish(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-d", []VolumeRequest{req("x", "solo", "/x")})
	must.NoError(t, err)
	h.restart()
	h.mu.Lock()
	h.events = nil
	h.mu.Unlock()
	h.fake.SetError(MethodNodeUnstageVolume, status.Error(codes.Unavailable, "connection refused"))
	must.NoError(t, h.m.Recover(func(string) bool { return false }))
	must.Wait(t, waitFor(func() bool {
		return containsEvent(h.eventMsgs(), `Unstaging volume "x" failed (Unavailable: connection refused): retrying in `)
	}))
	h.fake.SetError(MethodNodeUnstageVolume, nil)
	h.waitIdle()
	// Every event goes to task-d, by the volume's name (the retry's too,
	// after the attempt that unpublished dropped the task's record).
	var steps []string
	h.mu.Lock()
	for _, e := range h.events {
		must.Eq(t, "task-d", e.TaskID, must.Sprintf("event %q", e.Msg))
		must.StrNotContains(t, e.Msg, `"solo"`)
		if strings.HasPrefix(e.Msg, "Unpublished") || strings.HasPrefix(e.Msg, "Unstaged") || strings.HasPrefix(e.Msg, "Detached") {
			steps = append(steps, e.Msg)
		}
	}
	h.mu.Unlock()
	must.Eq(t, []string{`Unpublished volume "x"`, `Unstaged and detached volume "x"`}, steps)
	must.Eq(t, 0, h.m.Users("p", "solo"))
	must.SliceEmpty(t, h.journalRecords())
}

func TestRecover_PluginDownRetriesInBackground(t *testing.T) {
	h := newHarness(t)
	_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.restart()
	h.removePlugin("p")
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(string) bool { return false }))
	must.Wait(t, waitFor(func() bool { return containsEvent(h.eventMsgs(), "retrying in") }))
	h.mu.Lock()
	for _, e := range h.events {
		if strings.Contains(e.Msg, "retrying in") {
			must.Eq(t, "task-a", e.TaskID)
		}
	}
	h.mu.Unlock()
	must.Len(t, 2, h.journalRecords())
	h.setPlugin(fullPlugin("p"))
	h.waitIdle()
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())
}

func TestRetryPolicy(t *testing.T) {
	cases := []struct {
		code  codes.Code
		retry bool
	}{
		{codes.Unavailable, true},
		{codes.ResourceExhausted, true},
		{codes.Aborted, true},
		{codes.DeadlineExceeded, true},
		{codes.Unimplemented, false},
		{codes.InvalidArgument, false},
		{codes.NotFound, false},
		{codes.AlreadyExists, false},
		{codes.FailedPrecondition, false},
		{codes.PermissionDenied, false},
		{codes.Internal, false},
		{codes.OutOfRange, false},
		{codes.Unknown, false},
	}
	for _, tc := range cases {
		t.Run(tc.code.String(), func(t *testing.T) {
			must.Eq(t, tc.retry, csiclient.Retryable(MethodNodeStageVolume, tc.code))
			h := newHarness(t)
			h.fake.SetNextError(MethodNodeStageVolume, status.Error(tc.code, "boom"))
			_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
			if tc.retry {
				must.NoError(t, err)
				must.Eq(t, 2, h.fake.Count(MethodNodeStageVolume))
				return
			}
			must.Error(t, err)
			must.Eq(t, tc.code, Code(err))
			must.Eq(t, 1, h.fake.Count(MethodNodeStageVolume))
			must.SliceEmpty(t, h.journalRecords())
		})
	}
}

func TestRetry_GivesUpAfterAttempts(t *testing.T) {
	h := newHarness(t)
	h.fake.SetError(MethodNodePublishVolume, status.Error(codes.Unavailable, "down"))
	_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
	must.ErrorContains(t, err, `failed to publish volume "data" (volume_id "vol1", plugin "p"): Unavailable: down: plugin "p" is not answering`)
	must.Eq(t, 3, h.fake.Count(MethodNodePublishVolume))
	// Rollback still ran what it could: unpublish (fails) is retried in
	// the background.
	h.fake.SetError(MethodNodePublishVolume, nil)
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())
}

func TestErrorHints(t *testing.T) {
	cases := []struct {
		method string
		code   codes.Code
		want   string
	}{
		{MethodNodeStageVolume, codes.NotFound, `volume "vol1" does not exist on plugin "p": create it or add a create block`},
		{MethodNodePublishVolume, codes.NotFound, `does not exist on plugin "p"`},
		{MethodControllerPublishVolume, codes.NotFound, `or node "node-1" does not exist`},
		{MethodControllerPublishVolume, codes.FailedPrecondition, "attached to another node"},
		{MethodControllerPublishVolume, codes.ResourceExhausted, "as many volumes"},
		{MethodNodeStageVolume, codes.AlreadyExists, "make the volume blocks match"},
		{MethodNodeStageVolume, codes.InvalidArgument, "rejected the request"},
		{MethodNodeStageVolume, codes.Unimplemented, "does not implement NodeStageVolume"},
		{MethodNodeStageVolume, codes.PermissionDenied, "check the volume's secrets"},
	}
	for _, tc := range cases {
		t.Run(tc.method+"/"+tc.code.String(), func(t *testing.T) {
			h := newHarness(t)
			h.fake.SetError(tc.method, status.Error(tc.code, "plugin says no"))
			_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
			must.ErrorContains(t, err, tc.want)
			must.ErrorContains(t, err, "plugin says no")
			must.True(t, containsEvent(h.eventMsgs(), "failed ("+tc.code.String()+": plugin says no)"))
		})
	}
	h := newHarness(t)
	r := req("data", "taken", "/data")
	r.Create = &CreateRequest{}
	h.fake.SetError(MethodCreateVolume, status.Error(codes.AlreadyExists, "size differs"))
	_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{r})
	must.ErrorContains(t, err, `a volume named "taken" already exists on plugin "p"`)
	must.SliceEmpty(t, h.journalRecords())
}

func TestBackoff_CappedAndJittered(t *testing.T) {
	base, max := 100*time.Millisecond, 4*time.Second
	prevHi := time.Duration(0)
	for attempt := 0; attempt < 70; attempt++ {
		lo := backoff(attempt, base, max, func() float64 { return 0 })
		hi := backoff(attempt, base, max, func() float64 { return 0.999999 })
		must.LessEq(t, max, hi, must.Sprintf("attempt %d", attempt))
		must.Greater(t, 0, lo)
		must.GreaterEq(t, hi/2-time.Millisecond, lo, must.Sprintf("attempt %d: jitter keeps at least half", attempt))
		must.GreaterEq(t, prevHi, hi, must.Sprintf("attempt %d: never shrinks", attempt))
		prevHi = hi
	}
	must.Eq(t, 50*time.Millisecond, backoff(0, base, max, func() float64 { return 0 }))
	must.Eq(t, 2*time.Second, backoff(10, base, max, func() float64 { return 0 }))
	// Random jitter spreads values.
	seen := map[time.Duration]bool{}
	for i := 0; i < 50; i++ {
		d := backoff(3, base, max, randFloat)
		must.Between(t, 400*time.Millisecond, d, 800*time.Millisecond)
		seen[d] = true
	}
	must.Greater(t, 10, len(seen))
}

func TestPerVolumeSerialisation(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.RPCTimeout = 30 * time.Second })
	release := h.fake.Hang("hung")
	defer release()

	shared := req("data", "hung", "/data")
	shared.AccessMode = AccessMultiNodeMultiWriter
	hungDone := make(chan error, 1)
	go func() {
		_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{shared})
		hungDone <- err
	}()
	must.Wait(t, waitFor(func() bool { return h.fake.Count(MethodControllerPublishVolume) == 1 }))

	// Another volume is not delayed by the hung one.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{req("data", "fine", "/data")})
	must.NoError(t, err)
	must.Less(t, time.Second, time.Since(start))
	must.NoError(t, h.m.Teardown(ctx, "task-b"))

	// A second user of the hung volume waits for it, and gives up with
	// its own deadline.
	short, cancel2 := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel2()
	_, err = h.m.Setup(short, "task-c", []VolumeRequest{shared})
	must.ErrorContains(t, err, "gave up waiting for another operation on volume")

	release()
	must.NoError(t, <-hungDone)
	must.NoError(t, h.m.Teardown(context.Background(), "task-a"))
	must.SliceEmpty(t, h.journalRecords())
}

func TestRPCDeadline_HungCallIsRetriedThenFails(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.RPCTimeout = 50 * time.Millisecond })
	release := h.fake.HangMethod(MethodNodeStageVolume)
	start := time.Now()
	_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
	elapsed := time.Since(start)
	must.Eq(t, codes.DeadlineExceeded, Code(err))
	must.Eq(t, 3, h.fake.Count(MethodNodeStageVolume))
	must.Less(t, 2*time.Second, elapsed)
	release()
	h.waitIdle()
	// The uncertain stage was undone by the rollback.
	must.Eq(t, 1, h.fake.Count(MethodNodeUnstageVolume))
	must.SliceEmpty(t, h.journalRecords())
}

func TestTeardown_BackgroundRetryUntilPluginAnswers(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.fake.SetError(MethodNodeUnpublishVolume, status.Error(codes.Unavailable, "connection refused"))
	err = h.m.Teardown(ctx, "task-a")
	must.ErrorContains(t, err, "retrying in the background")
	must.Eq(t, codes.Unavailable, Code(err))
	must.Wait(t, waitFor(func() bool { return h.fake.Count(MethodNodeUnpublishVolume) >= 6 }))
	must.True(t, containsEvent(h.eventMsgs(), `Unpublishing volume "data" failed (Unavailable: connection refused): retrying in `))
	must.Len(t, 2, h.journalRecords())

	h.fake.SetError(MethodNodeUnpublishVolume, nil)
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
	must.Eq(t, 1, h.fake.Count(MethodNodeUnstageVolume))
	must.Eq(t, 1, h.fake.Count(MethodControllerUnpublishVolume))
	must.True(t, containsEvent(h.eventMsgs(), "Volume cleanup succeeded"))
}

// The retry that finishes tells the task before the driver hears that the
// task's volumes are released (Released, on which the driver drops the
// task's event target): "Volume cleanup succeeded" is the last event the
// task gets, not one sent after its target is gone.
func TestTeardown_BackgroundSuccessEventBeforeReleased(t *testing.T) {
	var h *harness
	h = newHarness(t, func(c *Config) {
		c.Released = func(taskID string) {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.events = append(h.events, recordedEvent{taskID, "<released>", nil})
		}
	})
	h.teardownFailing(t, "task-a", MethodNodeUnpublishVolume)
	h.waitIdle()
	msgs := h.eventMsgs()
	must.SliceNotEmpty(t, msgs)
	must.Eq(t, []string{"Volume cleanup succeeded", "<released>"}, msgs[len(msgs)-2:])
}

// TestTeardown_BackgroundRetryAfterTaskRecordDropped fails the unstage or
// the detach, which come after the task's record is dropped: the
// background retry must go on calling it until it succeeds, and only then
// report success.
func TestTeardown_BackgroundRetryAfterTaskRecordDropped(t *testing.T) {
	cases := []struct {
		method string
		event  string
		left   string
		before string
		done   string
	}{
		{MethodNodeUnstageVolume, `Unstaging volume "data" failed (Unavailable: connection refused): retrying in `, "vol p/vol1 unstaging/published",
			`Unpublished volume "data"`, `Unstaged and detached volume "data"`},
		{MethodControllerUnpublishVolume, `Detaching volume "data" failed (Unavailable: connection refused): retrying in `, "vol p/vol1 /unpublishing",
			`Unpublished and unstaged volume "data"`, `Detached volume "data"`},
	}
	for _, tc := range cases {
		t.Run(tc.method, func(t *testing.T) {
			h := newHarness(t)
			ctx := context.Background()
			_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
			must.NoError(t, err)
			h.fake.SetError(tc.method, status.Error(codes.Unavailable, "connection refused"))
			err = h.m.Teardown(ctx, "task-a")
			must.ErrorContains(t, err, "retrying in the background")
			must.Eq(t, []string{tc.left}, h.journalRecords())

			// Each attempt makes RetryAttempts calls: wait for more
			// than the first two attempts made.
			must.Wait(t, waitFor(func() bool { return h.fake.Count(tc.method) > 2*h.m.cfg.RetryAttempts }))
			must.True(t, containsEvent(h.eventMsgs(), tc.event))
			must.False(t, containsEvent(h.eventMsgs(), "Volume cleanup succeeded"))
			must.Eq(t, []string{tc.left}, h.journalRecords())

			h.fake.SetError(tc.method, nil)
			h.waitIdle()
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
			must.Eq(t, 1, h.fake.Count(MethodNodeUnpublishVolume))
			must.True(t, containsEvent(h.eventMsgs(), "Volume cleanup succeeded"))
			// What was done before the failure is told once, the step
			// that failed has its own event, and the retry tells what it
			// finished, in that order.
			var steps []string
			for _, e := range h.eventMsgs() {
				if strings.HasPrefix(e, "Unpublished") || strings.HasPrefix(e, "Unstaged") || strings.HasPrefix(e, "Detached") {
					steps = append(steps, e)
				}
			}
			must.Eq(t, []string{tc.before, tc.done}, steps)
			must.Eq(t, 0, h.m.Users("p", "vol1"))
		})
	}
}

// TestTeardown_RetryLeavesVolumeToNewUser: a volume whose unstage is being
// retried is taken by another task meanwhile; the retry then leaves it
// staged for that task.
func TestTeardown_RetryLeavesVolumeToNewUser(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "vol1", "/data")
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{r})
	must.NoError(t, err)
	h.fake.SetError(MethodNodeUnstageVolume, status.Error(codes.Unavailable, "connection refused"))
	must.ErrorContains(t, h.m.Teardown(ctx, "task-a"), "retrying in the background")
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{r})
	must.NoError(t, err)
	unstages := h.fake.Count(MethodNodeUnstageVolume)
	h.waitIdle()
	must.Eq(t, unstages, h.fake.Count(MethodNodeUnstageVolume))
	must.Eq(t, []string{"task task-b/data published", "vol p/vol1 staged/published"}, h.journalRecords())

	h.fake.SetError(MethodNodeUnstageVolume, nil)
	must.NoError(t, h.m.Teardown(ctx, "task-b"))
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}

func TestTeardown_PluginGoneThenBack(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.removePlugin("p")
	err = h.m.Teardown(ctx, "task-a")
	must.ErrorContains(t, err, `CSI plugin "p" is not running on node "n1"`)
	must.Wait(t, waitFor(func() bool { return containsEvent(h.eventMsgs(), "retrying in") }))
	h.setPlugin(fullPlugin("p"))
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())
}

func TestTeardown_NotFoundIsSuccess(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	for _, m := range []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume} {
		h.fake.SetNextError(m, status.Error(codes.NotFound, "gone"))
	}
	h.mnt.Unmount(h.m.TargetPath("task-a", "data"))
	h.mnt.Unmount(h.m.StagingPath("p", "vol1"))
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.SliceEmpty(t, h.journalRecords())
}

// lyingClient is a plugin that answers OK to NodeUnpublishVolume or
// NodeUnstageVolume (the method in lieOn) without taking its mount away,
// while lying is set.
type lyingClient struct {
	*FakeClient
	lieOn string
	lying atomic.Bool
}

func (c *lyingClient) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if c.lieOn == MethodNodeUnpublishVolume && c.lying.Load() {
		err := c.begin(ctx, FakeCall{Method: MethodNodeUnpublishVolume, VolumeID: req.GetVolumeId(), TargetPath: req.GetTargetPath()})
		return &csi.NodeUnpublishVolumeResponse{}, err
	}
	return c.FakeClient.NodeUnpublishVolume(ctx, req)
}

func (c *lyingClient) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	if c.lieOn == MethodNodeUnstageVolume && c.lying.Load() {
		err := c.begin(ctx, FakeCall{Method: MethodNodeUnstageVolume, VolumeID: req.GetVolumeId(), StagingPath: req.GetStagingTargetPath()})
		return &csi.NodeUnstageVolumeResponse{}, err
	}
	return c.FakeClient.NodeUnstageVolume(ctx, req)
}

// lyingSetup is a harness whose plugin lies on lieOn once lying is set,
// with the volume of task-a set up.
func lyingSetup(t *testing.T, lieOn string) (*harness, *lyingClient) {
	t.Helper()
	var plugin *lyingClient
	h := newHarness(t, func(cfg *Config) {
		cfg.Dial = func(string) (Client, error) { return plugin, nil }
	})
	plugin = &lyingClient{FakeClient: h.fake, lieOn: lieOn}
	_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	return h, plugin
}

// A plugin that says it took its mount away and leaves a dead one (a FUSE
// daemon gone: the check of the path answers ENOTCONN) has it detached and
// the teardown ends; a path whose check fails otherwise is not taken for
// gone: the records stay and the teardown is tried again until the path
// can be told about.
func TestTeardown_PluginLeavesDeadMountOrUnreadablePath(t *testing.T) {
	cases := []struct {
		lieOn string
		path  func(*Manager) string
	}{
		{MethodNodeUnpublishVolume, func(m *Manager) string { return m.TargetPath("task-a", "data") }},
		{MethodNodeUnstageVolume, func(m *Manager) string { return m.StagingPath("p", "vol1") }},
	}
	for _, tc := range cases {
		t.Run(tc.lieOn+"/dead", func(t *testing.T) {
			h, plugin := lyingSetup(t, tc.lieOn)
			ctx := context.Background()
			path := tc.path(h.m)
			plugin.lying.Store(true)
			h.mnt.SetStale(path, true)
			h.mnt.SetIsMountPointErr(path, fmt.Errorf("failed to resolve %q: %w", path, syscall.ENOTCONN))

			must.NoError(t, h.m.Teardown(ctx, "task-a"))
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
			detached := 0
			for _, a := range h.mnt.GetActions() {
				if a.Kind == mounter.ActionDetachLazy && a.Target == path {
					detached++
				}
			}
			must.Eq(t, 1, detached)
			must.StrContains(t, h.logs.String(), "detached a dead mount the plugin left after reporting success")
		})
		t.Run(tc.lieOn+"/unreadable", func(t *testing.T) {
			h, plugin := lyingSetup(t, tc.lieOn)
			ctx := context.Background()
			path := tc.path(h.m)
			plugin.lying.Store(true)
			h.mnt.SetIsMountPointErr(path, fmt.Errorf("failed to resolve %q: %w", path, syscall.EACCES))

			err := h.m.Teardown(ctx, "task-a")
			must.ErrorContains(t, err, "retrying in the background")
			var oe *OpError
			must.True(t, errors.As(err, &oe))
			must.Eq(t, tc.lieOn, oe.Method)
			must.StrContains(t, oe.Message, "whether "+strconv.Quote(path)+" is still mounted cannot be told")
			must.SliceNotEmpty(t, h.journalRecords())
			must.SliceContains(t, h.mountPaths(), path)

			// The plugin unmounts for real, and the check can read the path.
			plugin.lying.Store(false)
			h.mnt.SetIsMountPointErr(path, nil)
			h.waitIdle()
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
		})
	}
}

// A plugin that says it took its mount away while the path is still
// mounted must not be believed: the teardown fails with Internal naming
// the path, keeps the volume's records, makes no later call that needs
// the mount gone (no unstage under a published target, no detach under a
// staged volume), and finishes in the background once the plugin really
// unmounts.
func TestTeardown_PluginLiesAboutUnmount(t *testing.T) {
	cases := []struct {
		lieOn     string
		path      func(*Manager) string
		records   []string
		notCalled []string
	}{{
		lieOn:     MethodNodeUnpublishVolume,
		path:      func(m *Manager) string { return m.TargetPath("task-a", "data") },
		records:   []string{"task task-a/data unpublishing", "vol p/vol1 staged/published"},
		notCalled: []string{MethodNodeUnstageVolume, MethodControllerUnpublishVolume},
	}, {
		lieOn:     MethodNodeUnstageVolume,
		path:      func(m *Manager) string { return m.StagingPath("p", "vol1") },
		records:   []string{"vol p/vol1 unstaging/published"},
		notCalled: []string{MethodControllerUnpublishVolume},
	}}
	for _, tc := range cases {
		t.Run(tc.lieOn, func(t *testing.T) {
			h, plugin := lyingSetup(t, tc.lieOn)
			ctx := context.Background()
			path := tc.path(h.m)
			plugin.lying.Store(true)
			h.fake.ResetCalls()

			err := h.m.Teardown(ctx, "task-a")
			must.ErrorContains(t, err, "retrying in the background")
			var oe *OpError
			must.True(t, errors.As(err, &oe))
			must.Eq(t, tc.lieOn, oe.Method)
			must.Eq(t, codes.Internal, oe.Code)
			must.StrContains(t, oe.Message, "the plugin reported success but "+strconv.Quote(path)+" is still mounted")
			must.SliceContains(t, h.mountPaths(), path)
			must.True(t, h.fake.Count(tc.lieOn) >= 1)
			// While the plugin lies, the background retries ask it again and
			// get the same answer: nothing beyond the lying call is made, the
			// records stay.
			must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
				return h.fake.Count(tc.lieOn) >= 3
			}), wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)))
			for _, m := range tc.notCalled {
				must.Eq(t, 0, h.fake.Count(m), must.Sprintf("%s called although %q is still mounted", m, path))
			}
			must.Eq(t, tc.records, h.journalRecords())

			plugin.lying.Store(false)
			h.waitIdle()
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mountPaths())
			for _, m := range tc.notCalled {
				must.Eq(t, 1, h.fake.Count(m))
			}
		})
	}
}

func TestTeardown_PermanentFailureIsNotRetried(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.fake.SetError(MethodNodeUnpublishVolume, status.Error(codes.InvalidArgument, "bad path"))
	err = h.m.Teardown(ctx, "task-a")
	must.Error(t, err)
	must.StrNotContains(t, err.Error(), "background")
	h.waitIdle()
	must.Eq(t, 1, h.fake.Count(MethodNodeUnpublishVolume))
	must.True(t, containsEvent(h.eventMsgs(), "not retrying"))
	must.Len(t, 2, h.journalRecords())
}

func TestRollback_PartialFailure(t *testing.T) {
	h := newHarness(t)
	reqs := []VolumeRequest{req("one", "vol1", "/one"), req("two", "vol2", "/two"), req("three", "vol3", "/three")}
	h.fake.SetNextError(MethodNodeStageVolume, nil, status.Error(codes.NotFound, "no such volume"))
	_, err := h.m.Setup(context.Background(), "t", reqs)
	must.ErrorContains(t, err, `failed to stage volume "two"`)
	must.ErrorContains(t, err, `volume "vol2" does not exist on plugin "p": create it or add a create block`)
	must.Eq(t, []string{
		MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodePublishVolume, // one
		MethodControllerPublishVolume, MethodNodeStageVolume, // two fails
		MethodNodeUnstageVolume, MethodControllerUnpublishVolume, // two undone
		MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume, // one undone
	}, h.fake.Methods())
	must.Eq(t, 0, h.fake.Count(MethodNodePublishVolume)-1)
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
	must.Eq(t, 0, h.m.Users("p", "vol1"))
}

func TestBadInput_LeavesNothingBehind(t *testing.T) {
	blockPlugin := fullPlugin("noblock")
	blockPlugin.Block, blockPlugin.CreateDelete = false, false
	sick := fullPlugin("sick")
	sick.Healthy, sick.HealthDescription = false, "probe failed"

	mod := func(f func(*VolumeRequest)) []VolumeRequest {
		r := req("data", "vol1", "/data")
		f(&r)
		return []VolumeRequest{r}
	}
	cases := []struct {
		name   string
		reqs   []VolumeRequest
		is     error
		want   string
		static bool
	}{
		{"unknown plugin", mod(func(r *VolumeRequest) { r.PluginID = "nope" }), ErrPluginNotFound, `CSI plugin "nope" is not running on node "n1"`, false},
		{"unhealthy plugin", mod(func(r *VolumeRequest) { r.PluginID = "sick" }), ErrPluginNotFound, `CSI plugin "sick" on node "n1" is not healthy (probe failed)`, false},
		{"block unsupported", mod(func(r *VolumeRequest) {
			r.PluginID, r.AttachmentMode, r.FSType, r.MountFlags = "noblock", AttachmentBlockDevice, "", nil
		}), ErrInvalid, `does not serve attachment_mode = "block-device"`, false},
		{"create unsupported", mod(func(r *VolumeRequest) { r.PluginID, r.Create = "noblock", &CreateRequest{} }), ErrInvalid, "cannot create volumes", false},
		{"relative destination", mod(func(r *VolumeRequest) { r.Destination = "data" }), ErrInvalid, `destination "data" must be an absolute path`, true},
		// The kernel takes no path with a NUL byte: refused before the
		// plugin publishes a volume the task's mount would then fail on.
		{"NUL in destination", mod(func(r *VolumeRequest) { r.Destination = "/da\x00ta" }), ErrInvalid, `destination "/da\x00ta" must not hold a NUL byte`, true},
		{"escaping destination", mod(func(r *VolumeRequest) { r.Destination = "/data/../../etc" }), ErrInvalid, "must not contain '..'", true},
		{"root destination", mod(func(r *VolumeRequest) { r.Destination = "/" }), ErrInvalid, "task's root", true},
		{"empty destination", mod(func(r *VolumeRequest) { r.Destination = "" }), ErrInvalid, "destination must not be empty", true},
		{"duplicate destination", []VolumeRequest{req("a", "v1", "/data"), req("b", "v2", "/data/")}, ErrInvalid, `is also the destination of volume "a"`, true},
		{"duplicate name", []VolumeRequest{req("a", "v1", "/x"), req("a", "v2", "/y")}, ErrInvalid, "name is used by more than one volume", true},
		// One volume twice in a task: what checkShare asks of two tasks
		// sharing it, which it does not ask of one.
		{"single-node-writer twice, other flags", func() []VolumeRequest {
			a, b := req("a", "v1", "/a"), req("b", "v1", "/b")
			b.MountFlags = []string{"sync"}
			return []VolumeRequest{a, b}
		}(), ErrInvalid,
			`volume "b": volume_id "v1" of plugin "p" is also volume "a", and single-node-writer publishes it once on a node, for both blocks: give both the same mount_options.mount_flags and context`, true},
		{"same volume, other modes", func() []VolumeRequest {
			a, b := req("a", "v1", "/a"), req("b", "v1", "/b")
			a.AccessMode, b.AccessMode, b.ReadOnly, b.FSType = AccessMultiNodeMultiWriter, AccessMultiNodeReaderOnly, true, "xfs"
			return []VolumeRequest{a, b}
		}(), ErrInvalid, `volume "b": volume_id "v1" of plugin "p" is also volume "a", with access_mode = "multi-node-multi-writer", attachment_mode = "file-system", fs_type = "ext4": give both blocks the same values`, true},
		{"bad name", mod(func(r *VolumeRequest) { r.Name = "../x" }), ErrInvalid, "name must be 1-63", true},
		{"empty volume id", mod(func(r *VolumeRequest) { r.VolumeID = "" }), ErrInvalid, "volume_id must not be empty", true},
		{"empty plugin", mod(func(r *VolumeRequest) { r.PluginID = "" }), ErrInvalid, "plugin_id must not be empty", true},
		{"missing access mode", mod(func(r *VolumeRequest) { r.AccessMode = "" }), ErrInvalid, "access_mode must be set", true},
		{"bad access mode", mod(func(r *VolumeRequest) { r.AccessMode = "single-node-multi-writer" }), ErrInvalid, `access_mode "single-node-multi-writer" is not supported`, true},
		{"bad attachment mode", mod(func(r *VolumeRequest) { r.AttachmentMode = "nfs" }), ErrInvalid, `attachment_mode "nfs" is not supported`, true},
		{"fs_type on block", mod(func(r *VolumeRequest) { r.AttachmentMode = AttachmentBlockDevice }), ErrInvalid, "mount_options cannot be used", true},
		{"capacity order", mod(func(r *VolumeRequest) { r.Create = &CreateRequest{CapacityMin: 10, CapacityMax: 5} }), ErrInvalid, "must not exceed", true},
		{"negative capacity", mod(func(r *VolumeRequest) { r.Create = &CreateRequest{CapacityMin: -1} }), ErrInvalid, "must not be negative", true},
		{"empty secret key", mod(func(r *VolumeRequest) { r.Secrets = map[string]string{"": canary} }), ErrInvalid, "secrets must not have an empty key", true},
		{"second plugin in list fails", []VolumeRequest{req("a", "v1", "/a"), func() VolumeRequest { r := req("b", "v2", "/b"); r.PluginID = "nope"; return r }()}, ErrPluginNotFound, `"nope"`, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.setPlugin(blockPlugin)
			h.setPlugin(sick)
			_, err := h.m.Setup(context.Background(), "t", tc.reqs)
			must.ErrorIs(t, err, tc.is)
			must.ErrorContains(t, err, tc.want)
			must.StrNotContains(t, err.Error(), canary)
			if tc.static {
				must.ErrorIs(t, h.m.Validate(tc.reqs), ErrInvalid)
			} else {
				must.NoError(t, h.m.Validate(tc.reqs))
			}
			must.SliceEmpty(t, h.fake.Methods())
			must.SliceEmpty(t, h.journalRecords())
			must.SliceEmpty(t, h.mnt.GetActions())
			// The only word to the task: that it waited for the plugin.
			for _, msg := range h.eventMsgs() {
				must.StrHasPrefix(t, "Waiting up to ", msg)
			}
			for _, dir := range []string{"publish", "staging"} {
				entries, err := os.ReadDir(filepath.Join(h.root, dir))
				if !errors.Is(err, fs.ErrNotExist) {
					must.NoError(t, err)
				}
				must.SliceEmpty(t, entries)
			}
		})
	}
}

func TestConflicts(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.fake.ResetCalls()
	h.mnt.ResetActions()
	before := h.journalRecords()

	t.Run("second writer on single-node-writer", func(t *testing.T) {
		_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{req("data", "vol1", "/data")})
		must.ErrorIs(t, err, ErrConflict)
		must.ErrorContains(t, err, `volume_id "vol1" is single-node-writer and task "task-a" already has it published writable`)
	})
	t.Run("other access mode than staged", func(t *testing.T) {
		r := req("data", "vol1", "/data")
		r.AccessMode, r.ReadOnly = AccessMultiNodeReaderOnly, true
		_, err := h.m.Setup(ctx, "task-b", []VolumeRequest{r})
		must.ErrorIs(t, err, ErrConflict)
		must.ErrorContains(t, err, `in use on this node with access_mode = "single-node-writer"`)
	})
	must.SliceEmpty(t, h.fake.Methods())
	must.SliceEmpty(t, h.mnt.GetActions())
	must.Eq(t, before, h.journalRecords())

	// Once task-a is gone the volume can be used by task-b.
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.NoError(t, h.m.Teardown(ctx, "task-b"))
}

func TestSecrets_NeverInLogsEventsOrErrors(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "vol1", "/data")
	r.Create = &CreateRequest{Parameters: map[string]string{"type": "dir"}}
	r.MountFlags = []string{"password=" + canary}

	// A plugin that echoes the secret back in its messages.
	echo := status.Error(codes.PermissionDenied, "token "+canary+" was refused")
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.Unavailable, "retry "+canary))
	h.fake.SetNextError(MethodNodePublishVolume, echo)
	_, err := h.m.Setup(ctx, "t", []VolumeRequest{r})
	must.Error(t, err)
	must.StrContains(t, err.Error(), "token <redacted> was refused")

	_, err2 := h.m.Setup(ctx, "t", []VolumeRequest{r})
	must.NoError(t, err2)
	h.fake.SetError(MethodNodeUnpublishVolume, status.Error(codes.Unavailable, "down "+canary))
	terr := h.m.Teardown(ctx, "t")
	must.Error(t, terr)
	must.Wait(t, waitFor(func() bool { return containsEvent(h.eventMsgs(), "retrying in") }))
	h.fake.SetError(MethodNodeUnpublishVolume, nil)
	h.waitIdle()
	must.SliceEmpty(t, h.journalRecords())

	// The plugin did get the secret.
	for _, c := range h.fake.Calls() {
		switch c.Method {
		case MethodCreateVolume, MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodePublishVolume:
			must.Eq(t, canary, c.Secrets["token"], must.Sprint(c.Method))
		}
	}
	must.StrNotContains(t, err.Error(), canary)
	must.StrNotContains(t, terr.Error(), canary)
	logs := h.logs.String()
	must.StrContains(t, logs, "CSI call failed")
	must.StrNotContains(t, logs, canary)
	for _, e := range h.eventMsgs() {
		must.StrNotContains(t, e, canary)
	}
	h.mu.Lock()
	for _, e := range h.events {
		for _, v := range e.Ann {
			must.StrNotContains(t, v, canary)
		}
	}
	h.mu.Unlock()
}

func TestRedact(t *testing.T) {
	must.Eq(t, "a <redacted> b <redacted>", redact("a xyz b xyzw", map[string]string{"k": "xyz", "l": "xyzw"}))
	must.Eq(t, "unchanged", redact("unchanged", nil, map[string]string{"k": ""}))
}

func TestKeyLocks(t *testing.T) {
	l := newKeyLocks()
	unlock, err := l.lock(context.Background(), "a")
	must.NoError(t, err)
	// Another key is free.
	u2, err := l.lock(context.Background(), "b")
	must.NoError(t, err)
	u2()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err = l.lock(ctx, "a")
	must.ErrorIs(t, err, context.DeadlineExceeded)
	unlock()
	u3, err := l.lock(context.Background(), "a")
	must.NoError(t, err)
	u3()
	must.MapEmpty(t, l.locks)
}

func TestNew_RejectsBadConfig(t *testing.T) {
	_, err := New(Config{Root: "rel", Lookup: func(string) (PluginInfo, error) { return PluginInfo{}, nil }})
	must.ErrorContains(t, err, "must be an absolute path")
	_, err = New(Config{Root: t.TempDir()})
	must.ErrorContains(t, err, "lookup")
}

func TestJournal_BadRecordSetAside(t *testing.T) {
	h := newHarness(t)
	dir := filepath.Join(h.root, "journal")
	must.NoError(t, os.WriteFile(filepath.Join(dir, "v-0000000000000000.json"), []byte("{not json"), 0o600))
	must.NoError(t, os.WriteFile(filepath.Join(dir, ".tmp-123"), []byte("partial"), 0o600))
	h.restart()
	files := h.journalRecords()
	must.Eq(t, []string{"v-0000000000000000.json.bad"}, files)
	must.StrContains(t, h.logs.String(), "unreadable journal record set aside")
}

func waitFor(cond func() bool) *wait.Constraint {
	return wait.InitialSuccess(wait.BoolFunc(cond), wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond))
}

func randFloat() float64 { return rand.Float64() }

func TestRestart_StagingLostIsStagedAgainBeforeNewPublish(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	r := req("data", "shared", "/data")
	r.AccessMode = AccessMultiNodeMultiWriter
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{r})
	must.NoError(t, err)
	h.restart()
	// As after a reboot: the staging mount is gone, the journal says staged.
	must.NoError(t, h.mnt.Unmount(h.m.StagingPath("p", "shared")))
	h.fake.ResetCalls()
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{r})
	must.NoError(t, err)
	must.Eq(t, []string{MethodNodeStageVolume, MethodNodePublishVolume}, h.fake.Methods())

	// With the staging mount in place, a third task only publishes.
	h.restart()
	h.fake.ResetCalls()
	_, err = h.m.Setup(ctx, "task-c", []VolumeRequest{r})
	must.NoError(t, err)
	must.Eq(t, []string{MethodNodePublishVolume}, h.fake.Methods())
}

// journalBatches is how many batches the journal has committed.
func (h *harness) journalBatches() (batches, syncs int) {
	st := h.m.journal.log.Stats()
	return st.Batches, st.Syncs
}

// TestJournal_BatchesPerStep counts the journal's writes, and how many of
// them wait for the disk, in setup and teardown. Setup: one synced batch
// before the first call (the volume's "-ing" record with the task's intent
// to publish), one more before NodeStageVolume after an attach (its
// result and "staging"), and the results of the last calls in one lazy
// batch. Teardown: a synced batch before each call, and a lazy one for the
// last result. A setup in a namespace, which claims the volume and makes
// it its owner once published, writes no batch and waits for no sync
// more.
func TestJournal_BatchesPerStep(t *testing.T) {
	cases := []struct {
		name                        string
		plugin                      PluginInfo
		setup, setupSyncs, teardown int
	}{
		{"attach and stage", fullPlugin("p"), 3, 2, 4},
		{"stage", PluginInfo{ID: "p", Socket: "/run/p.sock", Healthy: true, StageUnstage: true}, 2, 1, 3},
		{"neither", PluginInfo{ID: "p", Socket: "/run/p.sock", Healthy: true}, 2, 1, 2},
	}
	for _, tc := range cases {
		for _, ns := range []string{"", "team-a"} {
			t.Run(tc.name+"/namespace="+ns, func(t *testing.T) {
				batchesPerStep(t, tc.plugin, ns, tc.setup, tc.setupSyncs, tc.teardown)
			})
		}
	}
}

func batchesPerStep(t *testing.T, plugin PluginInfo, namespace string, setup, setupSyncs, teardown int) {
	h := newHarness(t)
	h.setPlugin(plugin)
	ctx := context.Background()
	r := req("data", "vol1", "/data")
	r.AccessMode = AccessMultiNodeMultiWriter
	r.Namespace = namespace
	n, syncs := h.journalBatches()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{r})
	must.NoError(t, err)
	n2, syncs2 := h.journalBatches()
	must.Eq(t, setup, n2-n, must.Sprint("setup"))
	must.Eq(t, setupSyncs, syncs2-syncs, must.Sprint("synced batches of setup"))

	// A second task on the volume only publishes.
	n, syncs = h.journalBatches()
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{r})
	must.NoError(t, err)
	n2, syncs2 = h.journalBatches()
	must.Eq(t, 2, n2-n, must.Sprint("setup of a second user"))
	must.Eq(t, 1, syncs2-syncs, must.Sprint("synced batches of setup of a second user"))
	n, _ = h.journalBatches()
	must.NoError(t, h.m.Teardown(ctx, "task-b"))
	n2, _ = h.journalBatches()
	must.Eq(t, 2, n2-n, must.Sprint("teardown of a second user"))

	n, _ = h.journalBatches()
	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	n2, _ = h.journalBatches()
	must.Eq(t, teardown, n2-n, must.Sprint("teardown"))
	must.SliceEmpty(t, h.journalRecords())
	owner, _ := h.m.Owner("p", "vol1")
	must.Eq(t, namespace, owner)
}

// The task's intent to publish is on disk before NodeStageVolume, but a
// setup that fails there does not unpublish what it never published; a
// driver that crashed there does, on recovery, since it cannot know.
func TestSetup_IntentToPublishAheadOfStage(t *testing.T) {
	h := newHarness(t)
	h.setPlugin(PluginInfo{ID: "p", Socket: "/run/p.sock", Healthy: true, StageUnstage: true})
	h.fake.SetError(MethodNodeStageVolume, status.Error(codes.InvalidArgument, "bad volume"))
	_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
	must.ErrorContains(t, err, "bad volume")
	must.Eq(t, []string{MethodNodeStageVolume, MethodNodeUnstageVolume}, h.fake.Methods())
	for _, msg := range h.eventMsgs() {
		must.StrNotContains(t, msg, "Unpublishing")
	}
	must.SliceEmpty(t, h.journalRecords())

	// During NodeStageVolume the records on disk say both calls may have
	// been made: a crash there is settled by unpublishing and unstaging
	// (TestRecover_UncertainStage).
	h.fake.SetError(MethodNodeStageVolume, nil)
	h.fake.ResetCalls()
	release := h.fake.HangMethod(MethodNodeStageVolume)
	done := make(chan error, 1)
	go func() {
		_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{req("data", "vol1", "/data")})
		done <- err
	}()
	must.Wait(t, waitFor(func() bool { return h.fake.Count(MethodNodeStageVolume) == 1 }))
	s := diskJournal(t, filepath.Join(h.root, "journal"))
	must.Eq(t, phaseStaging, s.vols[volKey{"p", "vol1"}].Stage)
	must.Eq(t, phasePublishing, s.task("t", "data").State)
	release()
	must.NoError(t, <-done)
	must.NoError(t, h.m.Teardown(context.Background(), "t"))
	must.Eq(t, []string{MethodNodeStageVolume, MethodNodePublishVolume, MethodNodeUnpublishVolume, MethodNodeUnstageVolume},
		h.fake.Methods())
}

// The staging directory and the publish directory's parent are made beside
// the journal's commit and the calls before NodePublishVolume: when one
// cannot be made, the call that needs it is never made, the error names
// it, and the rollback leaves no record and no directory of the task.
func TestSetup_DirectoryMadeAsideFails(t *testing.T) {
	for _, c := range []struct {
		name, want string
		blocked    func(h *harness) string
		calls      []string
	}{
		{"staging", "failed to create staging directory",
			func(h *harness) string { return filepath.Dir(h.m.StagingPath("p", "vol1")) },
			// The records went out with the directory being made; the
			// volume's goes back, so no stage that never was is undone.
			[]string{MethodControllerPublishVolume, MethodControllerUnpublishVolume}},
		{"publish", `failed to create the publish directory of volume "data"`,
			func(h *harness) string { return filepath.Dir(h.m.TargetPath("task-a", "data")) },
			[]string{MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			// A file where the directory goes: MkdirAll fails.
			blocked := c.blocked(h)
			must.NoError(t, os.MkdirAll(filepath.Dir(blocked), 0o750))
			must.NoError(t, os.WriteFile(blocked, nil, 0o600))
			_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
			must.ErrorContains(t, err, c.want)
			must.Eq(t, c.calls, h.fake.Methods())
			must.SliceEmpty(t, h.journalRecords())
			must.Eq(t, 0, h.m.Users("p", "vol1"))
			if c.name == "staging" {
				_, err := os.Stat(filepath.Dir(h.m.TargetPath("task-a", "data")))
				must.True(t, errors.Is(err, fs.ErrNotExist), must.Sprintf("the task's publish directory is left: %v", err))
			}
		})
	}
}

// A set-up that fails while the task's publish directory is being made
// aside waits for it before its undo runs: the undo removes the directory,
// which a mkdir landing after it would leave for good.
func TestSetup_PublishDirectoryMadeAsideIsUndone(t *testing.T) {
	h := newHarness(t)
	taskDir := filepath.Dir(h.m.TargetPath("task-a", "data"))
	asideStarts = func(dir string) {
		if dir == taskDir {
			time.Sleep(200 * time.Millisecond)
		}
	}
	t.Cleanup(func() { asideStarts = func(string) {} })
	h.fake.SetError(MethodControllerPublishVolume, status.Error(codes.InvalidArgument, "bad volume"))
	_, err := h.m.Setup(context.Background(), "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.ErrorContains(t, err, "bad volume")
	must.SliceEmpty(t, h.journalRecords())
	// A mkdir left running would land after the delay.
	time.Sleep(300 * time.Millisecond)
	_, err = os.Stat(taskDir)
	must.True(t, errors.Is(err, fs.ErrNotExist), must.Sprintf("the task's publish directory is left: %v", err))
}

// Volumes of one plugin share its staging directory, which the last
// release removes: a setup making its volume's directory there at that
// moment must not fail with "no such file or directory" (a soak run hit it
// 261 cycles in). Many rounds of two volumes, one set up while the other
// is released.
func TestMakeDir_concurrentWithRemoveIfEmpty(t *testing.T) {
	h := newHarness(t)
	parent := filepath.Join(t.TempDir(), "staging", "p")
	var wg sync.WaitGroup
	errs := make(chan error, 1)
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				dir := filepath.Join(parent, fmt.Sprintf("vol-%d-%d", w, i))
				if err := h.m.makeDir(dir); err != nil {
					select {
					case errs <- err:
					default:
					}
					return
				}
				_ = os.Remove(dir)
				h.m.removeIfEmpty(parent)
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatalf("making a volume directory beside a release: %v", err)
	default:
	}
}

// A plugin's error text (a job may run the plugin) reaches the task's
// events and failure with its terminal escapes and newlines escaped,
// bounded, and without the volume's secrets.
func TestSetup_pluginErrorTextCleaned(t *testing.T) {
	h := newHarness(t)
	r := req("data", "vol1", "/data")
	r.Secrets = map[string]string{"token": "s3cr3t-value"}
	hostile := "\x1b]0;owned\a\x1b[2J\nFAKE: task ok s3cr3t-value " + strings.Repeat("x", 100000)
	h.fake.SetError(MethodNodeStageVolume, status.Error(codes.InvalidArgument, hostile))
	_, err := h.m.Setup(context.Background(), "t", []VolumeRequest{r})
	must.Error(t, err)
	var oe *OpError
	must.True(t, errors.As(err, &oe))
	for _, text := range append(h.eventMsgs(), err.Error(), oe.Message) {
		must.StrNotContains(t, text, "\x1b")
		must.StrNotContains(t, text, "\n")
		must.StrNotContains(t, text, "s3cr3t-value")
		must.Less(t, 2*MaxErrorMessage+1000, len(text))
	}
	must.StrContains(t, oe.Message, `\x1b]0;owned\x07\x1b[2J\nFAKE`)
}

// TestTeardown_OneEventPerVolume: a stop tells each volume's teardown in
// one event, once it is done, naming the calls it made (each event is a
// write to Nomad's state and a sync to its servers); a volume another
// task still uses says it stays staged; no event of a step beginning.
func TestTeardown_OneEventPerVolume(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	shared := req("data", "vol1", "/data")
	shared.AccessMode = AccessMultiNodeMultiWriter
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{shared, req("logs", "vol2", "/logs")})
	must.NoError(t, err)
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{shared})
	must.NoError(t, err)
	h.mu.Lock()
	h.events = nil
	h.mu.Unlock()

	must.NoError(t, h.m.Teardown(ctx, "task-a"))
	must.NoError(t, h.m.Teardown(ctx, "task-b"))
	h.mu.Lock()
	got := slices.Clone(h.events)
	h.mu.Unlock()
	var msgs []string
	for _, e := range got {
		msgs = append(msgs, e.TaskID+": "+e.Msg)
	}
	must.Eq(t, []string{
		`task-a: Unpublished, unstaged and detached volume "logs"`,
		`task-a: Unpublished volume "data"; it stays staged for other tasks on this node`,
		`task-b: Unpublished, unstaged and detached volume "data"`,
	}, msgs)
	must.Eq(t, map[string]string{"volume": "logs", "plugin_id": "p", "volume_id": "vol2"}, got[0].Ann)
}

// A teardown step the plugin does not answer is told to the task while the
// driver waits (there is no event as a step begins), once per call; the
// teardown's own event follows when the plugin answers. A step that
// answers in time says nothing of the kind.
func TestTeardown_SlowCallEvent(t *testing.T) {
	old := slowCallEvent
	slowCallEvent = 50 * time.Millisecond
	t.Cleanup(func() { slowCallEvent = old })
	h := newHarness(t)
	ctx := context.Background()
	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	h.mu.Lock()
	h.events = nil
	h.mu.Unlock()
	messages := func() []string {
		h.mu.Lock()
		defer h.mu.Unlock()
		var out []string
		for _, e := range h.events {
			out = append(out, e.TaskID+": "+e.Msg)
		}
		return out
	}

	release := h.fake.HangMethod(MethodNodeUnstageVolume)
	done := make(chan error, 1)
	go func() { done <- h.m.Teardown(ctx, "task-a") }()
	want := `task-a: Unstaging volume "data": plugin "p" has not answered NodeUnstageVolume for 50ms; still waiting`
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return slices.Contains(messages(), want) }),
		wait.Timeout(5*time.Second), wait.Gap(10*time.Millisecond)), must.Sprintf("events: %q", messages()))
	release()
	must.NoError(t, <-done)
	must.Eq(t, []string{want, `task-a: Unpublished, unstaged and detached volume "data"`}, messages())

	h.mu.Lock()
	h.events = nil
	h.mu.Unlock()
	_, err = h.m.Setup(ctx, "task-b", []VolumeRequest{req("data", "vol1", "/data")})
	must.NoError(t, err)
	must.NoError(t, h.m.Teardown(ctx, "task-b"))
	time.Sleep(2 * slowCallEvent)
	for _, m := range messages() {
		must.StrNotContains(t, m, "has not answered")
	}
}

// A volume left staged with nobody using it (its release is waiting to be
// retried) and another capability is taken down before a new task stages
// it anew: the new task hears what was done and why.
func TestSetup_RestagesLeftOverVolumeSayingWhy(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.BackgroundRetryBase, c.BackgroundRetryMax = time.Hour, time.Hour })
	h.teardownFailing(t, "task-a", MethodNodeUnstageVolume)
	must.Eq(t, 0, h.m.Users("p", "vol1"))

	r := req("data", "vol1", "/data")
	r.AccessMode = AccessMultiNodeMultiWriter
	_, err := h.m.Setup(context.Background(), "task-b", []VolumeRequest{r})
	must.NoError(t, err)
	var b []string
	h.mu.Lock()
	for _, e := range h.events {
		if e.TaskID == "task-b" {
			b = append(b, e.Msg)
		}
	}
	h.mu.Unlock()
	must.SliceNotEmpty(t, b)
	must.Eq(t, `Unstaged and detached volume "data"; it was left staged with another access mode, attachment, file system or mount group, and is staged anew`, b[0], must.Sprint(b))
	must.Eq(t, 1, h.m.Users("p", "vol1"))
}

// A task's publish directory exists only once a record of the task is in
// the journal: a driver that dies in between leaves a directory nothing
// knows of, which no recovery removes. Here the setup waits in
// NodeGetInfo, before its first record: the directory must not be there
// yet (nor after a restart that recovers the journal as it is).
func TestSetup_NoPublishDirectoryBeforeTheTasksRecord(t *testing.T) {
	h := newHarness(t)
	p := fullPlugin("p")
	p.NodeID = ""
	h.setPlugin(p)
	release := h.fake.HangMethod(MethodNodeGetInfo)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
		done <- err
	}()
	must.Wait(t, waitFor(func() bool { return len(h.fake.Methods()) > 0 }))
	must.Eq(t, []string{MethodNodeGetInfo}, h.fake.Methods())
	taskDir := filepath.Dir(h.m.TargetPath("task-a", "data"))
	// The directory, when made ahead, is made at once: give it a moment.
	deadline := time.Now().Add(time.Second)
	var statErr error
	for time.Now().Before(deadline) {
		if _, statErr = os.Stat(taskDir); statErr == nil {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	records := h.journalRecords()
	cancel()
	release()
	<-done
	must.SliceEmpty(t, records, must.Sprint("NodeGetInfo comes before the first record"))
	must.True(t, errors.Is(statErr, fs.ErrNotExist),
		must.Sprintf("the task's publish directory %s exists with no record of the task in the journal: a crash now leaves it for good (%v)", taskDir, statErr))
}

// A volume this node created is the plugin's id under two names: the
// volume_id it was created with and the id the plugin answered. One task
// naming it both ways has it twice, as one task naming it twice by the
// same name does (validate): refused before any call, by the id both
// names resolve to.
func TestSetup_CreatedVolumeTwiceByBothNamesRefused(t *testing.T) {
	h := newHarness(t)
	r := req("data", "myvol", "/data")
	r.Create = &CreateRequest{}
	_, err := h.m.Setup(context.Background(), "t1", []VolumeRequest{r})
	must.NoError(t, err)
	must.NoError(t, h.m.Teardown(context.Background(), "t1"))

	h.fake.ResetCalls()
	_, err = h.m.Setup(context.Background(), "t2", []VolumeRequest{req("data", "myvol", "/data"), req("again", "id-myvol", "/again")})
	must.ErrorIs(t, err, ErrInvalid)
	must.ErrorContains(t, err, `volume "again": volume_id "id-myvol" of plugin "p" is also volume "data" (volume_id "myvol"): both are the plugin's volume "id-myvol", created on this node`)
	for _, c := range h.fake.Calls() {
		must.NotEq(t, MethodNodePublishVolume, c.Method)
	}
	must.Eq(t, 0, h.m.Users("p", "id-myvol"))
}
