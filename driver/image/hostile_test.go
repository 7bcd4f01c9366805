package image

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// Layers and images a hostile job author or registry would serve, beyond
// TestCraftedLayers: each is refused or contained, and leaves the store as
// it was.

// Entries that try to leave the layer's root by a longer way than
// TestCraftedLayers' are refused; those that only look odd stay inside.
func TestHostileLayerEntries(t *testing.T) {
	f := newFixture(t)
	outside := t.TempDir()
	victim := filepath.Join(outside, "victim")
	must.NoError(t, os.WriteFile(victim, []byte("host"), 0o644))
	refused := map[string][]imagebuild.Entry{
		// A hard link to a symlink is the symlink: nothing goes through
		// it.
		"hardlink to symlink then file": {imagebuild.Symlink("s", outside), imagebuild.Hardlink("h", "s"),
			imagebuild.File("h/victim", []byte("pwned"), 0o644)},
		"hardlink to symlink then dir": {imagebuild.Symlink("s", outside), imagebuild.Hardlink("h", "s"),
			imagebuild.Dir("h/new", 0o755)},
		"whiteout through symlink chain": {imagebuild.Symlink("a", "b"), imagebuild.Symlink("b", outside),
			imagebuild.Whiteout("a/victim")},
		"whiteout of dotdot":   {imagebuild.File(".wh...", nil, 0o644)},
		"whiteout in dotdot":   {imagebuild.File("../.wh.victim", nil, 0o644)},
		"opaque above root":    {imagebuild.File("../.wh..wh..opq", nil, 0o644)},
		"hardlink to the root": {imagebuild.Hardlink("h", "./")},
	}
	for name, entries := range refused {
		t.Run(name, func(t *testing.T) {
			ref := f.layout(t, strings.ReplaceAll(name, " ", "-"), "1", mustImage(t, imagebuild.Spec{}, mustLayer(t, entries...)))
			_, err := f.store.Pull(context.Background(), ref, PullRequest{})
			must.ErrorIs(t, err, ErrUnsafeLayer)
			b, err := os.ReadFile(victim)
			must.NoError(t, err)
			must.Eq(t, "host", string(b))
			names, err := os.ReadDir(outside)
			must.NoError(t, err)
			must.SliceLen(t, 1, names)
			assertEmpty(t, f.store)
		})
	}

	// A symlink that a later entry replaces by a directory: the file
	// goes into that directory, in the layer.
	ref := f.layout(t, "symlink-then-dir", "1", mustImage(t, imagebuild.Spec{}, mustLayer(t,
		imagebuild.Symlink("d", outside),
		imagebuild.Dir("d", 0o755),
		imagebuild.File("d/victim", []byte("inside"), 0o644),
		// The opaque marker at the top marks the layer's root only.
		imagebuild.Opaque(""),
	)))
	img, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	b, err := os.ReadFile(filepath.Join(img.Layers[0], "d", "victim"))
	must.NoError(t, err)
	must.Eq(t, "inside", string(b))
	b, err = os.ReadFile(victim)
	must.NoError(t, err)
	must.Eq(t, "host", string(b))
	v := make([]byte, 8)
	n, err := unix.Getxattr(img.Layers[0], opaqueXattr, v)
	must.NoError(t, err)
	must.Eq(t, "y", string(v[:n]))
	for _, dir := range []string{filepath.Dir(img.Layers[0]), filepath.Join(f.store.Path(), "layers"), f.store.Path()} {
		_, err = unix.Getxattr(dir, opaqueXattr, v)
		must.ErrorIs(t, err, unix.ENODATA, must.Sprint(dir))
	}
}

// Only file capabilities, user attributes that are not overlay's and ACLs
// are written: overlay reads user.overlay.* as its own on a mount with
// userxattr, as it reads trusted.overlay.* on every other; other security.*
// attributes are another host's policy.
func TestHostileXattrsAreDropped(t *testing.T) {
	f := newFixture(t)
	dropped := []string{
		"trusted.overlay.redirect", "trusted.overlay.metacopy", "trusted.overlay.origin", "trusted.overlay.opaque",
		"trusted.overlay.whiteout", "trusted.other",
		"user.overlay.redirect", "user.overlay.opaque", "user.overlay.metacopy", "user.overlay.whiteout",
		"security.selinux", "security.ima", "security.evm", "security.SMACK64",
	}
	kept := map[string]string{"security.capability": capV2, "user.mime_type": "text/plain"}
	e := imagebuild.File("f", []byte("x"), 0o755)
	for _, name := range dropped {
		e = withXattr(e, name, "y")
	}
	for name, value := range kept {
		e = withXattr(e, name, value)
	}
	d := withXattr(imagebuild.Dir("d", 0o755), "user.overlay.opaque", "y")
	ref := f.layout(t, "xattrs", "1", mustImage(t, imagebuild.Spec{}, mustLayer(t, e, d)))
	img, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	file := filepath.Join(img.Layers[0], "f")
	buf := make([]byte, 256)
	for _, name := range dropped {
		_, err := unix.Getxattr(file, name, buf)
		must.ErrorIs(t, err, unix.ENODATA, must.Sprint(name))
	}
	_, err = unix.Getxattr(filepath.Join(img.Layers[0], "d"), "user.overlay.opaque", buf)
	must.ErrorIs(t, err, unix.ENODATA)
	for name, value := range kept {
		n, err := unix.Getxattr(file, name, buf)
		must.NoError(t, err, must.Sprint(name))
		must.Eq(t, value, string(buf[:n]))
	}
}

// A manifest that names one layer twice pulls without waiting on itself;
// one copy of the layer is stored.
func TestSameLayerTwice(t *testing.T) {
	f := newFixture(t)
	l := baseLayer(t)
	ref := f.layout(t, "twice", "1", mustImage(t, imagebuild.Spec{}, l, l, l))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	img, err := f.store.Pull(ctx, ref, PullRequest{})
	must.NoError(t, err)
	must.SliceLen(t, 3, img.Layers)
	must.Eq(t, img.Layers[0], img.Layers[2])
	entries, err := os.ReadDir(filepath.Join(f.store.Path(), "layers"))
	must.NoError(t, err)
	must.SliceLen(t, 1, entries)
	assertTmpClean(t, f.store)
}
