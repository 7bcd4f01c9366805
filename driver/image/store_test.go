package image

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/compression"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// These tests unpack real layers into a real store: owners, device nodes
// and trusted.* xattrs need root.
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the store sets owners, makes device nodes and trusted.* xattrs")
	}
}

type fixture struct {
	root   string // root_dir
	images string // the local_image_dirs directory
	store  *Store
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	needRoot(t)
	base := t.TempDir()
	f := &fixture{root: filepath.Join(base, "root"), images: filepath.Join(base, "images")}
	must.NoError(t, os.MkdirAll(f.images, 0o755))
	var err error
	f.store, err = Open(f.root, Options{LocalDirs: []string{f.images}})
	must.NoError(t, err)
	f.store.retryBase = time.Millisecond
	return f
}

func mustLayer(t testing.TB, entries ...imagebuild.Entry) v1.Layer {
	t.Helper()
	l, err := imagebuild.Layer(entries...)
	must.NoError(t, err)
	return l
}

func mustImage(t testing.TB, spec imagebuild.Spec, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := imagebuild.Build(spec, layers...)
	must.NoError(t, err)
	return img
}

// layout writes img into a layout directory named dir under the fixture's
// local_image_dirs and returns the reference to it.
func (f *fixture) layout(t *testing.T, dir, tag string, img any) string {
	t.Helper()
	must.NoError(t, imagebuild.WriteLayout(filepath.Join(f.images, dir), tag, img))
	ref := "oci:" + filepath.Join(f.images, dir)
	if tag != "" {
		ref += ":" + tag
	}
	return ref
}

func withXattr(e imagebuild.Entry, name, value string) imagebuild.Entry {
	if e.Header.PAXRecords == nil {
		e.Header.PAXRecords = map[string]string{}
	}
	e.Header.PAXRecords["SCHILY.xattr."+name] = value
	return e
}

func baseLayer(t testing.TB) v1.Layer {
	return mustLayer(t,
		imagebuild.Dir("etc", 0o755),
		imagebuild.File("etc/os-release", []byte("ID=test\n"), 0o644),
		imagebuild.Dir("opt/data", 0o755),
		imagebuild.File("opt/data/old", []byte("old"), 0o644),
		imagebuild.File("etc/gone", []byte("gone"), 0o644),
	)
}

// capV2 is a security.capability value (VFS_CAP_REVISION_2) granting
// CAP_NET_BIND_SERVICE, effective.
var capV2 = string([]byte{0x01, 0x00, 0x00, 0x02, 0x00, 0x04, 0x00, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})

func TestPullOCILayout(t *testing.T) {
	f := newFixture(t)
	suid := imagebuild.File("usr/bin/tool", []byte("#!/bin/sh\n"), 0o4755)
	suid.Header.Uid, suid.Header.Gid = 0, 0
	owned := imagebuild.File("home/app/note", []byte("note"), 0o640)
	owned.Header.Uid, owned.Header.Gid = 1000, 1001
	owned.Header.ModTime = time.Unix(1600000000, 0)
	top := mustLayer(t,
		suid,
		withXattr(imagebuild.File("usr/bin/ping", []byte("ping"), 0o755), "security.capability", capV2),
		withXattr(imagebuild.File("usr/bin/steer", []byte("x"), 0o755), "trusted.overlay.redirect", "/etc"),
		owned,
		imagebuild.Whiteout("etc/gone"),
		imagebuild.Opaque("opt/data"),
		imagebuild.File("opt/data/new", []byte("new"), 0o644),
		imagebuild.Symlink("usr/bin/sh", "/bin/busybox"),
		imagebuild.Hardlink("usr/bin/tool2", "usr/bin/tool"),
		imagebuild.CharDevice("dev/null", 1, 3),
	)
	spec := imagebuild.Spec{Entrypoint: []string{"/usr/bin/tool"}, Cmd: []string{"-v"}, Env: []string{"A=1"}, WorkingDir: "/opt", User: "1000:1001"}
	ref := f.layout(t, "app", "1.0", mustImage(t, spec, baseLayer(t), top))

	var events []Progress
	img, err := f.store.Pull(context.Background(), ref, PullRequest{Progress: func(p Progress) { events = append(events, p) }})
	must.NoError(t, err)
	must.Eq(t, ref, img.Ref)
	must.StrHasPrefix(t, "sha256:", img.Digest)
	must.Eq(t, "", img.IndexDigest)
	must.Eq(t, Config{Entrypoint: spec.Entrypoint, Cmd: spec.Cmd, Env: spec.Env, WorkingDir: "/opt", User: "1000:1001"}, img.Config)
	must.SliceLen(t, 2, img.Layers)
	must.NotEq(t, img.Layers[0], img.Layers[1])
	must.SliceNotEmpty(t, events)

	lower, upper := img.Layers[0], img.Layers[1]
	b, err := os.ReadFile(filepath.Join(lower, "etc/os-release"))
	must.NoError(t, err)
	must.Eq(t, "ID=test\n", string(b))

	var st unix.Stat_t
	// The whiteout: a 0/0 character device owned by root.
	must.NoError(t, unix.Lstat(filepath.Join(upper, "etc/gone"), &st))
	must.Eq(t, uint32(unix.S_IFCHR), st.Mode&unix.S_IFMT)
	must.Eq(t, uint64(0), st.Rdev)
	must.Eq(t, uint32(0), st.Uid)
	// The opaque directory, in overlay's form.
	v := make([]byte, 8)
	n, err := unix.Getxattr(filepath.Join(upper, "opt/data"), "trusted.overlay.opaque", v)
	must.NoError(t, err)
	must.Eq(t, "y", string(v[:n]))
	_, err = os.Stat(filepath.Join(upper, "opt/data/.wh..wh..opq"))
	must.ErrorIs(t, err, os.ErrNotExist)
	// setuid, owners, modes, times.
	must.NoError(t, unix.Lstat(filepath.Join(upper, "usr/bin/tool"), &st))
	must.Eq(t, uint32(0o4755), st.Mode&0o7777)
	must.NoError(t, unix.Lstat(filepath.Join(upper, "home/app/note"), &st))
	must.Eq(t, uint32(1000), st.Uid)
	must.Eq(t, uint32(1001), st.Gid)
	must.Eq(t, uint32(0o640), st.Mode&0o7777)
	must.Eq(t, int64(1600000000), st.Mtim.Sec)
	// File capabilities are kept; overlay's own xattrs are not.
	n, err = unix.Getxattr(filepath.Join(upper, "usr/bin/ping"), "security.capability", make([]byte, 64))
	must.NoError(t, err)
	must.Eq(t, len(capV2), n)
	_, err = unix.Getxattr(filepath.Join(upper, "usr/bin/steer"), "trusted.overlay.redirect", make([]byte, 64))
	must.ErrorIs(t, err, unix.ENODATA)
	// A symlink keeps its target as written; a hard link is one file.
	target, err := os.Readlink(filepath.Join(upper, "usr/bin/sh"))
	must.NoError(t, err)
	must.Eq(t, "/bin/busybox", target)
	var st2 unix.Stat_t
	must.NoError(t, unix.Lstat(filepath.Join(upper, "usr/bin/tool2"), &st2))
	must.NoError(t, unix.Lstat(filepath.Join(upper, "usr/bin/tool"), &st))
	must.Eq(t, st.Ino, st2.Ino)
	// A device node as the image has it.
	must.NoError(t, unix.Lstat(filepath.Join(upper, "dev/null"), &st))
	must.Eq(t, unix.Mkdev(1, 3), st.Rdev)

	// Pulled again: present, nothing downloaded.
	var again []Progress
	img2, err := f.store.Pull(context.Background(), ref, PullRequest{Progress: func(p Progress) { again = append(again, p) }})
	must.NoError(t, err)
	must.Eq(t, img.Digest, img2.Digest)
	must.Eq(t, []Progress{{Ref: ref, Present: true}}, again)
	list, err := f.store.List(nil)
	must.NoError(t, err)
	must.SliceLen(t, 1, list)
	must.Eq(t, []string{ref}, list[0].Refs)
	must.Positive(t, list[0].Size)
	// Nothing is left in tmp/ but the layers' lock files.
	assertTmpClean(t, f.store)
}

// assertTmpClean checks that tmp/ holds nothing but lock files.
func assertTmpClean(t *testing.T, s *Store) {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(s.Path(), "tmp"))
	must.NoError(t, err)
	for _, e := range entries {
		must.StrHasSuffix(t, ".lock", e.Name())
	}
}

// assertEmpty checks that the store has no image, layer or lease.
func assertEmpty(t *testing.T, s *Store) {
	t.Helper()
	for _, d := range []string{"manifests", "layers", "configs", "uses"} {
		entries, err := os.ReadDir(filepath.Join(s.Path(), d))
		must.NoError(t, err)
		must.SliceEmpty(t, entries, must.Sprintf("%s/ is not empty", d))
	}
	assertTmpClean(t, s)
}

func TestPullArchives(t *testing.T) {
	f := newFixture(t)
	img := mustImage(t, imagebuild.Spec{Cmd: []string{"/bin/true"}}, baseLayer(t), mustLayer(t, imagebuild.File("bin/true", []byte("t"), 0o755)))
	oa := filepath.Join(f.images, "app.oci.tar")
	must.NoError(t, imagebuild.WriteOCIArchive(oa, "v1", img))
	da := filepath.Join(f.images, "app.docker.tar")
	must.NoError(t, imagebuild.WriteDockerArchive(da, "example/app:v1", img))

	want, err := img.Digest()
	must.NoError(t, err)
	got, err := f.store.Pull(context.Background(), "oci-archive:"+oa+":v1", PullRequest{})
	must.NoError(t, err)
	must.Eq(t, want.String(), got.Digest)
	must.Eq(t, []string{"/bin/true"}, got.Config.Cmd)

	// The docker archive has no manifest of its own: the store makes one,
	// and shares the layers (same diff ids) with the image above.
	dimg, err := f.store.Pull(context.Background(), "docker-archive:"+da, PullRequest{})
	must.NoError(t, err)
	must.Eq(t, got.Layers, dimg.Layers)
	b, err := os.ReadFile(filepath.Join(dimg.Layers[1], "bin/true"))
	must.NoError(t, err)
	must.Eq(t, "t", string(b))
	dimg2, err := f.store.Pull(context.Background(), "docker-archive:"+da+":example/app:v1", PullRequest{})
	must.NoError(t, err)
	must.Eq(t, dimg.Digest, dimg2.Digest)
	_, err = f.store.Pull(context.Background(), "docker-archive:"+da+":example/app:v2", PullRequest{})
	must.ErrorIs(t, err, ErrNotFound)
	entries, err := os.ReadDir(filepath.Join(f.store.Path(), "layers"))
	must.NoError(t, err)
	must.SliceLen(t, 2, entries)
}

// An amd64 image offered only for x86-64 levels (buildx's
// "linux/amd64/v2,linux/amd64/v3", no plain amd64) is pulled on an amd64
// node whose CPU runs one of them: the highest it runs.
func TestPullAMD64Levels(t *testing.T) {
	node := NodePlatform()
	level := amd64Variant(node.Variant)
	if node.Architecture != "amd64" || level < 2 {
		t.Skipf("needs an amd64 CPU of x86-64-v2 or later; this node is %s", platformString(&node))
	}
	f := newFixture(t)
	layer := mustLayer(t, imagebuild.File("a", []byte("a"), 0o644))
	var imgs []v1.Image
	for _, v := range []string{"v2", "v3", "v4"} {
		p := v1.Platform{OS: "linux", Architecture: "amd64", Variant: v}
		imgs = append(imgs, mustImage(t, imagebuild.Spec{Platform: &p, Cmd: []string{v}}, layer))
	}
	want := fmt.Sprintf("v%d", min(level, 3))
	idx, err := imagebuild.Index(imgs[0], imgs[1])
	must.NoError(t, err)
	img, err := f.store.Pull(context.Background(), f.layout(t, "levels", "1", idx), PullRequest{})
	must.NoError(t, err)
	must.Eq(t, []string{want}, img.Config.Cmd)
	if level < 4 {
		// Never a level above the CPU's.
		idx, err := imagebuild.Index(imgs[2])
		must.NoError(t, err)
		_, err = f.store.Pull(context.Background(), f.layout(t, "v4", "1", idx), PullRequest{})
		must.ErrorIs(t, err, ErrPlatform)
	}

	// An index that lists a v3 image as a v2 one (or as plain amd64) does
	// not get it onto a v2 node: its configuration says v3.
	f.store.opts.Platform = v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v2"}
	v3 := v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v3"}
	for i, listed := range []string{"v2", ""} {
		img := mustImage(t, imagebuild.Spec{Platform: &v3, Cmd: []string{"lying", listed}}, layer)
		idx := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex), mutate.IndexAddendum{
			Add: img, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64", Variant: listed}}})
		_, err = f.store.Pull(context.Background(), f.layout(t, fmt.Sprintf("lying%d", i), "1", idx), PullRequest{})
		must.ErrorIs(t, err, ErrPlatform)
		must.ErrorContains(t, err, "is built for linux/amd64/v3")
	}

	// An image of the store whose level the node no longer runs (a
	// virtual machine moved to an older host) is not served from the
	// store.
	f.store.opts.Platform = v3
	img3 := mustImage(t, imagebuild.Spec{Platform: &v3, Cmd: []string{"kept"}}, layer)
	ref := f.layout(t, "kept", "1.0", img3)
	got, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	f.store.opts.Platform = v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v2"}
	_, err = f.store.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrPlatform)
	// The node back on its level: the store serves it.
	f.store.opts.Platform = v3
	again, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	must.Eq(t, got.Digest, again.Digest)
}

func TestPullPlatform(t *testing.T) {
	f := newFixture(t)
	layer := mustLayer(t, imagebuild.File("a", []byte("a"), 0o644))
	node := NodePlatform()
	other := v1.Platform{OS: "linux", Architecture: "s390x"}
	here := mustImage(t, imagebuild.Spec{Platform: &node, Cmd: []string{"here"}}, layer)
	there := mustImage(t, imagebuild.Spec{Platform: &other, Cmd: []string{"there"}}, layer)
	idx, err := imagebuild.Index(there, here)
	must.NoError(t, err)
	ref := f.layout(t, "multi", "1", idx)
	img, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	must.Eq(t, []string{"here"}, img.Config.Cmd)
	idxDigest, err := idx.Digest()
	must.NoError(t, err)
	must.Eq(t, idxDigest.String(), img.IndexDigest)
	hereDigest, err := here.Digest()
	must.NoError(t, err)
	must.Eq(t, hereDigest.String(), img.Digest)

	onlyThere, err := imagebuild.Index(there)
	must.NoError(t, err)
	_, err = f.store.Pull(context.Background(), f.layout(t, "foreign", "1", onlyThere), PullRequest{})
	must.ErrorIs(t, err, ErrPlatform)
	must.ErrorContains(t, err, "linux/s390x")
	must.ErrorContains(t, err, platformString(&node))
	_, err = f.store.Pull(context.Background(), f.layout(t, "single", "1", there), PullRequest{})
	must.ErrorIs(t, err, ErrPlatform)
}

func TestLocalSourcesAreConfined(t *testing.T) {
	f := newFixture(t)
	img := mustImage(t, imagebuild.Spec{}, baseLayer(t))
	ref := f.layout(t, "app", "1", img)
	secret := filepath.Join(t.TempDir(), "shadow")
	must.NoError(t, os.WriteFile(secret, []byte("root:$6$SECRETHASH:19000:0:99999:7:::\n"), 0o600))
	must.NoError(t, os.Symlink(secret, filepath.Join(f.images, "link.tar")))
	must.NoError(t, os.Symlink(filepath.Join(f.images, "app"), filepath.Join(f.images, "linkdir")))
	must.NoError(t, os.WriteFile(filepath.Join(f.images, "notatar"), []byte("root:$6$SECRETHASH\n"), 0o600))

	for _, tc := range []struct {
		ref  string
		kind error
	}{
		{"oci-archive:" + secret, ErrNotAllowed},
		{"oci-archive:/etc/shadow", ErrNotAllowed},
		{"docker-archive:" + filepath.Join(f.root, "images", "store.lock"), ErrNotAllowed},
		{"oci-archive:" + filepath.Join(f.images, "link.tar"), ErrNotAllowed},
		{"oci:" + filepath.Join(f.images, "linkdir"), ErrNotAllowed},
		{"oci-archive:" + filepath.Join(f.images, "notatar"), ErrInvalid},
		{"docker-archive:" + filepath.Join(f.images, "notatar"), ErrInvalid},
		{"oci:" + filepath.Join(f.images, "notatar"), ErrInvalid},
		{"oci-archive:" + filepath.Join(f.images, "app"), ErrInvalid},
		{"oci:" + filepath.Join(f.images, "missing"), ErrNotFound},
		{strings.TrimSuffix(ref, ":1") + ":2", ErrNotFound},
	} {
		_, err := f.store.Pull(context.Background(), tc.ref, PullRequest{})
		must.ErrorIs(t, err, tc.kind, must.Sprint(tc.ref))
		must.StrNotContains(t, err.Error(), "SECRETHASH")
	}
	// A relative or unclean path is refused as written.
	for _, bad := range []string{"oci:relative/dir", "oci-archive:" + f.images + "/../x.tar", "oci:" + f.images + "/app/"} {
		_, err := f.store.Pull(context.Background(), bad, PullRequest{})
		must.ErrorIs(t, err, ErrInvalid, must.Sprint(bad))
	}
	assertEmpty(t, f.store)
	// Without local_image_dirs no host file is an image.
	s, err := Open(t.TempDir(), Options{})
	must.NoError(t, err)
	_, err = s.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrNotAllowed)
	must.ErrorContains(t, err, "local_image_dirs")
}

func TestCraftedLayers(t *testing.T) {
	f := newFixture(t)
	outside := t.TempDir()
	victim := filepath.Join(outside, "victim")
	must.NoError(t, os.WriteFile(victim, []byte("host"), 0o644))
	rel := func(p string) string { return strings.TrimPrefix(p, "/") }
	cases := map[string][]imagebuild.Entry{
		"dotdot":            {imagebuild.File("../../../../../../../.."+victim, []byte("pwned"), 0o644)},
		"dotdot inside":     {imagebuild.File("a/../../x", []byte("pwned"), 0o644)},
		"symlink then file": {imagebuild.Symlink("evil", outside), imagebuild.File("evil/victim", []byte("pwned"), 0o644)},
		"relative symlink then file": {imagebuild.Symlink("up", "../../../../../../../../.."),
			imagebuild.File("up/"+rel(victim), []byte("pwned"), 0o644)},
		"symlink chain then file": {imagebuild.Symlink("a", "b"), imagebuild.Symlink("b", outside),
			imagebuild.File("a/victim", []byte("pwned"), 0o644)},
		"symlink dir then mkdir": {imagebuild.Symlink("d", outside), imagebuild.Dir("d/new", 0o755)},
		"hardlink to host file":  {imagebuild.Hardlink("h", victim)},
		"hardlink climbing":      {imagebuild.Hardlink("h", "../../../../../../../.."+victim)},
		"hardlink via symlink":   {imagebuild.Symlink("s", outside), imagebuild.Hardlink("h", "s/victim")},
		"whiteout via symlink":   {imagebuild.Symlink("s", outside), imagebuild.Whiteout("s/victim")},
		"opaque via symlink":     {imagebuild.Symlink("s", outside), imagebuild.Opaque("s")},
	}
	f.assertRefused(t, cases, victim, outside)
	// Contained, not refused: an absolute symlink chain is stored as
	// written and never followed; a later entry replaces a symlink of the
	// same name rather than writing through it; device nodes stay in the
	// layer.
	ref := f.layout(t, "contained", "1", mustImage(t, imagebuild.Spec{}, mustLayer(t,
		imagebuild.Symlink("etc", outside),
		imagebuild.Symlink("x", "/etc/../../"+rel(outside)),
		imagebuild.Symlink("y", "x"),
		imagebuild.File("y", []byte("replaced"), 0o644),
		imagebuild.CharDevice("mem", 1, 1),
	)))
	img, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	b, err := os.ReadFile(filepath.Join(img.Layers[0], "y"))
	must.NoError(t, err)
	must.Eq(t, "replaced", string(b))
	names, err := os.ReadDir(outside)
	must.NoError(t, err)
	must.SliceLen(t, 1, names)
}

// assertRefused pulls an image of each layer of cases and checks that it
// is refused as unsafe, that victim (a file in outside) is as it was, that
// outside holds nothing else, and that the store is empty.
func (f *fixture) assertRefused(t *testing.T, cases map[string][]imagebuild.Entry, victim, outside string) {
	t.Helper()
	for name, entries := range cases {
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
}

func TestDigestMismatchLeavesNothing(t *testing.T) {
	f := newFixture(t)
	layer := mustLayer(t, imagebuild.File("big", []byte(strings.Repeat("x", 4096)), 0o644))
	ref := f.layout(t, "tampered", "1", mustImage(t, imagebuild.Spec{}, layer))
	d, err := layer.Digest()
	must.NoError(t, err)
	blob := filepath.Join(f.images, "tampered", "blobs", "sha256", d.Hex)
	good, err := os.ReadFile(blob)
	must.NoError(t, err)
	for name, bad := range map[string][]byte{
		"flipped byte": append(append([]byte{}, good[:len(good)-9]...), append([]byte{good[len(good)-9] ^ 0xff}, good[len(good)-8:]...)...),
		"truncated":    good[:len(good)/2],
		"garbage":      []byte(strings.Repeat("z", len(good))),
		"longer":       append(append([]byte{}, good...), 0),
	} {
		must.NoError(t, os.WriteFile(blob, bad, 0o644))
		_, err = f.store.Pull(context.Background(), ref, PullRequest{})
		must.ErrorIs(t, err, ErrDigestMismatch, must.Sprint(name))
		must.ErrorContains(t, err, ref)
		assertEmpty(t, f.store)
	}
	must.NoError(t, os.WriteFile(blob, good, 0o644))
	_, err = f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
}

func TestBounds(t *testing.T) {
	f := newFixture(t)
	var layers []v1.Layer
	for i := range 4 {
		layers = append(layers, mustLayer(t, imagebuild.File("f"+string(rune('a'+i)), []byte(strings.Repeat("y", 1<<16)), 0o644)))
	}
	ref := f.layout(t, "many", "1", mustImage(t, imagebuild.Spec{}, layers...))
	f.store.opts.MaxLayers = 3
	_, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrTooLarge)
	must.ErrorContains(t, err, "image_max_layers = 3")
	f.store.opts.MaxLayers = 4
	// Compressed the layers are small; unpacked they pass the bound.
	f.store.opts.MaxSize = 3 << 16
	_, err = f.store.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrTooLarge)
	must.ErrorContains(t, err, "image_max_size")
	assertEmpty(t, f.store)
	f.store.opts.MaxSize = DefaultMaxSize
	// Entries are bounded too: inodes, which small files take within
	// any size.
	f.store.maxEntries = 3
	_, err = f.store.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrTooLarge)
	must.ErrorContains(t, err, "more than 3 files, directories and links")
	assertEmpty(t, f.store)
	f.store.maxEntries = 4
	_, err = f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
}

// du is the disk usage of dir in KiB, as du counts it (hard links once).
func du(t *testing.T, dir string) int64 {
	t.Helper()
	out, err := exec.Command("du", "-sk", dir).Output()
	must.NoError(t, err)
	var n int64
	for _, c := range strings.Fields(string(out))[0] {
		n = n*10 + int64(c-'0')
	}
	return n
}

func TestSharedLayersStoredOnce(t *testing.T) {
	f := newFixture(t)
	base := mustLayer(t, imagebuild.File("base", []byte(strings.Repeat("b", 4<<20)), 0o644))
	a := f.layout(t, "a", "1", mustImage(t, imagebuild.Spec{}, base, mustLayer(t, imagebuild.File("a", []byte("a"), 0o644))))
	b := f.layout(t, "b", "1", mustImage(t, imagebuild.Spec{}, base, mustLayer(t, imagebuild.File("b", []byte("b"), 0o644))))
	ia, err := f.store.Pull(context.Background(), a, PullRequest{})
	must.NoError(t, err)
	one := du(t, f.store.Path())
	ib, err := f.store.Pull(context.Background(), b, PullRequest{})
	must.NoError(t, err)
	both := du(t, f.store.Path())
	must.Eq(t, ia.Layers[0], ib.Layers[0])
	// The second image added its own small layer only: far less than a
	// second copy of the base.
	must.Less(t, 2*one, both+one/2)
	must.Less(t, one+one/4, both)
	list, err := f.store.List(nil)
	must.NoError(t, err)
	must.SliceLen(t, 2, list)
	must.Greater(t, both*1024, list[0].Size+list[1].Size-(4<<20)/2)
}

func TestConcurrentPullsShareOneUnpack(t *testing.T) {
	f := newFixture(t)
	ref := f.layout(t, "app", "1", mustImage(t, imagebuild.Spec{}, baseLayer(t)))
	// Two stores on one directory are two processes (the driver and the
	// CLI): the layer lock makes one of them unpack, the other wait.
	other, err := Open(f.root, Options{LocalDirs: []string{f.images}})
	must.NoError(t, err)
	var wg sync.WaitGroup
	imgs := make([]*Image, 6)
	errs := make([]error, 6)
	for i := range imgs {
		s := f.store
		if i%2 == 1 {
			s = other
		}
		wg.Go(func() { imgs[i], errs[i] = s.Pull(context.Background(), ref, PullRequest{}) })
	}
	wg.Wait()
	for i := range imgs {
		must.NoError(t, errs[i])
		must.Eq(t, imgs[0].Layers, imgs[i].Layers)
	}
	entries, err := os.ReadDir(filepath.Join(f.store.Path(), "layers"))
	must.NoError(t, err)
	must.SliceLen(t, 1, entries)
	assertTmpClean(t, f.store)
}

func TestInterruptedPullIsRedone(t *testing.T) {
	f := newFixture(t)
	layer := baseLayer(t)
	ref := f.layout(t, "app", "1", mustImage(t, imagebuild.Spec{}, layer))
	diff, err := layer.DiffID()
	must.NoError(t, err)
	// What a pull killed mid-layer leaves: a part of the layer under
	// tmp/, its lock file, no record.
	parsed, err := ParseReference(ref, nil)
	must.NoError(t, err)
	tmp := f.store.tmpPath(diff.String(), parsed)
	must.StrHasPrefix(t, filepath.Join(f.store.Path(), "tmp", diff.Hex+"."), tmp)
	part := filepath.Join(tmp, "fs", "etc")
	must.NoError(t, os.MkdirAll(part, 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(part, "half"), []byte("half"), 0o644))
	must.NoError(t, os.WriteFile(tmp+".lock", nil, 0o600))
	list, err := f.store.List(nil)
	must.NoError(t, err)
	must.SliceEmpty(t, list)
	img, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	_, err = os.Stat(filepath.Join(img.Layers[0], "etc", "half"))
	must.ErrorIs(t, err, os.ErrNotExist)
	_, err = os.Stat(filepath.Join(img.Layers[0], "etc", "os-release"))
	must.NoError(t, err)
	assertTmpClean(t, f.store)
}

func TestLeasesAndGC(t *testing.T) {
	f := newFixture(t)
	now := time.Now()
	f.store.now = func() time.Time { return now }
	base := mustLayer(t, imagebuild.File("base", []byte("base"), 0o644))
	pull := func(name string) *Image {
		ref := f.layout(t, name, "1", mustImage(t, imagebuild.Spec{}, base, mustLayer(t, imagebuild.File(name, []byte(name), 0o644))))
		img, err := f.store.Pull(context.Background(), ref, PullRequest{})
		must.NoError(t, err)
		return img
	}
	used, old, recent, stale := pull("used"), pull("old"), pull("recent"), pull("stale")
	ctx := context.Background()
	must.NoError(t, f.store.Acquire(ctx, Use{TaskID: "alloc1/used/1", AllocID: "alloc1"}, used.Digest))
	must.NoError(t, f.store.Acquire(ctx, Use{TaskID: "alloc2/gone/1"}, stale.Digest))
	must.NoError(t, f.store.Acquire(ctx, Use{TaskID: "alloc3/old/1"}, old.Digest))
	now = now.Add(time.Hour)
	must.NoError(t, f.store.Release(ctx, "alloc3/old/1"))
	must.NoError(t, f.store.Release(ctx, "alloc3/old/1")) // idempotent
	now = now.Add(2 * time.Hour)
	must.NoError(t, f.store.Acquire(ctx, Use{TaskID: "alloc4/recent/1"}, recent.Digest))
	must.NoError(t, f.store.Release(ctx, "alloc4/recent/1"))
	now = now.Add(30 * time.Minute)

	live := func(u Use) bool { return u.TaskID == "alloc1/used/1" }
	list, err := f.store.List(live)
	must.NoError(t, err)
	must.SliceLen(t, 4, list)
	for _, i := range list {
		if i.Digest == used.Digest {
			must.SliceLen(t, 1, i.InUseBy)
			must.Eq(t, "alloc1", i.InUseBy[0].AllocID)
		} else {
			must.SliceEmpty(t, i.InUseBy)
		}
	}
	// In use: refused.
	_, err = f.store.Remove(ctx, used.Digest, live)
	must.ErrorIs(t, err, ErrInUse)

	removed, err := f.store.GC(time.Hour, live)
	must.NoError(t, err)
	// old was let go 2.5h ago; recent 30m ago; stale's task is gone, so
	// its lease goes and it counts as used until now.
	must.Eq(t, []string{old.Digest}, removed)
	for _, l := range old.Layers[1:] {
		_, err := os.Stat(l)
		must.ErrorIs(t, err, os.ErrNotExist)
	}
	// The shared base and the kept images' layers stay.
	for _, img := range []*Image{used, recent, stale} {
		for _, l := range img.Layers {
			_, err := os.Stat(l)
			must.NoError(t, err)
		}
	}
	now = now.Add(2 * time.Hour)
	removed, err = f.store.GC(time.Hour, live)
	must.NoError(t, err)
	must.SliceLen(t, 2, removed)
	list, err = f.store.List(live)
	must.NoError(t, err)
	must.SliceLen(t, 1, list)
	must.Eq(t, used.Digest, list[0].Digest)

	// rm by reference once the task is gone.
	must.NoError(t, f.store.Release(ctx, "alloc1/used/1"))
	info, err := f.store.Remove(ctx, used.Ref, live)
	must.NoError(t, err)
	must.Eq(t, used.Digest, info.Digest)
	assertEmpty(t, f.store)
}

func TestGCSkipsWhileAPullRuns(t *testing.T) {
	f := newFixture(t)
	unlock, err := f.store.lockStore(context.Background(), unix.LOCK_SH)
	must.NoError(t, err)
	removed, err := f.store.GC(0, nil)
	must.NoError(t, err)
	must.SliceEmpty(t, removed)
	unlock()
}

func TestParseReference(t *testing.T) {
	for _, tc := range []struct {
		in, kind, path, tag, digest, registry string
		err                                   string
	}{
		{in: "registry.example/csi:1.2", kind: KindRegistry, registry: "registry.example"},
		{in: "127.0.0.1:5000/csi@sha256:" + strings.Repeat("a", 64), kind: KindRegistry, registry: "127.0.0.1:5000", digest: "sha256:" + strings.Repeat("a", 64)},
		{in: "busybox", kind: KindRegistry, registry: "index.docker.io"},
		// As Kubernetes manifests pin plugins: a tag for the reader, the
		// digest for the pull.
		{in: "registry.k8s.io/sig-storage/hostpathplugin:v1.9.0@sha256:" + strings.Repeat("c", 64), kind: KindRegistry, registry: "registry.k8s.io", digest: "sha256:" + strings.Repeat("c", 64)},
		{in: "oci:/srv/images/csi", kind: KindOCILayout, path: "/srv/images/csi"},
		{in: "oci:/srv/images/csi:1.2", kind: KindOCILayout, path: "/srv/images/csi", tag: "1.2"},
		{in: "oci-archive:/srv/csi.tar@sha256:" + strings.Repeat("b", 64), kind: KindOCIArchive, path: "/srv/csi.tar", digest: "sha256:" + strings.Repeat("b", 64)},
		{in: "docker-archive:/srv/csi.tar:example/csi:1", kind: KindDockerArchive, path: "/srv/csi.tar", tag: "example/csi:1"},
		{in: "", err: "must not be empty"},
		{in: "bad ref", err: "space"},
		{in: "a/\x1b[2Jb", err: "control"},
		{in: "UPPER/case:1", err: "not a valid reference"},
		{in: "oci:relative", err: "absolute"},
		{in: "oci:/a/../b", err: "absolute, clean"},
		{in: "oci:/a@sha256:short", err: "64"},
		{in: "oci:/a:", err: "empty"},
	} {
		r, err := ParseReference(tc.in, nil)
		if tc.err != "" {
			must.ErrorContains(t, err, tc.err, must.Sprint(tc.in))
			continue
		}
		must.NoError(t, err)
		must.Eq(t, tc.kind, r.Kind)
		must.Eq(t, tc.path, r.Path)
		must.Eq(t, tc.tag, r.Tag)
		must.Eq(t, tc.digest, r.Digest)
		must.Eq(t, tc.registry, r.Registry())
	}
}

func TestRetryIsBoundedAndSaid(t *testing.T) {
	s := &Store{retryBase: time.Millisecond, attempts: 3}
	var said []string
	calls := 0
	err := s.retry(context.Background(), Reference{Raw: "r/x:1", Kind: KindRegistry}, "the manifest", func(m string) { said = append(said, m) }, func() error {
		calls++
		return &statusError{code: 503}
	})
	must.Error(t, err)
	must.Eq(t, 3, calls)
	must.SliceLen(t, 2, said)
	must.StrContains(t, said[0], "retrying in")
	calls = 0
	err = s.retry(context.Background(), Reference{}, "x", nil, func() error { calls++; return &statusError{code: 401} })
	must.Error(t, err)
	must.Eq(t, 1, calls)
	reg := Reference{Raw: "r/x:1", Kind: KindRegistry}
	must.True(t, errors.Is(classify(reg, "x", err), ErrUnauthorized))
	must.True(t, errors.Is(classify(reg, "x", &statusError{code: 404}), ErrNotFound))
	// A full disk or a permission is not the network: not tried again.
	must.False(t, transient(fmt.Errorf("write: %w", syscall.ENOSPC)))
	must.False(t, transient(&os.PathError{Op: "open", Path: "x", Err: syscall.EACCES}))
	must.True(t, transient(&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}))
	must.True(t, transient(fmt.Errorf("body: %w", io.ErrUnexpectedEOF)))
}

func TestFullDiskLeavesNothing(t *testing.T) {
	f := newFixture(t)
	// The store on a file system of 2 MiB; the image unpacks to 3.
	root := t.TempDir()
	must.NoError(t, unix.Mount("tmpfs", root, "tmpfs", 0, "size=2m"))
	t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	s, err := Open(root, Options{LocalDirs: []string{f.images}})
	must.NoError(t, err)
	big := make([]byte, 3<<20)
	for i := range big {
		big[i] = byte(i*7 + i>>8)
	}
	ref := f.layout(t, "big", "1", mustImage(t, imagebuild.Spec{}, mustLayer(t, imagebuild.File("big", big, 0o644))))
	_, err = s.Pull(context.Background(), ref, PullRequest{})
	must.ErrorContains(t, err, "is full")
	must.ErrorContains(t, err, "free space there or lower image_gc")
	must.ErrorIs(t, err, unix.ENOSPC)
	assertEmpty(t, s)
	// With room, the same pull completes.
	must.NoError(t, unix.Mount("tmpfs", root, "tmpfs", unix.MS_REMOUNT, "size=16m"))
	img, err := s.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	b, err := os.ReadFile(filepath.Join(img.Layers[0], "big"))
	must.NoError(t, err)
	must.Eq(t, len(big), len(b))
}

// Layers come gzip-compressed, zstd-compressed or as plain tars.
func TestPullCompressions(t *testing.T) {
	f := newFixture(t)
	b, err := imagebuild.Tar(imagebuild.File("zstd", []byte(strings.Repeat("z", 1<<16)), 0o644))
	must.NoError(t, err)
	zl, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithCompression(compression.ZStd), tarball.WithMediaType(types.OCILayerZStd))
	must.NoError(t, err)
	mt, err := zl.MediaType()
	must.NoError(t, err)
	must.Eq(t, types.OCILayerZStd, mt)
	rc, err := zl.Compressed()
	must.NoError(t, err)
	magic := make([]byte, 4)
	_, err = io.ReadFull(rc, magic)
	must.NoError(t, err)
	rc.Close()
	must.Eq(t, []byte{0x28, 0xb5, 0x2f, 0xfd}, magic)
	plain, err := imagebuild.Tar(imagebuild.File("plain", []byte("p"), 0o644))
	must.NoError(t, err)
	pl := static.NewLayer(plain, types.OCIUncompressedLayer)
	ref := f.layout(t, "mixed", "1", mustImage(t, imagebuild.Spec{}, baseLayer(t), zl, pl))
	img, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	got, err := os.ReadFile(filepath.Join(img.Layers[1], "zstd"))
	must.NoError(t, err)
	must.Eq(t, 1<<16, len(got))
	got, err = os.ReadFile(filepath.Join(img.Layers[2], "plain"))
	must.NoError(t, err)
	must.Eq(t, "p", string(got))
}

// The image's STOPSIGNAL comes with its configuration, from a pull and
// from the store. An image a build that kept no stop signal recorded gets
// it from the configuration the store keeps beside the record, once: the
// record is written back with it, and later pulls do not read the
// configuration again (here, they find it gone), also when the image has
// no STOPSIGNAL. A configuration that fails its digest says nothing, and
// is not taken for "none": it is taken away, once (not read at every
// pull), and the next pull that asks the image's source fetches it again.
func TestPullStopSignal(t *testing.T) {
	f := newFixture(t)
	// As tasks pull: with a lease, which alone changes no record.
	n := 0
	pull := func(ref string) string {
		t.Helper()
		n++
		img, err := f.store.Pull(context.Background(), ref, PullRequest{Use: &Use{TaskID: fmt.Sprintf("alloc/task/%d", n)}})
		must.NoError(t, err)
		return img.Config.StopSignal
	}
	// oldRecord makes the record of ref's image as an earlier build wrote
	// it: no StopSignal, not known; and returns its configuration's path.
	oldRecord := func(ref string) string {
		t.Helper()
		img, err := f.store.Pull(context.Background(), ref, PullRequest{})
		must.NoError(t, err)
		path := f.store.recordPath(img.Digest)
		b, err := os.ReadFile(path)
		must.NoError(t, err)
		var rec map[string]any
		must.NoError(t, json.Unmarshal(b, &rec))
		must.Eq(t, true, rec["stop_signal_known"].(bool))
		delete(rec, "stop_signal_known")
		delete(rec["config"].(map[string]any), "StopSignal")
		b, err = json.Marshal(rec)
		must.NoError(t, err)
		must.NoError(t, os.WriteFile(path, b, 0o600))
		return f.store.configPath(rec["config_digest"].(string))
	}
	known := func(ref string) bool {
		t.Helper()
		r, _ := f.store.findRef(ref, "")
		must.NotNil(t, r)
		return r.StopSignalKnown
	}

	ref := f.layout(t, "app", "1", mustImage(t, imagebuild.Spec{Cmd: []string{"/plugin"}, StopSignal: "SIGTERM"}, baseLayer(t)))
	must.Eq(t, "SIGTERM", pull(ref))

	cfgPath := oldRecord(ref)
	kept, err := os.ReadFile(cfgPath)
	must.NoError(t, err)
	// A kept configuration that no longer matches its digest says
	// nothing: the pull, which asks the source (a local one is asked at
	// every pull), fetches it again, and the record learns its stop
	// signal. (TestDamagedConfigIsTakenAwayOnce: by digest, without the
	// source.)
	must.NoError(t, os.WriteFile(cfgPath, bytes.Replace(kept, []byte("SIGTERM"), []byte("SIGKILL"), 1), 0o600))
	must.Eq(t, "SIGTERM", pull(ref))
	must.True(t, known(ref))
	got, err := os.ReadFile(cfgPath)
	must.NoError(t, err)
	must.Eq(t, kept, got)
	// Read once: the next pulls need no configuration.
	must.NoError(t, os.Rename(cfgPath, cfgPath+".away"))
	must.Eq(t, "SIGTERM", pull(ref))
	must.Eq(t, "SIGTERM", pull(ref))
	must.NoError(t, os.Rename(cfgPath+".away", cfgPath))

	// An image without one has none, and an old record of it learns so
	// once too.
	ref = f.layout(t, "plain", "1", mustImage(t, imagebuild.Spec{Cmd: []string{"/plugin"}}, baseLayer(t)))
	must.Eq(t, "", pull(ref))
	cfgPath = oldRecord(ref)
	must.False(t, known(ref))
	must.Eq(t, "", pull(ref))
	must.True(t, known(ref), must.Sprint("no STOPSIGNAL is not remembered: every pull reads the configuration"))
	must.NoError(t, os.Rename(cfgPath, cfgPath+".away"))
	must.Eq(t, "", pull(ref))
	must.True(t, known(ref))
	must.NoError(t, os.Rename(cfgPath+".away", cfgPath))
}

// A configuration kept beside a record written before stop signals were
// kept, damaged on disk, is read once: served by digest, without its
// registry, the image is used as it is (its stop signal unknown), the
// damaged copy is taken away and logged, naming it, and is not read again
// at each pull; the next pull that asks the registry fetches it again, and
// the record learns its stop signal. The image's layers, which a task
// holds a lease on, stay.
func TestDamagedConfigIsTakenAwayOnce(t *testing.T) {
	needRoot(t)
	reg := newTagRegistry(t)
	var logs bytes.Buffer
	s, err := Open(t.TempDir(), Options{InsecureRegistries: []string{reg.host},
		Logger: hclog.New(&hclog.LoggerOptions{Output: &logs, Level: hclog.Warn})})
	must.NoError(t, err)
	ctx := context.Background()
	tag := reg.host + "/csi/plugin:1.2"
	d := reg.push(t, tag, mustImage(t, imagebuild.Spec{Cmd: []string{"/plugin"}, StopSignal: "SIGTERM"}, baseLayer(t)))
	byDigest := reg.host + "/csi/plugin@" + d
	_, err = s.Pull(ctx, tag, PullRequest{})
	must.NoError(t, err)

	// As an earlier build wrote it, and its configuration damaged.
	r, err := s.readRecord(d)
	must.NoError(t, err)
	r.StopSignalKnown, r.Config.StopSignal = false, ""
	b, err := json.Marshal(r)
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(s.recordPath(d), b, 0o600))
	cfgPath := s.configPath(r.ConfigDigest)
	must.NoError(t, os.WriteFile(cfgPath, bytes.Repeat([]byte("x"), maxConfigSize+10), 0o600))

	hits := reg.hits.Load()
	for i := range 3 {
		img, err := s.Pull(ctx, byDigest, PullRequest{Use: &Use{TaskID: fmt.Sprintf("alloc/t/%d", i)}})
		must.NoError(t, err)
		must.Eq(t, "", img.Config.StopSignal)
		must.FileNotExists(t, cfgPath)
		for _, l := range img.Layers {
			must.DirExists(t, l)
		}
	}
	must.Eq(t, hits, reg.hits.Load(), must.Sprint("a pull by digest the store has asked the registry"))
	must.Eq(t, 1, strings.Count(logs.String(), "removed a damaged image configuration"), must.Sprint(logs.String()))
	must.StrContains(t, logs.String(), r.ConfigDigest)

	img, err := s.Pull(ctx, tag, PullRequest{ForcePull: true})
	must.NoError(t, err)
	must.Eq(t, "SIGTERM", img.Config.StopSignal)
	r, err = s.readRecord(d)
	must.NoError(t, err)
	must.True(t, r.StopSignalKnown)
	must.NotNil(t, s.storedConfig(r.ConfigDigest))
	for i := range 3 {
		must.NoError(t, s.Release(ctx, fmt.Sprintf("alloc/t/%d", i)))
	}
}

// An image the store has whole, recorded before stop signals were kept
// and whose kept configuration is damaged, is still served when its
// source no longer serves the configuration (a registry that collected
// the blob, a layout directory pruned): the configuration is asked for to
// learn the stop signal, which is not worth failing the start for; the
// image stops with its task's kill_signal, as it did before.
func TestLostConfigDoesNotFailAPresentImage(t *testing.T) {
	f := newFixture(t)
	img := mustImage(t, imagebuild.Spec{Cmd: []string{"/plugin"}, StopSignal: "SIGTERM"}, baseLayer(t))
	ref := f.layout(t, "lost", "1", img)
	got, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)

	r, err := f.store.readRecord(got.Digest)
	must.NoError(t, err)
	r.StopSignalKnown, r.Config.StopSignal = false, ""
	b, err := json.Marshal(r)
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(f.store.recordPath(got.Digest), b, 0o600))
	must.NoError(t, os.WriteFile(f.store.configPath(r.ConfigDigest), bytes.Repeat([]byte("x"), 10), 0o600))
	must.NoError(t, os.Remove(filepath.Join(f.images, "lost", "blobs", "sha256", hexOf(r.ConfigDigest))))

	again, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	must.Eq(t, got.Digest, again.Digest)
	must.Eq(t, "", again.Config.StopSignal)
}
