package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// JSON output escapes what encoding/json lets through: C1 controls (U+009B
// is an 8-bit CSI to some terminals), bidi overrides, invisible runes
// beyond the BMP; and the strings decode back unchanged.
func TestWriteJSON_escapesInvisibleRunes(t *testing.T) {
	in := map[string]string{"task_id": "x\u009b2J\u202eevil\u0085\U000e0041\x1b[0m", "plain": "ok é 名"}
	var out bytes.Buffer
	e := &env{out: &out, json: true}
	must.NoError(t, e.writeJSON(in))
	s := out.String()
	for _, r := range []string{"\u009b", "\u202e", "\u0085", "\U000e0041", "\x1b"} {
		must.StrNotContains(t, s, r, must.Sprintf("raw %q in %q", r, s))
	}
	must.StrContains(t, s, "ok é 名")
	var back map[string]string
	must.NoError(t, json.Unmarshal(out.Bytes(), &back))
	must.Eq(t, in, back)
}

// The driver records paths under root_dir as configured; the mount table
// holds real paths. Whichever -root-dir names (the symlink the driver was
// configured with or its target), the journaled mounts are not orphans and
// a mount no record names is one.
func TestFindOrphans_rootDirThroughASymlink(t *testing.T) {
	base := shortDir(t)
	realRoot := filepath.Join(base, "real")
	must.NoError(t, os.MkdirAll(realRoot, 0o700))
	link := filepath.Join(base, "link")
	must.NoError(t, os.Symlink(realRoot, link))
	m := writeJournal(t, link, map[string][]string{"alloc1/web/1": {"vol1"}})
	staging, target := m.StagingPath("p", "vol1"), m.TargetPath("alloc1/web/1", "data")
	m.Close()
	realOf := func(p string) string { return realRoot + strings.TrimPrefix(p, link) }
	orphan := filepath.Join(driver.StageRoot(realRoot), "publish", "gone", "data")
	fake := mounter.NewFake(
		mounter.MountPoint{ID: 1, Path: realOf(staging)},
		mounter.MountPoint{ID: 2, Path: realOf(target)},
		mounter.MountPoint{ID: 3, Path: orphan},
	)
	for _, rd := range []string{link, realRoot} {
		var v cleanupView
		must.NoError(t, findOrphans(rd, fake, &v), must.Sprint(rd))
		must.Eq(t, []string{orphan}, v.OrphanMounts, must.Sprintf("-root-dir %s", rd))
	}
}

// Records of the file-per-record format are records to the driver (it
// moves them into the log at its next start): while one is there, cleanup
// calls nothing an orphan.
func TestFindOrphans_refusesBesideRecordFiles(t *testing.T) {
	root := shortDir(t)
	jdir := driver.JournalDir(root)
	must.NoError(t, os.MkdirAll(jdir, 0o700))
	name := "t-" + csihook.ShortHash("alloc1/web/1") + "-" + csihook.ShortHash("data") + ".json"
	must.NoError(t, os.WriteFile(filepath.Join(jdir, name), []byte(`{}`), 0o600))
	staging := filepath.Join(driver.StageRoot(root), "staging", "p", csihook.ShortHash("vol1"))
	var v cleanupView
	err := findOrphans(root, mounter.NewFake(mounter.MountPoint{ID: 1, Path: staging}), &v)
	must.ErrorContains(t, err, "one-file-per-record format ("+name+")")
	must.SliceEmpty(t, v.OrphanMounts)
	code, _, stderr := runCLI("cleanup", "-root-dir", root)
	must.Eq(t, 1, code)
	must.StrContains(t, stderr, "start the driver once")
}

// -apply unmounts each orphan by the mount ID it listed: a path that now
// leads to another mount is left alone and reported.
func TestCleanupApply_onlyTheListedMount(t *testing.T) {
	root := shortDir(t)
	publish := filepath.Join(driver.StageRoot(root), "publish")
	a, b := filepath.Join(publish, "a", "data"), filepath.Join(publish, "b", "data")
	fake := mounter.NewFake(mounter.MountPoint{ID: 10, Path: a}, mounter.MountPoint{ID: 11, Path: b})
	var v cleanupView
	must.NoError(t, findOrphans(root, fake, &v))
	must.Eq(t, []string{a, b}, v.OrphanMounts)
	// b is replaced after the listing.
	fake.MountPoints[1].ID = 99
	applyOrphans(fake, &v)
	must.Eq(t, []string{a}, v.Unmounted)
	must.MapContainsKey(t, v.Failed, b)
	must.StrContains(t, v.Failed[b], "no longer the mount point of mount 11")
	must.Eq(t, []mounter.MountPoint{{ID: 99, Path: b}}, fake.MountPoints)
}

// -apply takes the journal's lock even when no driver ever made it, so a
// driver starting meanwhile waits rather than reusing a mount cleanup is
// about to unmount; a root_dir that is not there is left so.
func TestLockJournal_makesTheLock(t *testing.T) {
	root := shortDir(t)
	jdir := driver.JournalDir(root)
	unlock, err := lockJournal(jdir)
	must.NoError(t, err)
	fi, err := os.Stat(filepath.Join(jdir, ".lock"))
	must.NoError(t, err)
	must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())
	_, err = lockJournal(jdir)
	must.ErrorIs(t, err, errDriverRunning)
	unlock()
	unlock2, err := lockJournal(jdir)
	must.NoError(t, err)
	unlock2()

	gone := filepath.Join(root, "missing")
	unlock3, err := lockJournal(driver.JournalDir(gone))
	must.NoError(t, err)
	unlock3()
	_, err = os.Stat(gone)
	must.ErrorIs(t, err, os.ErrNotExist)
}
