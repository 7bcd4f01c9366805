// Package imagebuild builds OCI images for tests from files of this host,
// with no network and no container tool: layers are tars made here, images
// are written as an OCI layout, an OCI archive or a `docker save` archive,
// or pushed to a registry.
//
// Typical use:
//
//	files, _ := imagebuild.HostFiles(map[string]string{"/usr/local/bin/plugin": bin}, "/sbin/losetup")
//	layer, _ := imagebuild.Layer(files...)
//	img, _ := imagebuild.Build(imagebuild.Spec{Entrypoint: []string{"/usr/local/bin/plugin"}}, layer)
//	_ = imagebuild.WriteLayout(dir, "1.0", img)
package imagebuild

import (
	"archive/tar"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Entry is one tar entry of a layer: any header a test wants, crafted ones
// included, and the content of a regular file.
type Entry struct {
	Header tar.Header
	Body   []byte
}

// epoch is the time every entry made here carries, so that layers are
// reproducible.
var epoch = time.Unix(1700000000, 0)

// File is a regular file.
func File(name string, body []byte, mode int64) Entry {
	return Entry{Header: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(body)), ModTime: epoch}, Body: body}
}

// Dir is a directory.
func Dir(name string, mode int64) Entry {
	return Entry{Header: tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimSuffix(name, "/") + "/", Mode: mode, ModTime: epoch}}
}

// Symlink is a symbolic link to target, as written.
func Symlink(name, target string) Entry {
	return Entry{Header: tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0o777, ModTime: epoch}}
}

// Hardlink is a hard link to target.
func Hardlink(name, target string) Entry {
	return Entry{Header: tar.Header{Typeflag: tar.TypeLink, Name: name, Linkname: target, Mode: 0o644, ModTime: epoch}}
}

// CharDevice is a character device node.
func CharDevice(name string, major, minor int64) Entry {
	return Entry{Header: tar.Header{Typeflag: tar.TypeChar, Name: name, Mode: 0o666, Devmajor: major, Devminor: minor, ModTime: epoch}}
}

// Whiteout deletes name of the layers below (its OCI spelling).
func Whiteout(name string) Entry {
	return File(path.Join(path.Dir(name), ".wh."+path.Base(name)), nil, 0o644)
}

// Opaque hides what the layers below have in dir.
func Opaque(dir string) Entry { return File(path.Join(dir, ".wh..wh..opq"), nil, 0o644) }

// Tar writes entries as an uncompressed tar, in order.
func Tar(entries ...Entry) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.Header
		if h.Typeflag == tar.TypeReg && h.Size == 0 {
			h.Size = int64(len(e.Body))
		}
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(&h); err != nil {
			return nil, fmt.Errorf("tar entry %q: %w", h.Name, err)
		}
		if _, err := tw.Write(e.Body); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// Layer makes a gzip-compressed layer of entries.
func Layer(entries ...Entry) (v1.Layer, error) {
	b, err := Tar(entries...)
	if err != nil {
		return nil, err
	}
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithMediaType(types.OCILayer))
}

// SparseLayer is a gzip-compressed layer of one PAX (GNU 1.0) sparse file
// named name that reads as size bytes, all holes but its last byte ('x'):
// a few KiB that unpack to size. Go's tar writer does not write sparse
// files, so its headers are written here.
func SparseLayer(name string, size int64) (v1.Layer, error) {
	if size < 1 || len(name) > 80 {
		return nil, fmt.Errorf("sparse file %q of %d bytes: the name must be short, the size positive", name, size)
	}
	recs := paxRecord("GNU.sparse.major", "1") + paxRecord("GNU.sparse.minor", "0") +
		paxRecord("GNU.sparse.name", name) + paxRecord("GNU.sparse.realsize", fmt.Sprint(size))
	var b []byte
	b = append(b, ustarHeader("PaxHeaders/"+name, 'x', int64(len(recs)))...)
	b = append(b, padBlock([]byte(recs))...)
	// The data: the sparse map (one region, the last byte), padded to a
	// block, then that byte.
	data := append(padBlock([]byte(fmt.Sprintf("1\n%d\n1\n", size-1))), 'x')
	b = append(b, ustarHeader("GNUSparseFile.0/"+name, tar.TypeReg, int64(len(data)))...)
	b = append(b, padBlock(data)...)
	b = append(b, make([]byte, 1024)...)
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
}

// ustarHeader is one ustar header block (mode 0644, owner 0:0).
func ustarHeader(name string, typeflag byte, size int64) []byte {
	b := make([]byte, 512)
	copy(b[0:100], name)
	copy(b[100:108], "0000644\x00")
	copy(b[108:116], "0000000\x00")
	copy(b[116:124], "0000000\x00")
	copy(b[124:136], fmt.Sprintf("%011o\x00", size))
	copy(b[136:148], fmt.Sprintf("%011o\x00", epoch.Unix()))
	b[156] = typeflag
	copy(b[257:263], "ustar\x00")
	copy(b[263:265], "00")
	copy(b[148:156], "        ")
	var sum int64
	for _, c := range b {
		sum += int64(c)
	}
	copy(b[148:156], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

func padBlock(b []byte) []byte {
	if r := len(b) % 512; r != 0 {
		b = append(b, make([]byte, 512-r)...)
	}
	return b
}

// paxRecord is one "<len> key=value\n" record, its length counting itself.
func paxRecord(k, v string) string {
	body := " " + k + "=" + v + "\n"
	n := len(body) + 1
	for len(fmt.Sprint(n))+len(body) != n {
		n++
	}
	return fmt.Sprint(n) + body
}

// HostFiles copies files of this host into entries: copy maps a path in the
// image to a host file, paths are copied to the same path. An ELF
// executable brings its interpreter and the shared libraries it needs,
// found as the dynamic loader would in the usual directories. Symlinks are
// followed: the image gets the files. Parent directories are added.
func HostFiles(copy map[string]string, paths ...string) ([]Entry, error) {
	want := map[string]string{}
	for dst, src := range copy {
		want[dst] = src
	}
	for _, p := range paths {
		want[p] = p
	}
	queue := slices.Sorted(mapKeys(want))
	for len(queue) > 0 {
		dst := queue[0]
		queue = queue[1:]
		deps, err := elfDeps(want[dst])
		if err != nil {
			return nil, err
		}
		for _, d := range deps {
			if _, ok := want[d]; !ok {
				want[d] = d
				queue = append(queue, d)
			}
		}
	}
	dirs := map[string]bool{}
	var entries []Entry
	for _, dst := range slices.Sorted(mapKeys(want)) {
		for d := path.Dir(dst); d != "/" && !dirs[d]; d = path.Dir(d) {
			dirs[d] = true
		}
		b, err := os.ReadFile(want[dst])
		if err != nil {
			return nil, err
		}
		fi, err := os.Stat(want[dst])
		if err != nil {
			return nil, err
		}
		entries = append(entries, File(strings.TrimPrefix(dst, "/"), b, int64(fi.Mode().Perm())))
	}
	var dirEntries []Entry
	for _, d := range slices.Sorted(mapKeys(dirs)) {
		dirEntries = append(dirEntries, Dir(strings.TrimPrefix(d, "/"), 0o755))
	}
	return append(dirEntries, entries...), nil
}

func mapKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// libDirs are where the dynamic loader looks, in its order.
var libDirs = []string{"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
	"/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"}

// elfDeps lists the interpreter and the needed libraries of an ELF file
// (none for other files and static binaries).
func elfDeps(file string) ([]string, error) {
	f, err := elf.Open(file)
	if err != nil {
		return nil, nil // not an ELF file
	}
	defer f.Close()
	var out []string
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			b, err := io.ReadAll(p.Open())
			if err != nil {
				return nil, err
			}
			out = append(out, strings.TrimRight(string(b), "\x00"))
		}
	}
	libs, err := f.ImportedLibraries()
	if err != nil {
		return out, nil
	}
	for _, l := range libs {
		found := ""
		for _, d := range libDirs {
			if _, err := os.Stat(filepath.Join(d, l)); err == nil {
				found = filepath.Join(d, l)
				break
			}
		}
		if found == "" {
			return nil, fmt.Errorf("%s needs %s, which is not in %s", file, l, strings.Join(libDirs, ", "))
		}
		out = append(out, found)
	}
	return out, nil
}

// Spec is an image's run configuration and platform (this host's when
// zero).
type Spec struct {
	Entrypoint []string
	Cmd        []string
	Env        []string
	WorkingDir string
	User       string
	// StopSignal is the image's STOPSIGNAL ("" for none).
	StopSignal string
	Platform   *v1.Platform
}

// Build makes an image of layers (lowest first) with spec's configuration.
func Build(spec Spec, layers ...v1.Layer) (v1.Image, error) {
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	p := spec.Platform
	if p == nil {
		p = &v1.Platform{OS: "linux", Architecture: runtime.GOARCH}
	}
	cf.OS, cf.Architecture, cf.Variant = p.OS, p.Architecture, p.Variant
	cf.Created = v1.Time{Time: epoch}
	cf.Config.Entrypoint, cf.Config.Cmd, cf.Config.Env = spec.Entrypoint, spec.Cmd, spec.Env
	cf.Config.WorkingDir, cf.Config.User, cf.Config.StopSignal = spec.WorkingDir, spec.User, spec.StopSignal
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, err
	}
	// An OCI manifest names an OCI configuration and OCI layers: Podman
	// (containers/image) refuses a Docker configuration in one.
	return mutate.ConfigMediaType(mutate.MediaType(img, types.OCIManifestSchema1), types.OCIConfigJSON), nil
}

// Index makes a multi-platform index of images, each under the platform
// its configuration names.
func Index(imgs ...v1.Image) (v1.ImageIndex, error) {
	var adds []mutate.IndexAddendum
	for _, img := range imgs {
		cf, err := img.ConfigFile()
		if err != nil {
			return nil, err
		}
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: cf.Platform()}})
	}
	return mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex), adds...), nil
}

// refName is the annotation naming an image in a layout's index.json.
const refName = "org.opencontainers.image.ref.name"

// WriteLayout writes img (a v1.Image or v1.ImageIndex) into the OCI layout
// dir (created, or added to), named tag when tag is not empty.
func WriteLayout(dir, tag string, img any) error {
	p, err := layout.FromPath(dir)
	if err != nil {
		if p, err = layout.Write(dir, empty.Index); err != nil {
			return err
		}
	}
	var opts []layout.Option
	if tag != "" {
		opts = append(opts, layout.WithAnnotations(map[string]string{refName: tag}))
	}
	switch i := img.(type) {
	case v1.Image:
		return p.AppendImage(i, opts...)
	case v1.ImageIndex:
		return p.AppendIndex(i, opts...)
	}
	return fmt.Errorf("cannot write a %T into a layout", img)
}

// WriteOCIArchive writes img as an OCI archive (a tar of a layout) at file.
func WriteOCIArchive(file, tag string, img any) error {
	dir, err := os.MkdirTemp("", "oci-archive-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := WriteLayout(dir, tag, img); err != nil {
		return err
	}
	return tarDir(dir, file)
}

// tarDir writes the regular files and directories under dir as a tar.
func tarDir(dir, file string) error {
	var entries []Entry
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if fi.IsDir() {
			entries = append(entries, Dir(rel, 0o755))
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		entries = append(entries, File(rel, b, 0o644))
		return nil
	})
	if err != nil {
		return err
	}
	sort.SliceStable(entries, func(i, j int) bool { return entries[i].Header.Name < entries[j].Header.Name })
	b, err := Tar(entries...)
	if err != nil {
		return err
	}
	return os.WriteFile(file, b, 0o644)
}

// WriteDockerArchive writes img as `docker save` does, tagged repoTag.
func WriteDockerArchive(file, repoTag string, img v1.Image) error {
	tag, err := name.NewTag(repoTag)
	if err != nil {
		return err
	}
	return tarball.WriteToFile(file, tag, img)
}

// Registry is where Push sends images: a registry on this host with TLS
// from a test CA and basic auth.
type Registry struct {
	// Host is host:port.
	Host string
	// CAFile is the CA's certificate (PEM).
	CAFile             string
	Username, Password string
}

// Push pushes img (a v1.Image or v1.ImageIndex) as ref ("repo:tag",
// without the registry) and returns the full reference by tag.
func (r Registry) Push(ref string, img any) (string, error) {
	full := r.Host + "/" + ref
	tag, err := name.NewTag(full)
	if err != nil {
		return "", err
	}
	pem, err := os.ReadFile(r.CAFile)
	if err != nil {
		return "", err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return "", errors.New("no certificate in " + r.CAFile)
	}
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.TLSClientConfig = &tls.Config{RootCAs: pool}
	opts := []remote.Option{remote.WithTransport(httpsOnly{base}),
		remote.WithAuth(&authn.Basic{Username: r.Username, Password: r.Password})}
	switch i := img.(type) {
	case v1.Image:
		err = remote.Write(tag, i, opts...)
	case v1.ImageIndex:
		err = remote.WriteIndex(tag, i, opts...)
	default:
		err = fmt.Errorf("cannot push a %T", img)
	}
	return full, err
}

// httpsOnly sends go-containerregistry's plain-HTTP requests (it speaks HTTP
// to loopback registries of its own accord) over HTTPS.
type httpsOnly struct{ next http.RoundTripper }

func (h httpsOnly) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme == "http" {
		req = req.Clone(req.Context())
		req.URL.Scheme = "https"
	}
	return h.next.RoundTrip(req)
}

// FixtureTools are the host programs the e2e fixture plugin runs
// (e2e/csiplugin: mkfs.ext4, resize2fs, losetup) and the files they read.
var FixtureTools = []string{"/usr/sbin/mkfs.ext4", "/usr/sbin/resize2fs", "/usr/sbin/losetup", "/etc/mke2fs.conf"}

// FixturePluginPath is where FixturePlugin puts the plugin in the image.
const FixturePluginPath = "/usr/local/bin/csi-fixture"

// FixturePlugin builds the image of the e2e fixture plugin (its binary at
// bin, build/csi/csi-fixture) with the tools it runs and their libraries,
// copied from this host, in two layers: the tools (a base another image
// can share) and the plugin. Its entrypoint is the plugin.
func FixturePlugin(bin string) (v1.Image, error) {
	tools, err := HostFiles(nil, FixtureTools...)
	if err != nil {
		return nil, err
	}
	base, err := Layer(append(tools, Dir("tmp", 0o1777), Dir("dev", 0o755), Dir("proc", 0o555), Dir("sys", 0o555))...)
	if err != nil {
		return nil, err
	}
	plugin, err := HostFiles(map[string]string{FixturePluginPath: bin})
	if err != nil {
		return nil, err
	}
	top, err := Layer(plugin...)
	if err != nil {
		return nil, err
	}
	return Build(Spec{Entrypoint: []string{FixturePluginPath}, Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}}, base, top)
}
