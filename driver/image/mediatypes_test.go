package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// dockerImage is img as `docker push` (and registry.k8s.io's images)
// serve it: a Docker schema 2 manifest naming a Docker configuration and
// Docker (gzip) layers.
func dockerImage(t *testing.T, spec imagebuild.Spec, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(mutate.MediaType(empty.Image, types.DockerManifestSchema2), layers...)
	must.NoError(t, err)
	cf, err := img.ConfigFile()
	must.NoError(t, err)
	cf = cf.DeepCopy()
	p := spec.Platform
	if p == nil {
		node := NodePlatform()
		p = &node
	}
	cf.OS, cf.Architecture, cf.Variant = p.OS, p.Architecture, p.Variant
	cf.Config.Entrypoint, cf.Config.Cmd = spec.Entrypoint, spec.Cmd
	img, err = mutate.ConfigFile(img, cf)
	must.NoError(t, err)
	img = mutate.ConfigMediaType(img, types.DockerConfigJSON)
	m, err := img.Manifest()
	must.NoError(t, err)
	must.Eq(t, types.DockerManifestSchema2, m.MediaType)
	must.Eq(t, types.DockerConfigJSON, m.Config.MediaType)
	for _, l := range m.Layers {
		must.Eq(t, types.DockerLayer, l.MediaType)
	}
	return img
}

// A multi-platform image as buildx pushes it: a Docker manifest list (or
// an OCI index) of Docker schema 2 images, arm variants, and attestation
// manifests (platform unknown/unknown) beside each image. The node's own
// image is picked, whatever the order.
func TestPullDockerManifestList(t *testing.T) {
	f := newFixture(t)
	node := NodePlatform()
	b, err := imagebuild.Tar(imagebuild.File("bin/plugin", []byte("p"), 0o755))
	must.NoError(t, err)
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithMediaType(types.DockerLayer))
	must.NoError(t, err)
	mk := func(p v1.Platform, cmd string) v1.Image {
		return dockerImage(t, imagebuild.Spec{Platform: &p, Cmd: []string{cmd}}, layer)
	}
	here := mk(node, "here")
	others := []v1.Platform{
		{OS: "linux", Architecture: "arm", Variant: "v6"},
		{OS: "linux", Architecture: "arm", Variant: "v7"},
		{OS: "linux", Architecture: "arm64", Variant: "v8"},
		{OS: "linux", Architecture: "amd64"},
		{OS: "linux", Architecture: "ppc64le"},
		{OS: "windows", Architecture: node.Architecture},
	}
	attestation := mustImage(t, imagebuild.Spec{Platform: &v1.Platform{OS: "unknown", Architecture: "unknown"}},
		mustLayer(t, imagebuild.File("provenance.json", []byte("{}"), 0o644)))
	var adds []mutate.IndexAddendum
	for _, p := range others {
		if p.OS == node.OS && p.Architecture == node.Architecture && p.Variant == node.Variant {
			continue
		}
		adds = append(adds, mutate.IndexAddendum{Add: mk(p, "there"), Descriptor: v1.Descriptor{Platform: &p}})
	}
	adds = append(adds,
		mutate.IndexAddendum{Add: attestation, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "unknown", Architecture: "unknown"},
			Annotations: map[string]string{"vnd.docker.reference.type": "attestation-manifest"}}},
		mutate.IndexAddendum{Add: here, Descriptor: v1.Descriptor{Platform: &node}})

	for _, mt := range []types.MediaType{types.DockerManifestList, types.OCIImageIndex} {
		t.Run(string(mt), func(t *testing.T) {
			idx := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, mt), adds...)
			im, err := idx.IndexManifest()
			must.NoError(t, err)
			must.Eq(t, mt, im.MediaType)
			dir := filepath.Base(t.Name())
			img, err := f.store.Pull(context.Background(), f.layout(t, dir, "1", idx), PullRequest{})
			must.NoError(t, err)
			must.Eq(t, []string{"here"}, img.Config.Cmd)
			want, err := here.Digest()
			must.NoError(t, err)
			must.Eq(t, want.String(), img.Digest)
			b, err := os.ReadFile(filepath.Join(img.Layers[0], "bin/plugin"))
			must.NoError(t, err)
			must.Eq(t, "p", string(b))
		})
	}

	// The single-platform Docker image by itself.
	img, err := f.store.Pull(context.Background(), f.layout(t, "single", "1", here), PullRequest{})
	must.NoError(t, err)
	must.Eq(t, []string{"here"}, img.Config.Cmd)
}

// A layer compressed other than with gzip or zstd (xz and bzip2, which
// Docker once wrote; lz4) is refused naming the compression and the layer's
// media type, as containerd refuses it, not with a tar reader's complaint
// about the bytes. A plain tar whose first file's name starts like one of
// those magics is still a tar.
func TestUnsupportedCompressionIsNamed(t *testing.T) {
	f := newFixture(t)
	for _, tc := range []struct {
		name  string
		magic []byte
	}{
		{"xz", []byte{0xfd, '7', 'z', 'X', 'Z', 0x00}},
		{"bzip2", []byte("BZh91AY&SY")},
		{"lz4", []byte{0x04, 0x22, 0x4d, 0x18}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			blob := append(append([]byte(nil), tc.magic...), bytes.Repeat([]byte{0x5a}, 600)...)
			l := static.NewLayer(blob, types.OCILayer)
			ref := f.layout(t, tc.name, "1", mustImage(t, imagebuild.Spec{}, baseLayer(t), l))
			_, err := f.store.Pull(context.Background(), ref, PullRequest{})
			must.ErrorIs(t, err, ErrInvalid)
			must.ErrorContains(t, err, tc.name+"-compressed")
			must.ErrorContains(t, err, string(types.OCILayer))
			must.ErrorContains(t, err, "gzip or zstd")
		})
	}
	b, err := imagebuild.Tar(imagebuild.File("BZh91AY&SY", []byte("a tar"), 0o644))
	must.NoError(t, err)
	img, err := f.store.Pull(context.Background(), f.layout(t, "tar", "1", mustImage(t, imagebuild.Spec{}, static.NewLayer(b, types.OCIUncompressedLayer))), PullRequest{})
	must.NoError(t, err)
	got, err := os.ReadFile(filepath.Join(img.Layers[0], "BZh91AY&SY"))
	must.NoError(t, err)
	must.Eq(t, "a tar", string(got))

	// A pre-POSIX (v7) tar has no "ustar" magic: its header's checksum
	// tells it from a bzip2 stream.
	v7 := static.NewLayer(v7Tar("BZh91AY&SY", "a v7 tar", false), types.OCIUncompressedLayer)
	img, err = f.store.Pull(context.Background(), f.layout(t, "v7tar", "1", mustImage(t, imagebuild.Spec{}, v7)), PullRequest{})
	must.NoError(t, err)
	got, err = os.ReadFile(filepath.Join(img.Layers[0], "BZh91AY&SY"))
	must.NoError(t, err)
	must.Eq(t, "a v7 tar", string(got))
}

// v7Tar is a pre-POSIX tar of one file, name with content: no "ustar"
// magic, only the header's checksum (signed: as some old tars summed the
// bytes) says it is a tar.
func v7Tar(name, content string, signed bool) []byte {
	h := make([]byte, 512)
	copy(h, name)
	copy(h[100:], "0000644\x00")
	copy(h[108:], "0000000\x00")
	copy(h[116:], "0000000\x00")
	copy(h[124:], fmt.Sprintf("%011o\x00", len(content)))
	copy(h[136:], "00000000000\x00")
	copy(h[148:], "        ")
	h[156] = '0'
	sum := 0
	for _, c := range h {
		if signed {
			sum += int(int8(c))
		} else {
			sum += int(c)
		}
	}
	copy(h[148:], fmt.Sprintf("%06o\x00 ", sum))
	body := make([]byte, (len(content)+511)/512*512)
	copy(body, content)
	return append(append(h, body...), make([]byte, 1024)...)
}

// A tar is told by its header's checksum, whatever its first member's
// name or format; a compressed stream, zeros or a header whose checksum
// is off are not tars.
func TestIsTarHeader(t *testing.T) {
	ustar, err := imagebuild.Tar(imagebuild.File("BZh91AY&SY", []byte("a tar"), 0o644))
	must.NoError(t, err)
	bad := v7Tar("BZh91AY&SY", "x", false)
	bad[0] = 'C'
	for _, tc := range []struct {
		name string
		b    []byte
		want bool
	}{
		{"ustar", ustar, true},
		{"v7", v7Tar("BZh91AY&SY", "x", false), true},
		{"v7 signed sum", v7Tar("BZh\xe9\xff", "x", true), true},
		{"bzip2", append([]byte("BZh91AY&SY"), bytes.Repeat([]byte{0x5a}, 600)...), false},
		{"zeros", make([]byte, 1024), false},
		{"short", v7Tar("a", "x", false)[:511], false},
		{"checksum off", bad, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			must.Eq(t, tc.want, isTarHeader(tc.b))
		})
	}
}

// A gzip stream may carry up to 64 KiB of the writer's own bytes in its
// header (FEXTRA: BGZF and seekable gzip writers put an index there; or a
// long FNAME), so its first 512 bytes can pass a tar header's checksum. A
// layer whose media type says gzip and whose bytes begin with gzip's magic
// is read as gzip, never as a plain tar; the same stream served as an
// uncompressed layer is a tar (whose diff id it is not, here).
func TestGzipThatPassesTheTarChecksum(t *testing.T) {
	tarB, err := imagebuild.Tar(imagebuild.File("bin/plugin", []byte("gzipped"), 0o755))
	must.NoError(t, err)
	gz := func(extra []byte) []byte {
		var buf bytes.Buffer
		zw := gzip.NewWriter(&buf)
		zw.Extra = extra
		_, err := zw.Write(tarB)
		must.NoError(t, err)
		must.NoError(t, zw.Close())
		return buf.Bytes()
	}
	// FEXTRA starts at byte 12 (after the 10-byte header and XLEN): its
	// bytes 136 to 143 are the sniffed block's checksum field.
	extra := bytes.Repeat([]byte{'a'}, 600)
	b := gz(extra)
	sum := 0
	for i, c := range b[:512] {
		if i >= 148 && i < 156 {
			c = ' '
		}
		sum += int(c)
	}
	copy(extra[136:], fmt.Sprintf("%06o\x00 ", sum))
	b = gz(extra)
	must.True(t, isTarHeader(b), must.Sprint("the crafted gzip stream does not pass the tar checksum"))
	zr, err := gzip.NewReader(bytes.NewReader(b))
	must.NoError(t, err)
	got, err := io.ReadAll(zr)
	must.NoError(t, err)
	must.Eq(t, tarB, got)

	for _, mt := range []types.MediaType{types.OCILayer, types.DockerLayer} {
		t.Run(string(mt), func(t *testing.T) {
			f := newFixture(t)
			l := &bytesLayer{compressed: b, uncompressed: tarB, mt: mt}
			img, err := f.store.Pull(context.Background(), f.layout(t, "bgzf", "1", mustImage(t, imagebuild.Spec{}, l)), PullRequest{})
			must.NoError(t, err)
			got, err := os.ReadFile(filepath.Join(img.Layers[0], "bin/plugin"))
			must.NoError(t, err)
			must.Eq(t, "gzipped", string(got))
		})
	}
	t.Run("uncompressed", func(t *testing.T) {
		f := newFixture(t)
		l := &bytesLayer{compressed: b, uncompressed: b, mt: types.OCIUncompressedLayer}
		_, err := f.store.Pull(context.Background(), f.layout(t, "bgzf", "1", mustImage(t, imagebuild.Spec{}, l)), PullRequest{})
		must.ErrorContains(t, err, "tar")
	})
}

// A zstd frame whose block is a raw one (as zstd writes data it cannot
// compress) carries the tar's bytes as they are, 10 bytes on: a tar made
// for it puts the octal of the first 512 bytes' sum where the sniffed
// block's checksum field is. A layer whose media type says zstd and whose
// bytes begin with zstd's magic is read as zstd, never as a plain tar.
func TestZstdThatPassesTheTarChecksum(t *testing.T) {
	// A v7 tar of one file named f<c1><c2>, mtime "0000DDDDDD0": bytes
	// 138 to 145 of the tar are bytes 148 to 155 of the frame.
	build := func(c1, c2 byte, d int) (tarB, frame []byte) {
		h := make([]byte, 512)
		copy(h, []byte{'f', c1, c2})
		copy(h[100:], "0000644\x00")
		copy(h[108:], "0000000\x00")
		copy(h[116:], "0000000\x00")
		copy(h[124:], "00000000001\x00")
		copy(h[136:], fmt.Sprintf("0000%06o0\x00", d))
		copy(h[148:], "        ")
		h[156] = '0'
		sum := 0
		for _, c := range h {
			sum += int(c)
		}
		copy(h[148:], fmt.Sprintf("%06o\x00 ", sum))
		body := make([]byte, 512)
		body[0] = 'z'
		tarB = append(append(h, body...), make([]byte, 1024)...)
		size := len(tarB)
		// Single segment, a 2-byte content size (less 256), one last raw
		// block.
		frame = []byte{0x28, 0xb5, 0x2f, 0xfd, 0x60, byte(size - 256), byte((size - 256) >> 8)}
		bh := size<<3 | 1
		frame = append(frame, byte(bh), byte(bh>>8), byte(bh>>16))
		return tarB, append(frame, tarB...)
	}
	var tarB, frame []byte
	for c1 := byte('a'); c1 <= 'z' && frame == nil; c1++ {
		for c2 := byte('a'); c2 <= 'z' && frame == nil; c2++ {
			var tb []byte
			_, fr := build(c1, c2, 0)
			sum := 0
			for i, c := range fr[:512] {
				if i < 148 || i >= 156 {
					sum += int(c)
				}
			}
			// The sum moves with d's digits (and so the tar's own
			// checksum): look near it.
			for d := max(sum-200, 0); d < sum+600 && d < 0o1000000; d++ {
				if tb, fr = build(c1, c2, d); isTarHeader(fr) {
					tarB, frame = tb, fr
					break
				}
			}
		}
	}
	must.NotNil(t, frame, must.Sprint("no zstd frame that passes the tar checksum was found"))
	zr, err := zstd.NewReader(bytes.NewReader(frame))
	must.NoError(t, err)
	got, err := io.ReadAll(zr)
	zr.Close()
	must.NoError(t, err)
	must.Eq(t, tarB, got)
	plain, err := firstMember(tarB)
	must.NoError(t, err)

	f := newFixture(t)
	l := &bytesLayer{compressed: frame, uncompressed: tarB, mt: types.OCILayerZStd}
	img, err := f.store.Pull(context.Background(), f.layout(t, "raw", "1", mustImage(t, imagebuild.Spec{}, l)), PullRequest{})
	must.NoError(t, err)
	b, err := os.ReadFile(filepath.Join(img.Layers[0], plain))
	must.NoError(t, err)
	must.Eq(t, "z", string(b))
}

// firstMember is the name of the first member of a tar.
func firstMember(b []byte) (string, error) {
	tr := tar.NewReader(bytes.NewReader(b))
	h, err := tr.Next()
	if err != nil {
		return "", err
	}
	return h.Name, nil
}

// An arm node takes its own variant first and then each older one, as
// containerd's matcher does (a v7 core runs v6 and v5 code; an arm image
// without a variant is a v7 one), never a newer one; an arm64 node takes
// no 32-bit arm image (its kernel may lack AArch32).
func TestPickPlatform_ArmVariants(t *testing.T) {
	ref := Reference{Raw: "example/csi:1"}
	index := func(ps ...v1.Platform) *v1.IndexManifest {
		idx := &v1.IndexManifest{}
		for i, p := range ps {
			p := p
			idx.Manifests = append(idx.Manifests, v1.Descriptor{MediaType: types.OCIManifestSchema1, Platform: &p,
				Digest: v1.Hash{Algorithm: "sha256", Hex: fmt.Sprintf("%064d", i)}})
		}
		return idx
	}
	arm := func(v string) v1.Platform { return v1.Platform{OS: "linux", Architecture: "arm", Variant: v} }
	arm64 := v1.Platform{OS: "linux", Architecture: "arm64", Variant: "v8"}
	for _, tc := range []struct {
		name string
		node v1.Platform
		have []v1.Platform
		want string // the variant picked, "-" for none
	}{
		{"v7 takes v6", arm("v7"), []v1.Platform{arm("v6")}, "v6"},
		{"v7 takes v5", arm("v7"), []v1.Platform{arm("v5")}, "v5"},
		{"v7 prefers its own", arm("v7"), []v1.Platform{arm("v5"), arm("v7"), arm("v6")}, "v7"},
		{"v7 prefers the closest", arm("v7"), []v1.Platform{arm("v5"), arm("v6")}, "v6"},
		{"v7 prefers a named v7 to none", arm("v7"), []v1.Platform{arm(""), arm("v7")}, "v7"},
		{"no variant is v7", arm("v7"), []v1.Platform{arm("")}, ""},
		{"v7 never takes v8", arm("v7"), []v1.Platform{arm("v8")}, "-"},
		{"v6 never takes v7", arm("v6"), []v1.Platform{arm("v7"), arm("")}, "-"},
		{"v6 takes v5", arm("v6"), []v1.Platform{arm("v7"), arm("v5")}, "v5"},
		{"an unknown variant", arm("v7"), []v1.Platform{arm("v9"), arm("v7.1"), arm("x7")}, "-"},
		{"arm64 takes no arm", arm64, []v1.Platform{arm("v7"), arm("v6")}, "-"},
		{"arm64 takes v8", arm64, []v1.Platform{arm("v7"), {OS: "linux", Architecture: "arm64"}}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := pickPlatform(ref, index(tc.have...), tc.node)
			if tc.want == "-" {
				must.ErrorIs(t, err, ErrPlatform)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, got.Platform.Variant)
		})
	}
}

// An amd64 node takes the image for its CPU's x86-64 level first, then
// each lower one (an amd64 image without a variant is a v1 one), never a
// higher one: an image built for x86-64-v3 dies of SIGILL on a v2 CPU. An
// index of v2 and v3 images, none plain, is one buildx pushes for
// "linux/amd64/v2,linux/amd64/v3".
func TestPickPlatform_AMD64Levels(t *testing.T) {
	ref := Reference{Raw: "example/csi:1"}
	index := func(ps ...v1.Platform) *v1.IndexManifest {
		idx := &v1.IndexManifest{}
		for i, p := range ps {
			idx.Manifests = append(idx.Manifests, v1.Descriptor{MediaType: types.OCIManifestSchema1, Platform: &p,
				Digest: v1.Hash{Algorithm: "sha256", Hex: fmt.Sprintf("%064d", i)}})
		}
		return idx
	}
	amd64 := func(v string) v1.Platform { return v1.Platform{OS: "linux", Architecture: "amd64", Variant: v} }
	for _, tc := range []struct {
		name string
		node v1.Platform
		have []v1.Platform
		want string // the variant picked, "-" for none
	}{
		{"v2 node takes v2 of v2 and v3", amd64("v2"), []v1.Platform{amd64("v3"), amd64("v2")}, "v2"},
		{"v3 node takes v3", amd64("v3"), []v1.Platform{amd64("v2"), amd64("v3")}, "v3"},
		{"v4 node takes the closest", amd64("v4"), []v1.Platform{amd64("v2"), amd64("v3")}, "v3"},
		{"v3 node prefers v3 to plain", amd64("v3"), []v1.Platform{amd64(""), amd64("v3")}, "v3"},
		{"v2 node takes plain", amd64("v2"), []v1.Platform{amd64(""), amd64("v3")}, ""},
		{"v1 node takes v1", amd64("v1"), []v1.Platform{amd64("v2"), amd64("v1")}, "v1"},
		{"v1 node never takes v2", amd64("v1"), []v1.Platform{amd64("v2"), amd64("v3")}, "-"},
		{"v2 node never takes v3", amd64("v2"), []v1.Platform{amd64("v3"), amd64("v4")}, "-"},
		{"a plain node is v1", amd64(""), []v1.Platform{amd64("v2"), amd64("")}, ""},
		{"an unknown variant", amd64("v4"), []v1.Platform{amd64("v5"), amd64("3"), amd64("x86-64-v2")}, "-"},
		{"no 386", amd64("v4"), []v1.Platform{{OS: "linux", Architecture: "386"}}, "-"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := pickPlatform(ref, index(tc.have...), tc.node)
			if tc.want == "-" {
				must.ErrorIs(t, err, ErrPlatform)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, got.Platform.Variant)
		})
	}
}

// An amd64 node's error says what to build: a plain amd64 image runs on
// every amd64 node, so that, or one of a level the node runs, is what it
// asks for, never its own level alone (a v4 node asking for "amd64/v4"
// images sends an operator to build images most nodes cannot run).
func TestPickPlatform_AMD64Advice(t *testing.T) {
	ref := Reference{Raw: "example/csi:1"}
	arm64 := v1.Platform{OS: "linux", Architecture: "arm64"}
	idx := &v1.IndexManifest{Manifests: []v1.Descriptor{{MediaType: types.OCIManifestSchema1, Platform: &arm64,
		Digest: v1.Hash{Algorithm: "sha256", Hex: fmt.Sprintf("%064d", 1)}}}}
	for node, want := range map[string]string{
		"v4": "use an image built for linux/amd64 (or for an x86-64 level up to linux/amd64/v4)",
		"v2": "use an image built for linux/amd64 (or for an x86-64 level up to linux/amd64/v2)",
		"v1": "use an image built for linux/amd64",
	} {
		_, err := pickPlatform(ref, idx, v1.Platform{OS: "linux", Architecture: "amd64", Variant: node})
		must.ErrorIs(t, err, ErrPlatform)
		must.ErrorContains(t, err, "this node's platform linux/amd64/"+node+" (it has linux/arm64)")
		must.StrHasSuffix(t, want, err.Error())
	}
	// Other nodes ask for their own platform, as before.
	_, err := pickPlatform(ref, idx, v1.Platform{OS: "linux", Architecture: "arm", Variant: "v7"})
	must.StrHasSuffix(t, "use an image built for linux/arm/v7", err.Error())
}

// The x86-64 levels: each needs every feature of its own and those below
// (a CPU whose kernel does not save AVX registers is v2, whatever else it
// has).
func TestAMD64Level(t *testing.T) {
	v2 := x86Features{CX16: true, LAHF: true, POPCNT: true, SSE3: true, SSE41: true, SSE42: true, SSSE3: true}
	v3 := v2
	v3.AVX, v3.AVX2, v3.BMI1, v3.BMI2, v3.F16C, v3.FMA, v3.LZCNT, v3.MOVBE, v3.OSXSAVE = true, true, true, true, true, true, true, true, true
	v4 := v3
	v4.AVX512F, v4.AVX512BW, v4.AVX512CD, v4.AVX512DQ, v4.AVX512VL = true, true, true, true, true
	must.Eq(t, 1, amd64Level(x86Features{}))
	must.Eq(t, 2, amd64Level(v2))
	must.Eq(t, 3, amd64Level(v3))
	must.Eq(t, 4, amd64Level(v4))
	// One feature short of a level is the level below.
	for _, tc := range []struct {
		level int
		off   func(*x86Features)
	}{
		{1, func(f *x86Features) { f.LAHF = false }},
		{1, func(f *x86Features) { f.CX16 = false }},
		{1, func(f *x86Features) { f.SSE42 = false }},
		{2, func(f *x86Features) { f.LZCNT = false }},
		{2, func(f *x86Features) { f.MOVBE = false }},
		{2, func(f *x86Features) { f.OSXSAVE = false }},
		{2, func(f *x86Features) { f.AVX = false }},
		{3, func(f *x86Features) { f.AVX512VL = false }},
	} {
		f := v4
		tc.off(&f)
		must.Eq(t, tc.level, amd64Level(f), must.Sprintf("%+v", f))
	}
	// Features above a missing level count for nothing.
	f := v4
	f.POPCNT = false
	must.Eq(t, 1, amd64Level(f))
	if runtime.GOARCH == "amd64" {
		node := NodePlatform()
		must.StrHasPrefix(t, "v", node.Variant)
		must.Positive(t, amd64Variant(node.Variant))
	}
}
