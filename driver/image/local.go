package image

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// Local sources: an OCI image layout directory, an OCI archive (a tar of
// one) and a `docker save` archive, on the host. A job names them, so they
// are opened only inside the directories the operator lists in
// local_image_dirs, without following a symlink, and only as a directory
// (layout) or a regular file (archive). What is read from them is JSON the
// store parses or content it verifies against a digest; errors never quote
// a file.

// fsys is a read-only tree of files: a layout directory or an archive.
type fsys interface {
	open(name string) (io.ReadCloser, int64, error)
	close() error
}

// maxConfigSize bounds an image's configuration blob.
const maxConfigSize = 8 << 20

// maxArchiveEntries bounds the files of an archive indexed in memory.
const maxArchiveEntries = 1 << 16

// openLocal opens the local source ref names.
func (s *Store) openLocal(ref Reference) (source, error) {
	fs, err := s.openLocalFS(ref)
	if err != nil {
		return nil, err
	}
	var src source
	switch ref.Kind {
	case KindDockerArchive:
		src, err = openDockerArchive(ref, fs)
	default:
		src, err = openOCI(ref, fs)
	}
	if err != nil {
		fs.close()
		return nil, err
	}
	return src, nil
}

// openLocalFS resolves ref.Path below the operator's directory that holds
// it and opens it.
func (s *Store) openLocalFS(ref Reference) (fsys, error) {
	var base, rel string
	for _, d := range s.opts.LocalDirs {
		d = filepath.Clean(d)
		if r, err := filepath.Rel(d, ref.Path); err == nil && r != "." && r != ".." && !strings.HasPrefix(r, "../") {
			base, rel = d, r
			break
		}
	}
	if base == "" {
		if len(s.opts.LocalDirs) == 0 {
			return nil, errorf(ErrNotAllowed, "image %q: this node takes no images from host files; the operator lists the directories that hold them in the plugin option local_image_dirs", ref.Raw)
		}
		return nil, errorf(ErrNotAllowed, "image %q: %s is not inside a directory of the plugin option local_image_dirs (%s); put the image there or name one that is", ref.Raw, ref.Path, strings.Join(s.opts.LocalDirs, ", "))
	}
	dfd, err := unix.Open(base, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, errorf(ErrNotFound, "image %q: the local_image_dirs directory %s cannot be opened (%v)", ref.Raw, base, err)
	}
	defer unix.Close(dfd)
	if err := s.checkLocalDir(dfd, base, ref); err != nil {
		return nil, err
	}
	wantDir := ref.Kind == KindOCILayout
	fd, err := unix.Openat2(dfd, rel, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: resolveFlags})
	if err != nil {
		return nil, localOpenError(ref, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		unix.Close(fd)
		return nil, localOpenError(ref, unix.ELOOP)
	}
	isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	if wantDir != isDir || (!isDir && st.Mode&unix.S_IFMT != unix.S_IFREG) {
		unix.Close(fd)
		want := "a regular file (an archive)"
		if wantDir {
			want = "a directory (an OCI image layout)"
		}
		return nil, errorf(ErrInvalid, "image %q: %s is not %s", ref.Raw, ref.Path, want)
	}
	if isDir {
		return &dirFS{fd: fd, ref: ref}, nil
	}
	f, err := reopen(fd, ref.Path)
	unix.Close(fd)
	if err != nil {
		return nil, err
	}
	tf, err := indexTar(f, ref)
	if err != nil {
		f.Close()
		return nil, err
	}
	return tf, nil
}

// checkLocalDir refuses a local_image_dirs directory that is, as opened
// (symlinks, /proc/self/root and bind mounts resolved), the host's root or
// one that holds root_dir or is inside it: tasks write there (their
// writable layers), and a job would read that as its image. The driver's
// config check sees only the paths as written.
func (s *Store) checkLocalDir(dfd int, base string, ref Reference) error {
	real, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(dfd))
	if err != nil {
		return fmt.Errorf("failed to resolve the local_image_dirs directory %s: %w", base, err)
	}
	root, err := filepath.EvalSymlinks(filepath.Dir(s.dir))
	if err != nil {
		return fmt.Errorf("failed to resolve root_dir %s: %w", filepath.Dir(s.dir), err)
	}
	if real == "/" || mounter.PathWithin(real, root) || mounter.PathWithin(root, real) {
		return errorf(ErrNotAllowed, "image %q: the local_image_dirs directory %s is %s on the host, which is / or holds root_dir %s or is inside it; name a directory of its own",
			ref.Raw, base, real, root)
	}
	return nil
}

func localOpenError(ref Reference, err error) error {
	switch {
	case errors.Is(err, unix.ENOENT):
		return errorf(ErrNotFound, "image %q: %s does not exist; check the path", ref.Raw, ref.Path)
	case errors.Is(err, unix.ELOOP), errors.Is(err, unix.EXDEV), errors.Is(err, unix.ENOTDIR):
		return errorf(ErrNotAllowed, "image %q: %s goes through a symlink; images in local_image_dirs are opened without following symlinks, name the file itself", ref.Raw, ref.Path)
	}
	return errorf(ErrNotFound, "image %q: %s cannot be opened (%v)", ref.Raw, ref.Path, err)
}

// reopen opens an O_PATH fd of a regular file for reading, through its
// /proc/self/fd link: the file the fd is, not a path that may change.
func reopen(fd int, name string) (*os.File, error) {
	rfd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to open %s: %w", name, err)
	}
	return os.NewFile(uintptr(rfd), name), nil
}

// dirFS is an OCI layout directory, opened by fd.
type dirFS struct {
	fd  int
	ref Reference
}

func (d *dirFS) open(name string) (io.ReadCloser, int64, error) {
	fd, err := unix.Openat2(d.fd, name, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: resolveFlags})
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, 0, errorf(ErrNotFound, "image %q: the layout has no %s", d.ref.Raw, name)
		}
		return nil, 0, localOpenError(d.ref, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, 0, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, 0, errorf(ErrInvalid, "image %q: the layout's %s is not a regular file", d.ref.Raw, name)
	}
	f, err := reopen(fd, name)
	if err != nil {
		return nil, 0, err
	}
	return f, st.Size, nil
}

func (d *dirFS) close() error { return unix.Close(d.fd) }

// tarFS is an archive: the offsets of its regular files, read in place.
type tarFS struct {
	f       *os.File
	entries map[string][2]int64 // name -> offset, size
}

func indexTar(f *os.File, ref Reference) (*tarFS, error) {
	t := &tarFS{f: f, entries: map[string][2]int64{}}
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, errorf(ErrInvalid, "image %q: %s is not a tar archive (or is damaged)", ref.Raw, ref.Path)
		}
		if hdr.Typeflag != tar.TypeReg {
			continue
		}
		if _, sparse := hdr.PAXRecords["GNU.sparse.major"]; sparse {
			continue
		}
		off, err := f.Seek(0, io.SeekCurrent)
		if err != nil {
			return nil, err
		}
		if len(t.entries) >= maxArchiveEntries {
			return nil, errorf(ErrTooLarge, "image %q: %s holds more than %d files; an image archive holds a few", ref.Raw, ref.Path, maxArchiveEntries)
		}
		t.entries[strings.TrimPrefix(path.Clean("/"+hdr.Name), "/")] = [2]int64{off, hdr.Size}
	}
	return t, nil
}

func (t *tarFS) open(name string) (io.ReadCloser, int64, error) {
	e, ok := t.entries[name]
	if !ok {
		return nil, 0, errorf(ErrNotFound, "the archive has no %s", name)
	}
	return io.NopCloser(io.NewSectionReader(t.f, e[0], e[1])), e[1], nil
}

func (t *tarFS) close() error { return t.f.Close() }

// readSmall reads a JSON file of at most limit bytes from fs.
func readSmall(fs fsys, name string, limit int64) ([]byte, error) {
	rc, size, err := fs.open(name)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	if size > limit {
		return nil, errorf(ErrTooLarge, "%s is %d bytes, over the %d a file of its kind may have", name, size, limit)
	}
	return io.ReadAll(io.LimitReader(rc, limit))
}

// readVerified reads the blob d from an OCI layout, checking its digest.
func readVerified(fs fsys, ref Reference, d v1.Hash, limit int64) ([]byte, error) {
	b, err := readSmall(fs, blobPath(d), limit)
	if err != nil {
		return nil, err
	}
	if sum := sha256.Sum256(b); d.Algorithm != "sha256" || hex.EncodeToString(sum[:]) != d.Hex {
		return nil, errorf(ErrDigestMismatch, "image %q: blob %s does not match its digest; the layout is damaged or was changed", ref.Raw, d)
	}
	return b, nil
}

func blobPath(d v1.Hash) string { return "blobs/" + d.Algorithm + "/" + d.Hex }

// ociSource is an OCI layout, as a directory or an archive.
type ociSource struct {
	ref Reference
	fs  fsys
	// sel is the descriptor the reference picked in index.json; nil when
	// index.json itself is the index to resolve (several platforms).
	sel      *v1.Descriptor
	indexRaw []byte
}

// refNameAnnotations name an image in a layout's index.json: the OCI
// annotation, and containerd's full name.
var refNameAnnotations = []string{"org.opencontainers.image.ref.name", "io.containerd.image.name"}

func openOCI(ref Reference, fs fsys) (*ociSource, error) {
	raw, err := readSmall(fs, "index.json", maxManifestSize)
	if err != nil {
		if errors.Is(err, ErrNotFound) {
			return nil, errorf(ErrInvalid, "image %q: %s is not an OCI image layout (no index.json)", ref.Raw, ref.Path)
		}
		return nil, err
	}
	var idx v1.IndexManifest
	if json.Unmarshal(raw, &idx) != nil {
		return nil, errorf(ErrInvalid, "image %q: the index.json of %s is not valid JSON", ref.Raw, ref.Path)
	}
	o := &ociSource{ref: ref, fs: fs, indexRaw: raw}
	switch {
	case ref.Digest != "":
		h, _ := v1.NewHash(ref.Digest)
		o.sel = &v1.Descriptor{Digest: h}
		for i := range idx.Manifests {
			if idx.Manifests[i].Digest == h {
				o.sel = &idx.Manifests[i]
			}
		}
	case ref.Tag != "":
		var names []string
		for i, m := range idx.Manifests {
			for _, a := range refNameAnnotations {
				n := m.Annotations[a]
				if n == "" {
					continue
				}
				if n == ref.Tag || strings.HasSuffix(n, ":"+ref.Tag) && a != refNameAnnotations[0] {
					o.sel = &idx.Manifests[i]
				}
				if a == refNameAnnotations[0] && len(names) < 8 {
					names = append(names, strconv.Quote(n))
				}
			}
			if o.sel != nil {
				break
			}
		}
		if o.sel == nil {
			return nil, errorf(ErrNotFound, "image %q: %s has no image named %q (it has %s)", ref.Raw, ref.Path, ref.Tag, orNone(names))
		}
	case len(idx.Manifests) == 1:
		o.sel = &idx.Manifests[0]
	case len(idx.Manifests) == 0:
		return nil, errorf(ErrInvalid, "image %q: %s holds no image", ref.Raw, ref.Path)
	default:
		for _, m := range idx.Manifests {
			if m.Platform == nil {
				return nil, errorf(ErrInvalid, "image %q: %s holds %d images; name one with :<name>", ref.Raw, ref.Path, len(idx.Manifests))
			}
		}
		// Several platforms of one image: index.json is its index.
	}
	return o, nil
}

func orNone(names []string) string {
	if len(names) == 0 {
		return "no named image"
	}
	return strings.Join(names, ", ")
}

func (o *ociSource) top(context.Context) ([]byte, types.MediaType, error) {
	if o.sel == nil {
		return o.indexRaw, types.OCIImageIndex, nil
	}
	b, err := readVerified(o.fs, o.ref, o.sel.Digest, maxManifestSize)
	return b, o.sel.MediaType, err
}

func (o *ociSource) manifest(_ context.Context, d v1.Hash) ([]byte, types.MediaType, error) {
	b, err := readVerified(o.fs, o.ref, d, maxManifestSize)
	return b, "", err
}

func (o *ociSource) blob(_ context.Context, d v1.Descriptor) (io.ReadCloser, error) {
	rc, _, err := o.fs.open(blobPath(d.Digest))
	return rc, err
}

func (o *ociSource) close() error { return o.fs.close() }

// dockerSource is a `docker save` archive: manifest.json names the config
// and the layer files of each image; the store sees them as one Docker
// schema 2 manifest made from them.
type dockerSource struct {
	ref   Reference
	fs    fsys
	synth []byte
	files map[v1.Hash]string
}

func openDockerArchive(ref Reference, fs fsys) (*dockerSource, error) {
	raw, err := readSmall(fs, "manifest.json", maxManifestSize)
	if err != nil {
		if errors.Is(err, ErrNotFound) {
			return nil, errorf(ErrInvalid, "image %q: %s is not a docker save archive (no manifest.json)", ref.Raw, ref.Path)
		}
		return nil, err
	}
	var entries []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if json.Unmarshal(raw, &entries) != nil {
		return nil, errorf(ErrInvalid, "image %q: the manifest.json of %s is not valid JSON", ref.Raw, ref.Path)
	}
	pick := -1
	switch {
	case ref.Tag != "":
		want := ref.Tag
		if !strings.Contains(want, ":") {
			want += ":latest"
		}
		for i, e := range entries {
			for _, t := range e.RepoTags {
				if t == want || strings.TrimPrefix(t, "docker.io/library/") == want {
					pick = i
				}
			}
		}
		if pick < 0 {
			return nil, errorf(ErrNotFound, "image %q: %s has no image tagged %q", ref.Raw, ref.Path, want)
		}
	case ref.Digest != "":
		return nil, errorf(ErrInvalid, "image %q: a docker save archive has no manifest digests; name the image by its tag or by none", ref.Raw)
	case len(entries) == 1:
		pick = 0
	default:
		return nil, errorf(ErrInvalid, "image %q: %s holds %d images; name one with :<repository:tag>", ref.Raw, ref.Path, len(entries))
	}
	e := entries[pick]
	clean := func(p string) string { return strings.TrimPrefix(path.Clean("/"+p), "/") }
	cfgRaw, err := readSmall(fs, clean(e.Config), maxConfigSize)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(cfgRaw)
	cfgHash := v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(sum[:])}
	var cfg v1.ConfigFile
	if json.Unmarshal(cfgRaw, &cfg) != nil {
		return nil, errorf(ErrInvalid, "image %q: the image configuration in %s is not valid JSON", ref.Raw, ref.Path)
	}
	if len(cfg.RootFS.DiffIDs) != len(e.Layers) {
		return nil, errorf(ErrInvalid, "image %q: %s names %d layers but its configuration %d", ref.Raw, ref.Path, len(e.Layers), len(cfg.RootFS.DiffIDs))
	}
	d := &dockerSource{ref: ref, fs: fs, files: map[v1.Hash]string{cfgHash: clean(e.Config)}}
	m := v1.Manifest{SchemaVersion: 2, MediaType: types.DockerManifestSchema2,
		Config: v1.Descriptor{MediaType: types.DockerConfigJSON, Size: int64(len(cfgRaw)), Digest: cfgHash}}
	for i, l := range e.Layers {
		name := clean(l)
		_, size, err := fs.open(name)
		if err != nil {
			return nil, err
		}
		// A layer file named by its digest (newer docker) is that blob;
		// an older one's "<id>/layer.tar" is the uncompressed tar, whose
		// digest is the diff id.
		h := cfg.RootFS.DiffIDs[i]
		if hx, ok := strings.CutPrefix(name, "blobs/sha256/"); ok && digestRE.MatchString("sha256:"+hx) {
			h = v1.Hash{Algorithm: "sha256", Hex: hx}
		}
		d.files[h] = name
		m.Layers = append(m.Layers, v1.Descriptor{MediaType: types.DockerUncompressedLayer, Size: size, Digest: h})
	}
	if d.synth, err = json.Marshal(m); err != nil {
		return nil, err
	}
	return d, nil
}

func (d *dockerSource) top(context.Context) ([]byte, types.MediaType, error) {
	return d.synth, types.DockerManifestSchema2, nil
}

func (d *dockerSource) manifest(context.Context, v1.Hash) ([]byte, types.MediaType, error) {
	return nil, "", errorf(ErrInvalid, "image %q: a docker save archive holds no image index", d.ref.Raw)
}

func (d *dockerSource) blob(_ context.Context, desc v1.Descriptor) (io.ReadCloser, error) {
	name, ok := d.files[desc.Digest]
	if !ok {
		return nil, errorf(ErrNotFound, "image %q: the archive has no blob %s", d.ref.Raw, desc.Digest)
	}
	rc, _, err := d.fs.open(name)
	return rc, err
}

func (d *dockerSource) close() error { return d.fs.close() }
