package image

import (
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// layerEntries lists a layer's entries as "d /path 755" and "f /path 644"
// (a file's size too when it is not empty).
func layerEntries(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	must.NoError(t, filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		fi, err := e.Info()
		if err != nil {
			return err
		}
		kind := "f"
		switch {
		case fi.IsDir():
			kind = "d"
		case !fi.Mode().IsRegular():
			kind = "?"
		case fi.Size() != 0:
			kind = "f!"
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		out = append(out, kind+" /"+rel+" "+fi.Mode().Perm().String())
		return nil
	}))
	return out
}

// A mount-point layer has each target and its parents, nothing else,
// directories 0755 and files empty 0644; the same targets in any order, or
// repeated, are the same layer, made once and never changed after, and
// not removed by GC. The
// modes are the same under a driver's umask of 077.
func TestMountLayer(t *testing.T) {
	mask := unix.Umask(0o077)
	t.Cleanup(func() { unix.Umask(mask) })
	s, err := Open(t.TempDir(), Options{})
	must.NoError(t, err)
	points := []MountPoint{
		{Path: "/alloc", Dir: true}, {Path: "/etc/resolv.conf"}, {Path: "/var/lib/csi/mnt", Dir: true},
		{Path: "/csi", Dir: true}, {Path: "/alloc", Dir: true},
	}
	layer, err := s.MountLayer(points)
	must.NoError(t, err)
	must.Eq(t, filepath.Join(s.Path(), mountPointsDir), filepath.Dir(layer))
	must.Eq(t, []string{
		"d /alloc -rwxr-xr-x",
		"d /csi -rwxr-xr-x",
		"d /etc -rwxr-xr-x",
		"f /etc/resolv.conf -rw-r--r--",
		"d /var -rwxr-xr-x",
		"d /var/lib -rwxr-xr-x",
		"d /var/lib/csi -rwxr-xr-x",
		"d /var/lib/csi/mnt -rwxr-xr-x",
	}, layerEntries(t, layer))
	before, err := os.Stat(layer)
	must.NoError(t, err)

	reversed := slices.Clone(points)
	slices.Reverse(reversed)
	again, err := s.MountLayer(reversed)
	must.NoError(t, err)
	must.Eq(t, layer, again)
	after, err := os.Stat(layer)
	must.NoError(t, err)
	must.True(t, os.SameFile(before, after))
	must.Eq(t, before.ModTime(), after.ModTime())

	// Other targets, another layer; a directory's target and a file's at
	// one path are two targets.
	other, err := s.MountLayer([]MountPoint{{Path: "/alloc", Dir: true}})
	must.NoError(t, err)
	must.NotEq(t, layer, other)
	file, err := s.MountLayer([]MountPoint{{Path: "/alloc"}})
	must.NoError(t, err)
	must.NotEq(t, other, file)
	must.Eq(t, []string{"f /alloc -rw-r--r--"}, layerEntries(t, file))

	// They are not images: GC leaves them.
	_, err = s.GC(0, func(Use) bool { return false })
	must.NoError(t, err)
	_, err = os.Stat(layer)
	must.NoError(t, err)

	// Nothing to make: no layer.
	none, err := s.MountLayer(nil)
	must.NoError(t, err)
	must.Eq(t, "", none)
}

// Targets a layer cannot hold are refused, naming the target, and leave
// nothing in the store.
func TestMountLayer_Refused(t *testing.T) {
	s, err := Open(t.TempDir(), Options{})
	must.NoError(t, err)
	long := "/" + string(make([]byte, maxMountPath))
	for _, tc := range []struct {
		points []MountPoint
		err    string
	}{
		{[]MountPoint{{Path: "alloc", Dir: true}}, `mount target "alloc": want a clean absolute path`},
		{[]MountPoint{{Path: "/", Dir: true}}, `mount target "/": want a clean absolute path`},
		{[]MountPoint{{Path: "/a/../../etc", Dir: true}}, `mount target "/a/../../etc": want a clean absolute path`},
		{[]MountPoint{{Path: "/a//b", Dir: true}}, `want a clean absolute path`},
		{[]MountPoint{{Path: long, Dir: true}}, `want a clean absolute path below / of at most 1024 bytes`},
		{[]MountPoint{{Path: "/etc/hosts"}, {Path: "/etc/hosts/x", Dir: true}}, `mount target "/etc/hosts/x" is inside "/etc/hosts", a file's target`},
		{[]MountPoint{{Path: "/x"}, {Path: "/x", Dir: true}}, `mount target "/x" is both a file's and a directory's`},
		// A name with a newline could pass for two entries of another
		// list: no control character is taken.
		{[]MountPoint{{Path: "/alloc\nd/local", Dir: true}}, `mount target "/alloc\nd/local": a mount-point layer takes no control characters`},
		{[]MountPoint{{Path: "/a\x7fb", Dir: true}}, `takes no control characters`},
		{[]MountPoint{{Path: "/" + strings.Repeat("d/", maxMountEntries) + "x", Dir: true}}, "at most 64 entries, and these targets need 65"},
	} {
		_, err := s.MountLayer(tc.points)
		must.ErrorContains(t, err, tc.err)
	}
	entries, err := os.ReadDir(filepath.Join(s.Path(), mountPointsDir))
	if !os.IsNotExist(err) {
		must.NoError(t, err)
		must.SliceEmpty(t, entries)
	}
}

// Past maxMountLayers the store makes no more (the tasks go without one,
// and the error says why) but still serves those it has; a half-made layer a killed driver left is
// removed once it is stale, and never served.
func TestMountLayer_Bounded(t *testing.T) {
	old := maxMountLayers
	maxMountLayers = 2
	t.Cleanup(func() { maxMountLayers = old })
	s, err := Open(t.TempDir(), Options{})
	must.NoError(t, err)
	dir := filepath.Join(s.Path(), mountPointsDir)
	must.NoError(t, os.MkdirAll(dir, 0o700))
	stale, fresh := filepath.Join(dir, ".tmp-stale"), filepath.Join(dir, ".tmp-fresh")
	for _, p := range []string{stale, fresh} {
		must.NoError(t, os.MkdirAll(filepath.Join(p, "alloc"), 0o755))
	}
	old2 := time.Now().Add(-2 * staleMountLayerTmp)
	must.NoError(t, os.Chtimes(stale, old2, old2))

	a, err := s.MountLayer([]MountPoint{{Path: "/a", Dir: true}})
	must.NoError(t, err)
	must.NotEq(t, "", a)
	_, err = os.Stat(stale)
	must.True(t, os.IsNotExist(err), must.Sprint("a stale half-made layer was kept"))
	_, err = os.Stat(fresh)
	must.NoError(t, err, must.Sprint("a half-made layer another start may still be making was removed"))

	b, err := s.MountLayer([]MountPoint{{Path: "/b", Dir: true}})
	must.NoError(t, err)
	must.NotEq(t, "", b)
	c, err := s.MountLayer([]MountPoint{{Path: "/c", Dir: true}})
	must.ErrorIs(t, err, ErrMountLayersFull)
	must.Eq(t, "", c)
	again, err := s.MountLayer([]MountPoint{{Path: "/a", Dir: true}})
	must.NoError(t, err)
	must.Eq(t, a, again)
}
