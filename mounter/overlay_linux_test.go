package mounter

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// overlayLayers makes three layers in overlay's own format under dir: a
// base with files, a middle one that deletes base/gone (a 0/0 whiteout) and
// makes opaque/ opaque, and a top one that changes a file. It returns the
// layers lowest first, and the upper and work directories.
func overlayLayers(t *testing.T, dir string) (Overlay, string) {
	t.Helper()
	mk := func(p string, content string) {
		must.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		must.NoError(t, os.WriteFile(p, []byte(content), 0o644))
	}
	base, mid, top := filepath.Join(dir, "l0"), filepath.Join(dir, "l1"), filepath.Join(dir, "l2")
	mk(filepath.Join(base, "etc/name"), "base")
	mk(filepath.Join(base, "gone"), "x")
	mk(filepath.Join(base, "opaque/old"), "x")
	mk(filepath.Join(base, "suid"), "#!/bin/sh\n")
	must.NoError(t, os.Chmod(filepath.Join(base, "suid"), 0o4755))
	must.NoError(t, os.MkdirAll(mid, 0o755))
	must.NoError(t, unix.Mknod(filepath.Join(mid, "gone"), unix.S_IFCHR, 0))
	must.NoError(t, os.MkdirAll(filepath.Join(mid, "opaque"), 0o755))
	must.NoError(t, unix.Setxattr(filepath.Join(mid, "opaque"), "trusted.overlay.opaque", []byte("y"), 0))
	mk(filepath.Join(mid, "opaque/new"), "x")
	mk(filepath.Join(top, "etc/name"), "top")
	upper, work, target := filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "root")
	for _, d := range []string{upper, work, target} {
		must.NoError(t, os.Mkdir(d, 0o755))
	}
	return Overlay{Lower: []string{base, mid, top}, Upper: upper, Work: work}, target
}

// checkMerged checks the merged view of overlayLayers at target.
func checkMerged(t *testing.T, target string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(target, "etc/name"))
	must.NoError(t, err)
	must.Eq(t, "top", string(b))
	_, err = os.Lstat(filepath.Join(target, "gone"))
	must.True(t, os.IsNotExist(err), must.Sprintf("a whiteout must hide base/gone: %v", err))
	entries, err := os.ReadDir(filepath.Join(target, "opaque"))
	must.NoError(t, err)
	must.Len(t, 1, entries)
	must.Eq(t, "new", entries[0].Name())
	// Written to the upper layer, never to a lower one.
	must.NoError(t, os.WriteFile(filepath.Join(target, "etc/name"), []byte("task"), 0o644))
}

func TestMountOverlay(t *testing.T) {
	requireRoot(t)
	for _, legacy := range []bool{false, true} {
		t.Run(fmt.Sprintf("legacy=%v", legacy), func(t *testing.T) {
			dir := privateDir(t)
			o, target := overlayLayers(t, dir)
			o.NoSuid, o.NoDev = true, true
			cleanupMount(t, target)
			if legacy {
				must.NoError(t, mountOverlayLegacy(target, o, legacyDataMax))
			} else {
				must.NoError(t, New().MountOverlay(target, o))
			}
			checkMerged(t, target)
			b, err := os.ReadFile(filepath.Join(o.Lower[2], "etc/name"))
			must.NoError(t, err)
			must.Eq(t, "top", string(b), must.Sprint("the top lower layer must not change"))
			b, err = os.ReadFile(filepath.Join(o.Upper, "etc/name"))
			must.NoError(t, err)
			must.Eq(t, "task", string(b))
			var st unix.Statfs_t
			must.NoError(t, unix.Statfs(target, &st))
			must.Eq(t, int64(unix.ST_NOSUID|unix.ST_NODEV), st.Flags&(unix.ST_NOSUID|unix.ST_NODEV))
			mp, ok := mountAt(t, New(), target)
			must.True(t, ok)
			must.Eq(t, "overlay", mp.FSType)
		})
	}
}

// TestMountOverlay_ManyLayers mounts an overlay of more layers with longer
// paths than mount(2)'s one page of options can name: through lowerdir+
// where the kernel has it, and by descriptor on the legacy path (forced
// here, as on a kernel before 6.8).
func TestMountOverlay_ManyLayers(t *testing.T) {
	requireRoot(t)
	for _, legacy := range []bool{false, true} {
		t.Run(fmt.Sprintf("legacy=%v", legacy), func(t *testing.T) {
			dir := privateDir(t)
			long := filepath.Join(dir, strings.Repeat("d", 100))
			var o Overlay
			for i := range 120 {
				l := filepath.Join(long, fmt.Sprintf("layer-%03d", i))
				must.NoError(t, os.MkdirAll(l, 0o755))
				must.NoError(t, os.WriteFile(filepath.Join(l, fmt.Sprintf("f%03d", i)), nil, 0o644))
				must.NoError(t, os.WriteFile(filepath.Join(l, "top"), []byte(fmt.Sprint(i)), 0o644))
				o.Lower = append(o.Lower, l)
			}
			must.Greater(t, legacyDataMax, len(overlayData(o, o.Lower)))
			o.Upper, o.Work = filepath.Join(dir, "upper"), filepath.Join(dir, "work")
			target := filepath.Join(dir, "root")
			for _, d := range []string{o.Upper, o.Work, target} {
				must.NoError(t, os.Mkdir(d, 0o755))
			}
			cleanupMount(t, target)
			if legacy {
				// The descriptor path changes the working directory of the
				// calling thread: one of its own, thrown away after.
				errc := make(chan error, 1)
				go func() {
					runtime.LockOSThread()
					if err := unix.Unshare(unix.CLONE_FS); err != nil {
						errc <- err
						return
					}
					errc <- mountOverlayLegacy(target, o, legacyDataMax)
				}()
				must.NoError(t, <-errc)
			} else {
				err := mountOverlayFS(target, o)
				if err == errNoLowerdirPlus {
					t.Skip("the kernel has no lowerdir+ (Linux 6.8)")
				}
				must.NoError(t, err)
			}
			entries, err := os.ReadDir(target)
			must.NoError(t, err)
			must.Len(t, 121, entries)
			b, err := os.ReadFile(filepath.Join(target, "top"))
			must.NoError(t, err)
			must.Eq(t, "119", string(b), must.Sprint("the last layer given is the top one"))
		})
	}
}

func TestMountOverlay_Refuses(t *testing.T) {
	cases := map[string]Overlay{
		"no lower":       {Upper: "/u", Work: "/w"},
		"no upper":       {Lower: []string{"/l"}, Work: "/w"},
		"relative":       {Lower: []string{"l"}, Upper: "/u", Work: "/w"},
		"colon in layer": {Lower: []string{"/l:x"}, Upper: "/u", Work: "/w"},
		"comma in upper": {Lower: []string{"/l"}, Upper: "/u,lowerdir=/", Work: "/w"},
	}
	for name, o := range cases {
		t.Run(name, func(t *testing.T) {
			must.Error(t, New().MountOverlay("/nonexistent", o))
			must.Error(t, NewFake().MountOverlay("/nonexistent", o))
		})
	}
}
