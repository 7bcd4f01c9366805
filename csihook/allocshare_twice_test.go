package csihook

import (
	"context"
	"os"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Nomad lets one task mount a group's volume twice (two volume_mount
// blocks of one claim). Two volume blocks of one task naming one
// single-node-writer volume share its one publish as the tasks of an
// allocation do: one NodePublishVolume, a view each (one of them may read
// only), one NodeUnpublishVolume when the task is gone, across a restart.
func TestClaims_SingleNodeWriter_TwoBlocksOfOneTaskShareOnePublish(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	const task = "alloc-a/app/11111111"
	a, b := req("a", "vol1", "/a"), req("b", "vol1", "/b")
	a.Secrets, b.Secrets = nil, nil
	b.ReadOnly = true
	pubs, err := h.m.Setup(ctx, task, []VolumeRequest{a, b})
	must.NoError(t, err)
	np := h.callsOf(MethodNodePublishVolume)
	must.Len(t, 1, np)
	must.False(t, np[0].Readonly)
	must.Eq(t, pubs[0].HostPath, pubs[1].HostPath)
	must.Eq(t, "/a", pubs[0].Destination)
	must.Eq(t, "/b", pubs[1].Destination)
	must.False(t, pubs[0].ReadOnly)
	must.True(t, pubs[1].ReadOnly)
	must.True(t, containsEvent(h.eventMsgs(), `sharing its publish for volume "a" of this task`))
	// The plugin makes target_path (CSI spec); the fake does not.
	must.NoError(t, os.MkdirAll(pubs[0].HostPath, 0o750))

	// Set up again (a restarted task): nothing is called.
	h.fake.ResetCalls()
	again, err := h.m.Setup(ctx, task, []VolumeRequest{a, b})
	must.NoError(t, err)
	must.Eq(t, pubs, again)
	must.SliceEmpty(t, h.fake.Methods())

	// A restart that lost the publish makes it once.
	h.restart()
	must.NoError(t, h.mnt.Unmount(pubs[0].HostPath))
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	h.waitIdle()
	np = h.callsOf(MethodNodePublishVolume)
	must.Len(t, 1, np)
	must.False(t, np[0].Readonly)

	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, task))
	must.Len(t, 1, h.callsOf(MethodNodeUnpublishVolume))
	must.Len(t, 1, h.callsOf(MethodNodeUnstageVolume))
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
	must.SliceEmpty(t, publishDirs(t, h))
}

// A block that fails after the first of two naming one single-node-writer
// volume was published undoes the task's setup: the shared publish is
// unpublished once, nothing is left.
func TestClaims_SingleNodeWriter_TwoBlocksOfOneTaskRollBack(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	a, b, c := req("a", "vol1", "/a"), req("b", "vol1", "/b"), req("c", "vol2", "/c")
	// a's publish succeeds, c's is refused for good.
	h.fake.SetNextError(MethodNodePublishVolume, nil, status.Error(codes.InvalidArgument, "bad volume"))
	_, err := h.m.Setup(ctx, "alloc-a/app/11111111", []VolumeRequest{a, b, c})
	must.Eq(t, codes.InvalidArgument, Code(err))
	h.waitIdle()
	must.Len(t, 2, h.callsOf(MethodNodePublishVolume))
	n := 0
	for _, u := range h.callsOf(MethodNodeUnpublishVolume) {
		if u.VolumeID == "vol1" {
			n++
		}
	}
	must.Eq(t, 1, n, must.Sprint("the publish a and b share is unpublished once"))
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}
