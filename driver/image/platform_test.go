package image

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// Spellings of a platform that containerd normalises (x86_64, aarch64,
// armhf, upper case, arm64 "8") name the platform they are read as: an
// index that writes them is pulled. None of them reads as a higher level
// than it says: a v4 spelled any way stays off a v3 node.
func TestPickPlatform_Spellings(t *testing.T) {
	ref := Reference{Raw: "example/csi:1"}
	p := func(arch, variant string) v1.Platform {
		return v1.Platform{OS: "linux", Architecture: arch, Variant: variant}
	}
	amd64v3, arm64, arm7, arm6 := p("amd64", "v3"), p("arm64", "v8"), p("arm", "v7"), p("arm", "v6")
	for _, tc := range []struct {
		node   v1.Platform
		listed v1.Platform
		ok     bool
	}{
		{amd64v3, p("x86_64", ""), true},
		{amd64v3, p("x86-64", "v2"), true},
		{amd64v3, p("X86_64", "V3"), true},
		{amd64v3, p("amd64", "v3 "), true},
		{amd64v3, p(" amd64", "v1"), true},
		{amd64v3, v1.Platform{OS: "Linux", Architecture: "AMD64"}, true},
		{amd64v3, p("x86_64", "V4"), false},
		{amd64v3, p("amd64", "v4 "), false},
		{amd64v3, p("amd64", "3"), false},
		{amd64v3, p("amd64", "v3.1"), false},
		{amd64v3, p("i386", ""), false},
		{arm64, p("aarch64", ""), true},
		{arm64, p("arm64", "8"), true},
		{arm64, p("ARM64", "V8"), true},
		{arm64, p("aarch64", "v8.0"), true},
		{arm64, p("arm64", "v9"), false},
		{arm64, p("aarch64", "9"), false},
		{arm64, p("armhf", ""), false},
		{arm7, p("armhf", ""), true},
		{arm7, p("arm", "7"), true},
		{arm7, p("armel", ""), true},
		{arm7, p("arm", "8"), false},
		{arm6, p("armhf", ""), false},
		{arm6, p("arm", "V6"), true},
	} {
		t.Run(fmt.Sprintf("%s on %s", platformString(&tc.listed), platformString(&tc.node)), func(t *testing.T) {
			idx := &v1.IndexManifest{Manifests: []v1.Descriptor{{MediaType: types.OCIManifestSchema1, Platform: &tc.listed,
				Digest: v1.Hash{Algorithm: "sha256", Hex: strings.Repeat("0", 64)}}}}
			_, err := pickPlatform(ref, idx, tc.node)
			if tc.ok {
				must.NoError(t, err)
			} else {
				must.ErrorIs(t, err, ErrPlatform)
			}
		})
	}
}

// A record's platform is read only as the store writes it. One that is
// not (damaged, or edited by hand) is not served on any node: the pull
// fetches the image again.
func TestRecordPlatformIsReadStrictly(t *testing.T) {
	s := &Store{opts: Options{Platform: v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v2"}}}
	for _, tc := range []struct {
		platform string
		runs     bool
	}{
		{"", true},
		{"linux/amd64", true},
		{"linux/amd64/v1", true},
		{"linux/amd64/v2", true},
		{"linux/amd64/v3", false},
		{"linux/arm64/v8", false},
		{"linux", false},
		{"linux/", false},
		{"/amd64", false},
		{"linux//amd64", false},
		{"linux/amd64/", false},
		{"linux/amd64/v2/x", false},
		{"linux/amd64/v1/v4", false},
		{"linux:10/amd64", false},
		{" linux/amd64", false},
		{"linux/amd64 ", false},
		{"linux/amd64/v2 ", false},
		{"Linux/amd64", false},
		{"linux/x86_64", false},
		{"linux/amd64/V2", false},
		{"linux/amd64/v2\x00", false},
		{strings.Repeat("linux/", 1<<16) + "amd64", false},
	} {
		must.Eq(t, tc.runs, s.runsHere(&record{Platform: tc.platform}), must.Sprintf("platform %q", tc.platform))
	}
}

// An index that lists an image for a level the node runs does not get one
// of a higher level onto it, however its configuration spells the level,
// and a configuration without "os" is checked as well: its image runs
// only where its architecture and level do.
func TestConfigPlatformIsCheckedNormalised(t *testing.T) {
	f := newFixture(t)
	layer := mustLayer(t, imagebuild.File("a", []byte("a"), 0o644))
	f.store.opts.Platform = v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v2"}
	listed := func(name string, img v1.Image, p v1.Platform) string {
		idx := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex), mutate.IndexAddendum{
			Add: img, Descriptor: v1.Descriptor{Platform: &p}})
		return f.layout(t, name, "1", idx)
	}
	for i, tc := range []struct {
		config, listed v1.Platform
		ok             bool
	}{
		{v1.Platform{OS: "linux", Architecture: "amd64", Variant: "V3"}, v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v2"}, false},
		{v1.Platform{OS: "linux", Architecture: "x86_64", Variant: "v3 "}, v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v2"}, false},
		{v1.Platform{Architecture: "amd64", Variant: "v4"}, v1.Platform{OS: "linux", Architecture: "amd64"}, false},
		{v1.Platform{Variant: "v3"}, v1.Platform{OS: "linux", Architecture: "amd64"}, false},
		{v1.Platform{Architecture: "arm64"}, v1.Platform{OS: "linux", Architecture: "amd64"}, false},
		{v1.Platform{OS: "linux", Architecture: "X86_64", Variant: "V2"}, v1.Platform{OS: "linux", Architecture: "x86_64", Variant: "v2"}, true},
		{v1.Platform{Architecture: "amd64"}, v1.Platform{OS: "linux", Architecture: "amd64"}, true},
	} {
		img := mustImage(t, imagebuild.Spec{Platform: &tc.config, Cmd: []string{fmt.Sprint(i)}}, layer)
		ref := listed(fmt.Sprintf("c%d", i), img, tc.listed)
		got, err := f.store.Pull(context.Background(), ref, PullRequest{})
		if !tc.ok {
			must.ErrorIs(t, err, ErrPlatform, must.Sprintf("config %+v listed as %+v", tc.config, tc.listed))
			continue
		}
		must.NoError(t, err, must.Sprintf("config %+v listed as %+v", tc.config, tc.listed))
		// The record keeps the platform as the store spells it.
		r, err := f.store.readRecord(got.Digest)
		must.NoError(t, err)
		n := normalPlatform(tc.config)
		n.OS = "linux"
		must.Eq(t, platformString(&n), r.Platform)
	}
}

// A record whose platform is damaged is neither served nor a wedge: the
// next pull fetches the image from its source and writes the record
// again, by tag and by digest.
func TestDamagedRecordPlatformIsFetchedAgain(t *testing.T) {
	f := newFixture(t)
	node := NodePlatform()
	img := mustImage(t, imagebuild.Spec{Platform: &node, Cmd: []string{"x"}}, baseLayer(t))
	ref := f.layout(t, "damaged", "1.0", img)
	got, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	want, err := f.store.readRecord(got.Digest)
	must.NoError(t, err)
	for _, bad := range []string{"linux", "linux:10/" + node.Architecture, platformString(&node) + "/x", " " + platformString(&node), "\x00"} {
		r, err := f.store.readRecord(got.Digest)
		must.NoError(t, err)
		r.Platform = bad
		b, err := json.Marshal(r)
		must.NoError(t, err)
		must.NoError(t, os.WriteFile(f.store.recordPath(got.Digest), b, 0o600))
		must.Nil(t, f.store.findDigest(got.Digest), must.Sprintf("platform %q", bad))
		again, err := f.store.Pull(context.Background(), ref, PullRequest{})
		must.NoError(t, err, must.Sprintf("platform %q", bad))
		must.Eq(t, got.Digest, again.Digest)
		r, err = f.store.readRecord(got.Digest)
		must.NoError(t, err)
		must.Eq(t, want.Platform, r.Platform, must.Sprintf("platform %q", bad))
	}
}

// A hostile index or configuration may name platforms megabytes long: the
// error names them cut short, not whole.
func TestHugePlatformsAreCutInErrors(t *testing.T) {
	ref := Reference{Raw: "example/csi:1"}
	huge := strings.Repeat("x", 1<<20)
	idx := &v1.IndexManifest{}
	for i := range 20 {
		idx.Manifests = append(idx.Manifests, v1.Descriptor{MediaType: types.OCIManifestSchema1,
			Platform: &v1.Platform{OS: "linux", Architecture: huge + fmt.Sprint(i), Variant: "\x1b[2J"},
			Digest:   v1.Hash{Algorithm: "sha256", Hex: fmt.Sprintf("%064d", i)}})
	}
	_, err := pickPlatform(ref, idx, v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v2"})
	must.ErrorIs(t, err, ErrPlatform)
	must.Less(t, 4096, len(err.Error()))
	must.StrNotContains(t, err.Error(), "\x1b")
}

// An index by digest, of which the store has the images of two x86-64
// levels (the node ran a lower one for a while), is served the one of the
// node's level, whichever record the store reads first.
func TestIndexDigestServesTheClosestLevel(t *testing.T) {
	needRoot(t)
	reg := newTagRegistry(t)
	s, err := Open(t.TempDir(), Options{InsecureRegistries: []string{reg.host}})
	must.NoError(t, err)
	ctx := context.Background()
	v2 := v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v2"}
	v3 := v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v3"}
	layer := mustLayer(t, imagebuild.File("a", []byte("a"), 0o644))
	// Images whose v2 record comes first in the store's directory, where
	// a lookup that takes the first it finds goes wrong.
	var idx v1.ImageIndex
	for i := 0; idx == nil; i++ {
		i2 := mustImage(t, imagebuild.Spec{Platform: &v2, Cmd: []string{"v2", fmt.Sprint(i)}}, layer)
		i3 := mustImage(t, imagebuild.Spec{Platform: &v3, Cmd: []string{"v3", fmt.Sprint(i)}}, layer)
		d2, err := i2.Digest()
		must.NoError(t, err)
		d3, err := i3.Digest()
		must.NoError(t, err)
		if d2.Hex < d3.Hex {
			idx, err = imagebuild.Index(i2, i3)
			must.NoError(t, err)
		}
	}
	tag, err := name.NewTag(reg.host+"/csi/levels:1", name.Insecure)
	must.NoError(t, err)
	must.NoError(t, remote.WriteIndex(tag, idx))
	d, err := idx.Digest()
	must.NoError(t, err)
	ref := reg.host + "/csi/levels@" + d.String()

	pull := func(node v1.Platform) string {
		t.Helper()
		s.opts.Platform = node
		img, err := s.Pull(ctx, ref, PullRequest{})
		must.NoError(t, err)
		return img.Config.Cmd[0]
	}
	must.Eq(t, "v3", pull(v3))
	must.Eq(t, "v2", pull(v2))
	hits := reg.hits.Load()
	must.Eq(t, "v3", pull(v3))
	must.Eq(t, "v2", pull(v2))
	must.Eq(t, hits, reg.hits.Load(), must.Sprint("an index the store has both images of asked the registry"))
}

// A configuration that names no platform at all (no os, architecture nor
// variant: some builders write none) runs wherever the index or the
// reference that led to it says: it is pulled, its record names no
// platform, and the pull does not fail on it.
func TestConfigWithoutPlatformIsPulled(t *testing.T) {
	f := newFixture(t)
	img := mustImage(t, imagebuild.Spec{Platform: &v1.Platform{}, Cmd: []string{"x"}}, baseLayer(t))
	cf, err := img.ConfigFile()
	must.NoError(t, err)
	must.Nil(t, cf.Platform())
	got, err := f.store.Pull(context.Background(), f.layout(t, "noplatform", "1", img), PullRequest{})
	must.NoError(t, err)
	r, err := f.store.readRecord(got.Digest)
	must.NoError(t, err)
	must.Eq(t, "", r.Platform)
}

// A record an earlier build wrote for a configuration that names an
// architecture and level but no os has no platform (that build did not
// check such a configuration): the store reads the configuration it keeps
// beside it before serving it, so that an image of a level above the
// node's is not served from the store after the node's level dropped.
func TestRecordWithoutPlatformChecksItsConfiguration(t *testing.T) {
	f := newFixture(t)
	v4 := v1.Platform{Architecture: "amd64", Variant: "v4"}
	f.store.opts.Platform = v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v4"}
	img := mustImage(t, imagebuild.Spec{Platform: &v4, Cmd: []string{"x"}}, baseLayer(t))
	ref := f.layout(t, "legacy", "1", img)
	got, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	r, err := f.store.readRecord(got.Digest)
	must.NoError(t, err)
	must.Eq(t, "linux/amd64/v4", r.Platform)
	// As the earlier build wrote it.
	r.Platform, r.PlatformKnown = "", false
	b, err := json.Marshal(r)
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(f.store.recordPath(got.Digest), b, 0o600))
	must.NotNil(t, f.store.findDigest(got.Digest))

	f.store.opts.Platform.Variant = "v2"
	must.Nil(t, f.store.findDigest(got.Digest), must.Sprint("a v4 image served from the store on a v2 node"))
	found, _ := f.store.findRef(ref, "")
	must.Nil(t, found)
	_, err = f.store.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrPlatform)

	// One whose configuration names no platform still runs anywhere.
	plain := mustImage(t, imagebuild.Spec{Platform: &v1.Platform{}, Cmd: []string{"y"}}, baseLayer(t))
	got, err = f.store.Pull(context.Background(), f.layout(t, "plain", "1", plain), PullRequest{})
	must.NoError(t, err)
	must.NotNil(t, f.store.findDigest(got.Digest))
}

// A record an earlier build wrote without a platform learns its
// configuration's at the next pull of its image, under meta.lock, as one
// written before stop signals were kept learns its stop signal: the
// lookups after it read no configuration, and one that names no platform
// is remembered as such. A damaged configuration leaves the record as it
// is, served as before, its platform still unknown.
func TestRecordWithoutPlatformLearnsItOnce(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	f.store.opts.Platform = v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v4"}
	pull := func(ref string) string {
		t.Helper()
		img, err := f.store.Pull(ctx, ref, PullRequest{})
		must.NoError(t, err)
		return img.Digest
	}
	stored := func(digest string) *record {
		t.Helper()
		r, err := f.store.readRecord(digest)
		must.NoError(t, err)
		return r
	}
	// asOld writes the record of digest as the earlier build did.
	asOld := func(digest string) {
		t.Helper()
		path := f.store.recordPath(digest)
		b, err := os.ReadFile(path)
		must.NoError(t, err)
		var rec map[string]any
		must.NoError(t, json.Unmarshal(b, &rec))
		must.Eq(t, true, rec["platform_known"].(bool))
		delete(rec, "platform")
		delete(rec, "platform_known")
		b, err = json.Marshal(rec)
		must.NoError(t, err)
		must.NoError(t, os.WriteFile(path, b, 0o600))
		must.Eq(t, "", stored(digest).Platform)
	}

	v4 := v1.Platform{Architecture: "amd64", Variant: "v4"}
	ref := f.layout(t, "legacy", "1", mustImage(t, imagebuild.Spec{Platform: &v4, Cmd: []string{"x"}}, baseLayer(t)))
	d := pull(ref)
	asOld(d)
	must.Eq(t, d, pull(ref))
	r := stored(d)
	must.Eq(t, "linux/amd64/v4", r.Platform)
	must.True(t, r.PlatformKnown)
	// Learned: without the configuration, a node whose level dropped
	// still refuses it from the store.
	cfgPath := f.store.configPath(r.ConfigDigest)
	must.NoError(t, os.Rename(cfgPath, cfgPath+".away"))
	f.store.opts.Platform.Variant = "v2"
	must.Nil(t, f.store.findDigest(d), must.Sprint("the platform was not written back: a v4 image served on a v2 node"))
	f.store.opts.Platform.Variant = "v4"
	must.NoError(t, os.Rename(cfgPath+".away", cfgPath))

	// A damaged configuration says nothing: the record stays unknown and
	// is served as before.
	asOld(d)
	kept, err := os.ReadFile(cfgPath)
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(cfgPath, append(kept, ' '), 0o600))
	must.Eq(t, d, pull(ref))
	must.FileNotExists(t, cfgPath)
	must.False(t, stored(d).PlatformKnown)
	must.NotNil(t, f.store.findDigest(d))

	// One whose configuration names none is known to name none.
	plain := f.layout(t, "plain", "1", mustImage(t, imagebuild.Spec{Platform: &v1.Platform{}, Cmd: []string{"y"}}, baseLayer(t)))
	d = pull(plain)
	asOld(d)
	must.False(t, stored(d).PlatformKnown)
	must.Eq(t, d, pull(plain))
	r = stored(d)
	must.Eq(t, "", r.Platform)
	must.True(t, r.PlatformKnown, must.Sprint("no platform is not remembered: every lookup reads the configuration"))
	must.NotNil(t, f.store.findDigest(d))
}

// A task recovered on a node whose x86-64 level dropped below its image's
// takes its lease back (its process may still run, and GC must not take
// its layers), while a new start of the image by its digest is refused
// with the platform error, not served from the store.
func TestRecoveredTaskKeepsAnImageAboveTheNodesLevel(t *testing.T) {
	f := newFixture(t)
	v3 := v1.Platform{OS: "linux", Architecture: "amd64", Variant: "v3"}
	f.store.opts.Platform = v3
	img := mustImage(t, imagebuild.Spec{Platform: &v3, Cmd: []string{"x"}}, baseLayer(t))
	ref := f.layout(t, "recovered", "1", img)
	got, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)

	f.store.opts.Platform.Variant = "v2"
	must.NoError(t, f.store.Acquire(context.Background(), Use{TaskID: "alloc/t"}, got.Digest))
	uses, err := f.store.uses()
	must.NoError(t, err)
	must.SliceLen(t, 1, uses)
	must.Eq(t, got.Digest, uses[0].Digest)
	must.Nil(t, f.store.findDigest(got.Digest))
	_, err = f.store.Pull(context.Background(), strings.TrimSuffix(ref, ":1")+"@"+got.Digest, PullRequest{})
	must.ErrorIs(t, err, ErrPlatform)
	must.NoError(t, f.store.Release(context.Background(), "alloc/t"))
}
