package mounter

import (
	"errors"
	"testing"

	"github.com/shoenig/test/must"
)

func TestFake_RecordsAndTracksMounts(t *testing.T) {
	f := NewFake(
		MountPoint{ID: 1, Path: "/", Shared: true, PeerGroup: 1},
		MountPoint{ID: 2, Path: "/srv/shared", Shared: true, PeerGroup: 2},
	)

	must.NoError(t, f.EnsureTarget("/task/data", true))
	must.NoError(t, f.BindMount("/srv/shared", "/task/data", true, true))
	must.NoError(t, f.MountSensitive("server:/x", "/task/nfs", "nfs", 0, []string{"ro"}, []string{"password=secret"}))
	must.NoError(t, f.SetPropagation("/task/data", PropagationSlave, true))

	ok, err := f.IsMountPoint("/task/data/")
	must.NoError(t, err)
	must.True(t, ok)

	mounts, err := f.List()
	must.NoError(t, err)
	mp, found := FindMount(mounts, "/task/data")
	must.True(t, found)
	must.Eq(t, []string{"ro"}, mp.Options)
	must.True(t, mp.Slave)
	must.Eq(t, 2, mp.Master)

	actions := f.GetActions()
	must.Len(t, 4, actions)
	must.Eq(t, FakeAction{Kind: ActionEnsureTarget, Target: "/task/data", IsDir: true}, actions[0])
	must.Eq(t, FakeAction{Kind: ActionBindMount, Source: "/srv/shared", Target: "/task/data", ReadOnly: true, Recursive: true}, actions[1])
	must.Eq(t, "ro,<masked>", actions[2].Data)
	must.Eq(t, PropagationSlave, actions[3].Mode)

	must.NoError(t, f.Unmount("/task/data"))
	must.NoError(t, f.Unmount("/task/data")) // not mounted: success
	ok, err = f.IsMountPoint("/task/data")
	must.NoError(t, err)
	must.False(t, ok)

	// Every IsMountPoint is counted by its cleaned path, none an action.
	must.Eq(t, 2, f.MountPointChecks("/task/data"))
	must.Eq(t, 0, f.MountPointChecks("/task/nfs"))

	f.ResetActions()
	must.Len(t, 0, f.GetActions())
	must.Eq(t, 0, f.MountPointChecks("/task/data"))
}

func TestFake_PerPathErrors(t *testing.T) {
	boom := errors.New("boom")
	cases := []struct {
		name string
		set  func(f *Fake)
		call func(f *Fake) error
	}{
		{"mount", func(f *Fake) { f.MountErrs = map[string]error{"/t": boom} },
			func(f *Fake) error { return f.Mount("tmpfs", "/t", "tmpfs", 0, "") }},
		{"bind", func(f *Fake) { f.MountErrs = map[string]error{"/t": boom} },
			func(f *Fake) error { return f.BindMount("/", "/t", false, false) }},
		{"unmount", func(f *Fake) { f.UnmountErrs = map[string]error{"/t": boom} },
			func(f *Fake) error { return f.Unmount("/t") }},
		{"propagation", func(f *Fake) { f.PropagationErrs = map[string]error{"/t": boom} },
			func(f *Fake) error { return f.SetPropagation("/t", PropagationPrivate, false) }},
		{"ensure", func(f *Fake) { f.EnsureTargetErrs = map[string]error{"/t": boom} },
			func(f *Fake) error { return f.EnsureTarget("/t", true) }},
		{"remount", func(f *Fake) { f.RemountErrs = map[string]error{"/t": boom} },
			func(f *Fake) error { return f.RemountReadOnly("/t", false) }},
		{"list", func(f *Fake) { f.ListErr = boom },
			func(f *Fake) error { _, err := f.List(); return err }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			table := []MountPoint{{ID: 1, Path: "/"}, {ID: 2, Path: "/t", Options: []string{"rw"}}}
			f := NewFake(table...)
			tc.set(f)
			must.ErrorIs(t, tc.call(f), boom)
			// A failed call changes nothing.
			must.Eq(t, table, f.MountPoints)
			must.MapEmpty(t, f.Targets)
		})
	}
}

func TestFake_PropagationNeedsMountPoint(t *testing.T) {
	f := NewFake(MountPoint{ID: 1, Path: "/"})
	must.ErrorContains(t, f.SetPropagation("/nope", PropagationPrivate, false), "not a mount point")
	must.ErrorContains(t, f.SetPropagation("/", "bogus", false), "unknown propagation mode")
}
