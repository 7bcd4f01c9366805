package driver

import (
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

func isMounted(f *mounter.Fake, path string) bool {
	for _, mp := range f.MountPoints {
		if mp.Path == path {
			return true
		}
	}
	return false
}

func TestSharedSources_selfBindRefcounted(t *testing.T) {
	root := t.TempDir()
	src := filepath.Join(root, "src")
	must.NoError(t, mkdirs(src))
	f := mounter.NewFake(mounter.MountPoint{Path: "/", Shared: true, PeerGroup: 1})
	state := filepath.Join(root, "shared-mounts.json")
	s := newSharedSources(hclog.NewNullLogger(), f, state)

	must.NoError(t, s.acquire([]string{src}))
	must.True(t, isMounted(f, src))
	mp, _ := mounter.FindMount(f.MountPoints, src)
	must.True(t, mp.Shared)
	must.NotEq(t, 1, mp.PeerGroup)

	// A second task on the same source makes no second bind.
	binds := len(f.GetActions())
	must.NoError(t, s.acquire([]string{src}))
	must.Eq(t, binds, len(f.GetActions()))

	s.release([]string{src})
	must.True(t, isMounted(f, src))
	s.release([]string{src})
	must.False(t, isMounted(f, src))

	// A restarted driver knows the self-bind is its own from the record.
	must.NoError(t, s.acquire([]string{src}))
	s2 := newSharedSources(hclog.NewNullLogger(), f, state)
	s2.adopt([]string{src})
	s2.release([]string{src})
	must.False(t, isMounted(f, src))
}

func TestSharedSources_keepsMountPointWithSubmounts(t *testing.T) {
	root := t.TempDir()
	src := filepath.Join(root, "src")
	must.NoError(t, mkdirs(src))
	f := mounter.NewFake(mounter.MountPoint{Path: "/", Shared: true, PeerGroup: 1})
	s := newSharedSources(hclog.NewNullLogger(), f, filepath.Join(root, "state.json"))
	must.NoError(t, s.acquire([]string{src}))
	must.NoError(t, f.Mount("tmpfs", filepath.Join(src, "vol"), "tmpfs", 0, ""))
	s.release([]string{src})
	must.True(t, isMounted(f, src))
}

func TestSharedSources_leavesOthersMountsAlone(t *testing.T) {
	root := t.TempDir()
	src := filepath.Join(root, "src")
	must.NoError(t, mkdirs(src))
	f := mounter.NewFake(
		mounter.MountPoint{Path: "/", Shared: true, PeerGroup: 1},
		mounter.MountPoint{Path: src, Shared: true, PeerGroup: 7},
	)
	s := newSharedSources(hclog.NewNullLogger(), f, filepath.Join(root, "state.json"))
	must.NoError(t, s.acquire([]string{src}))
	s.release([]string{src})
	must.True(t, isMounted(f, src))
	for _, a := range f.GetActions() {
		must.NotEq(t, mounter.ActionBindMount, a.Kind)
		must.NotEq(t, mounter.ActionUnmount, a.Kind)
	}
}

func TestSharedSources_errorsTakeNothing(t *testing.T) {
	root := t.TempDir()
	good := filepath.Join(root, "good")
	bad := filepath.Join(root, "bad")
	must.NoError(t, mkdirs(good, bad))
	f := mounter.NewFake(mounter.MountPoint{Path: "/", Shared: true, PeerGroup: 1})
	f.MountErrs = map[string]error{bad: errors.New("permission denied")}
	s := newSharedSources(hclog.NewNullLogger(), f, filepath.Join(root, "state.json"))

	err := s.acquire([]string{good, bad})
	must.ErrorContains(t, err, "permission denied")
	must.False(t, isMounted(f, good))
	must.MapEmpty(t, s.refs)

	err = s.acquire([]string{filepath.Join(root, "missing")})
	must.ErrorContains(t, err, "bidirectional mount source")
}

func mkdirs(paths ...string) error {
	for _, p := range paths {
		if err := os.MkdirAll(p, 0o755); err != nil {
			return err
		}
	}
	return nil
}

// Two DestroyTask calls for one task at once (Nomad can make them) release
// its shared mount points once: another task using the same source keeps it.
func TestDestroyTask_concurrentReleasesOnce(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	fake := d.mounter.(*mounter.Fake)
	src := filepath.Join(shortTempDir(t), "src")
	must.NoError(t, mkdirs(src))
	mk := func(id string) *drivers.TaskConfig {
		cfg := taskConfig(t, TaskConfig{Command: "/bin/sleep", Privileged: true})
		cfg.ID = id
		cfg.Mounts = []*drivers.MountConfig{{TaskPath: "/bidi", HostPath: src, PropagationMode: "bidirectional"}}
		return cfg
	}
	a, b := mk("alloc/a/1"), mk("alloc/b/1")
	_, _, err := d.StartTask(a)
	must.NoError(t, err)
	_, _, err = d.StartTask(b)
	must.NoError(t, err)
	must.True(t, isMounted(fake, src))

	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := d.DestroyTask(a.ID, true); err != nil && !errors.Is(err, drivers.ErrTaskNotFound) {
				t.Errorf("destroy: %v", err)
			}
		}()
	}
	wg.Wait()
	must.True(t, isMounted(fake, src), must.Sprint("task b still uses the shared mount point"))
	must.NoError(t, d.DestroyTask(b.ID, true))
	must.False(t, isMounted(fake, src))
}
