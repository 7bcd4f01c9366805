package image

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// Layers and images a hostile job author or registry would serve, beyond
// TestCraftedLayers: each is refused or contained, and leaves the store as
// it was.

// A sparse file is a few KiB in its layer and any size unpacked: its size
// counts against image_max_size, or a tiny layer fills root_dir's disk.
func TestSparseFileIsBoundedByMaxSize(t *testing.T) {
	f := newFixture(t)
	f.store.opts.MaxSize = 64 << 20
	const size = 1 << 30
	layer, err := imagebuild.SparseLayer("bomb", size)
	must.NoError(t, err)
	c, err := layer.Size()
	must.NoError(t, err)
	must.Less(t, int64(64<<10), c)
	ref := f.layout(t, "sparse", "1", mustImage(t, imagebuild.Spec{}, layer))
	_, err = f.store.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrTooLarge)
	must.ErrorContains(t, err, "image_max_size")
	assertEmpty(t, f.store)

	// Within the bound, the file unpacks whole, and its size is the
	// image's.
	small, err := imagebuild.SparseLayer("holes", 8<<20)
	must.NoError(t, err)
	ref = f.layout(t, "sparse-small", "1", mustImage(t, imagebuild.Spec{}, small))
	img, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	b, err := os.ReadFile(filepath.Join(img.Layers[0], "holes"))
	must.NoError(t, err)
	must.Eq(t, 8<<20, len(b))
	must.Eq(t, byte('x'), b[len(b)-1])
	list, err := f.store.List(nil)
	must.NoError(t, err)
	must.SliceLen(t, 1, list)
	must.GreaterEq(t, int64(8<<20), list[0].Size)
}

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
	f.assertRefused(t, refused, victim, outside)

	// Names the kernel refuses (a component over NAME_MAX, a path over
	// PATH_MAX) fail the layer, and leave nothing.
	for name, entry := range map[string]imagebuild.Entry{
		"long component": imagebuild.File(strings.Repeat("n", 300), []byte("x"), 0o644),
		"long path":      imagebuild.File(strings.Repeat("d/", 2100)+"f", []byte("x"), 0o644),
		"long symlink":   imagebuild.Symlink("s", strings.Repeat("t", 5000)),
	} {
		ref := f.layout(t, strings.ReplaceAll(name, " ", "-"), "1", mustImage(t, imagebuild.Spec{}, mustLayer(t, entry)))
		_, err := f.store.Pull(context.Background(), ref, PullRequest{})
		must.ErrorIs(t, err, ErrInvalid, must.Sprint(name))
		assertEmpty(t, f.store)
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

// stallingRegistry is a registry (go-containerregistry's, over plain HTTP)
// that never finishes the blobs of stall in the repositories under prefix:
// a hostile registry that answers slowly for ever.
type stallingRegistry struct {
	host    string
	stall   sync.Map    // digest -> true
	stalled chan string // the path of each blob request it stalls
}

func startStallingRegistry(t *testing.T, prefix string) *stallingRegistry {
	t.Helper()
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	release := make(chan struct{})
	r := &stallingRegistry{stalled: make(chan string, 16)}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, digest, blob := strings.Cut(req.URL.Path, "/blobs/")
		if _, stall := r.stall.Load(digest); stall && blob && req.Method == http.MethodGet && strings.HasPrefix(req.URL.Path, "/v2/"+prefix) {
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte{0x1f})
			w.(http.Flusher).Flush()
			r.stalled <- req.URL.Path
			select {
			case <-release:
			case <-req.Context().Done():
			}
			return
		}
		reg.ServeHTTP(w, req)
	}))
	t.Cleanup(func() {
		close(release)
		srv.Close()
	})
	r.host = strings.TrimPrefix(srv.URL, "http://")
	return r
}

func (r *stallingRegistry) push(t *testing.T, repo string, img v1.Image) string {
	t.Helper()
	ref := r.host + "/" + repo
	tag, err := name.NewTag(ref, name.Insecure)
	must.NoError(t, err)
	must.NoError(t, remote.Write(tag, img))
	return ref
}

// A pull that a registry stalls holds no lock another source's pull of the
// same configuration or layer waits for: a job naming an image of its own
// registry with a popular base layer (or a copy of another job's image)
// would otherwise stop every other pull of that layer on the node for its
// image_pull_timeout.
func TestStalledPullBlocksNoOtherSource(t *testing.T) {
	f := newFixture(t)
	reg := startStallingRegistry(t, "slow/")
	s, err := Open(f.root, Options{InsecureRegistries: []string{reg.host}})
	must.NoError(t, err)
	for _, name := range []string{"configuration", "layer"} {
		t.Run(name, func(t *testing.T) {
			base := mustLayer(t, imagebuild.File("base", []byte(strings.Repeat(name, 1<<12)), 0o644))
			baseDigest, err := base.Digest()
			must.NoError(t, err)
			victim := mustImage(t, imagebuild.Spec{Env: []string{"CASE=" + name}}, base,
				mustLayer(t, imagebuild.File(name, []byte(name), 0o644)))
			// The hostile image is the victim's, byte for byte, its
			// configuration stalled; or one of its own on the
			// victim's base layer, that layer stalled.
			hostile := victim
			if name == "configuration" {
				cd, err := victim.ConfigName()
				must.NoError(t, err)
				reg.stall.Store(cd.String(), true)
			} else {
				hostile = mustImage(t, imagebuild.Spec{Env: []string{"HOSTILE=1"}}, base)
				reg.stall.Store(baseDigest.String(), true)
			}
			slowRef := reg.push(t, "slow/"+name, hostile)
			fastRef := reg.push(t, "fast/"+name, victim)
			hctx, hcancel := context.WithCancel(context.Background())
			defer hcancel()
			done := make(chan error, 1)
			go func() {
				_, err := s.Pull(hctx, slowRef, PullRequest{})
				done <- err
			}()
			select {
			case <-reg.stalled:
			case err := <-done:
				t.Fatalf("the stalled pull ended: %v", err)
			case <-time.After(30 * time.Second):
				t.Fatal("the hostile pull never reached a blob")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			img, err := s.Pull(ctx, fastRef, PullRequest{})
			must.NoError(t, err)
			want, err := victim.Digest()
			must.NoError(t, err)
			must.Eq(t, want.String(), img.Digest)
			hcancel()
			must.Error(t, <-done)
		})
	}
	// The victims' images are whole; the stalled pulls, once their
	// flights end, leave nothing but lock files.
	list, err := s.List(nil)
	must.NoError(t, err)
	must.SliceLen(t, 2, list)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		entries, err := os.ReadDir(filepath.Join(s.Path(), "tmp"))
		must.NoError(t, err)
		if !slices.ContainsFunc(entries, func(e os.DirEntry) bool { return !strings.HasSuffix(e.Name(), ".lock") }) || time.Now().After(deadline) {
			break
		}
	}
	assertTmpClean(t, s)
}

// Two sources unpack one layer side by side: the first to finish gives it
// its name; the other's copy goes, and the pull uses the one there.
func TestLayerFromTwoSourcesIsStoredOnce(t *testing.T) {
	f := newFixture(t)
	layer := baseLayer(t)
	img := mustImage(t, imagebuild.Spec{}, layer)
	refA := f.layout(t, "a", "1", img)
	refB := f.layout(t, "b", "1", img)
	first, err := f.store.Pull(context.Background(), refA, PullRequest{})
	must.NoError(t, err)
	before, err := os.Stat(first.Layers[0])
	must.NoError(t, err)

	// The second source's unpack, as it runs when the first finished
	// while it was under way.
	parsed, err := ParseReference(refB, nil)
	must.NoError(t, err)
	src, err := f.store.openLocal(parsed)
	must.NoError(t, err)
	defer src.close()
	digest, err := layer.Digest()
	must.NoError(t, err)
	size, err := layer.Size()
	must.NoError(t, err)
	mt, err := layer.MediaType()
	must.NoError(t, err)
	diff, err := layer.DiffID()
	must.NoError(t, err)
	b := &bounds{}
	b.size.Store(DefaultMaxSize)
	b.entries.Store(MaxEntries)
	m, made, err := f.store.fetchLayer(context.Background(), parsed, src, v1.Descriptor{Digest: digest, Size: size, MediaType: mt}, diff.String(), b, nil)
	must.NoError(t, err)
	must.False(t, made)
	must.Eq(t, diff.String(), m.DiffID)
	after, err := os.Stat(first.Layers[0])
	must.NoError(t, err)
	must.True(t, os.SameFile(before, after))
	assertTmpClean(t, f.store)

	// And whole pulls from both, at once, in two processes.
	other, err := Open(f.root, Options{LocalDirs: []string{f.images}})
	must.NoError(t, err)
	must.NoError(t, f.store.removeLayer(diff.String()))
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		s, ref := f.store, refA
		if i%2 == 1 {
			s, ref = other, refB
		}
		wg.Go(func() { _, errs[i] = s.Pull(context.Background(), ref, PullRequest{}) })
	}
	wg.Wait()
	for _, err := range errs {
		must.NoError(t, err)
	}
	entries, err := os.ReadDir(filepath.Join(f.store.Path(), "layers"))
	must.NoError(t, err)
	must.SliceLen(t, 1, entries)
	assertTmpClean(t, f.store)
}

// zstdLayer is a zstd-compressed layer of entries whose frame declares
// window (and holds 2 windows of data, which a decoder must keep).
func zstdLayer(t *testing.T, window int, entries ...imagebuild.Entry) v1.Layer {
	t.Helper()
	b, err := imagebuild.Tar(entries...)
	must.NoError(t, err)
	var buf bytes.Buffer
	w, err := zstd.NewWriter(&buf, zstd.WithWindowSize(window), zstd.WithEncoderConcurrency(1))
	must.NoError(t, err)
	_, err = w.Write(b)
	must.NoError(t, err)
	must.NoError(t, w.Close())
	var h zstd.Header
	must.NoError(t, h.Decode(buf.Bytes()))
	must.Eq(t, uint64(window), h.WindowSize)
	return &bytesLayer{compressed: buf.Bytes(), uncompressed: b, mt: types.OCILayerZStd}
}

// bytesLayer is a layer compressed by the test itself.
type bytesLayer struct {
	compressed, uncompressed []byte
	mt                       types.MediaType
}

func hashOf(b []byte) v1.Hash {
	h, _, _ := v1.SHA256(bytes.NewReader(b))
	return h
}

func (l *bytesLayer) Digest() (v1.Hash, error) { return hashOf(l.compressed), nil }
func (l *bytesLayer) DiffID() (v1.Hash, error) { return hashOf(l.uncompressed), nil }
func (l *bytesLayer) Compressed() (io.ReadCloser, error) {
	return io.NopCloser(bytes.NewReader(l.compressed)), nil
}
func (l *bytesLayer) Uncompressed() (io.ReadCloser, error) {
	return io.NopCloser(bytes.NewReader(l.uncompressed)), nil
}
func (l *bytesLayer) Size() (int64, error)                { return int64(len(l.compressed)), nil }
func (l *bytesLayer) MediaType() (types.MediaType, error) { return l.mt, nil }

// A zstd frame names the window its decoder keeps in memory for the whole
// download: one over 128 MiB is refused; one over 8 MiB is taken from the
// store's budget of such windows, so that many hostile pulls at once
// cannot take the driver's memory.
func TestZstdWindowsAreBounded(t *testing.T) {
	f := newFixture(t)
	data := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(i * 7919 >> 3)
		}
		return b
	}
	huge := zstdLayer(t, 256<<20, imagebuild.File("big", data(300<<20), 0o644))
	ref := f.layout(t, "huge-window", "1", mustImage(t, imagebuild.Spec{}, huge))
	_, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrInvalid)
	must.ErrorContains(t, err, "zstd-compressed with a window over the 128 MiB this node decodes")
	assertEmpty(t, f.store)

	big := zstdLayer(t, 32<<20, imagebuild.File("big", data(40<<20), 0o644))
	ref = f.layout(t, "big-window", "1", mustImage(t, imagebuild.Spec{}, big))
	// The budget is taken (by other pulls): this one waits, within its
	// time, and says so when the time is over.
	must.NoError(t, f.store.zstdWindows.Acquire(context.Background(), zstdWindowBudget))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = f.store.Pull(ctx, ref, PullRequest{})
	must.ErrorIs(t, err, ErrUnreachable)
	must.ErrorContains(t, err, "image_pull_timeout")
	f.store.zstdWindows.Release(zstdWindowBudget)
	img, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	fi, err := os.Stat(filepath.Join(img.Layers[0], "big"))
	must.NoError(t, err)
	must.Eq(t, int64(40<<20), fi.Size())
	// Its window went back to the budget.
	must.True(t, f.store.zstdWindows.TryAcquire(zstdWindowBudget))
	f.store.zstdWindows.Release(zstdWindowBudget)
}

// A task whose pull timed out is started again at once (Nomad restarts
// it): its new pull must not join the old one, which every waiter left and
// which is ending, canceled.
func TestPullAfterATimedOutPullStartsAnew(t *testing.T) {
	f := newFixture(t)
	ref := f.layout(t, "app", "1", mustImage(t, imagebuild.Spec{}, baseLayer(t)))
	// The first pull's progress is slow to be told: its flight is still
	// under way when its waiter's time is over.
	stuck, unstick := make(chan struct{}), make(chan struct{})
	var once sync.Once
	slow := func(Progress) {
		once.Do(func() {
			close(stuck)
			<-unstick
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Another pull holds the records meanwhile: the old flight, once on
	// its way again, sees it was canceled while it waits for them.
	var unlockMeta func()
	go func() {
		<-stuck
		var err error
		unlockMeta, err = f.store.lockMeta(context.Background())
		must.NoError(t, err)
		cancel()
	}()
	_, err := f.store.Pull(ctx, ref, PullRequest{Progress: slow})
	must.Error(t, err)
	go func() {
		time.Sleep(300 * time.Millisecond)
		close(unstick)
		time.Sleep(300 * time.Millisecond)
		unlockMeta()
	}()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel2()
	img, err := f.store.Pull(ctx2, ref, PullRequest{})
	must.NoError(t, err)
	must.SliceLen(t, 1, img.Layers)
	assertTmpClean(t, f.store)
}

// A layer this pull found in the store, and that a failed pull of another
// image took away while this one ran (a failed pull removes the layers it
// made that no image has), is fetched again: a hostile job whose pulls
// fail on purpose must not fail another's start.
func TestLayerLostWhilePullingIsFetchedAgain(t *testing.T) {
	f := newFixture(t)
	shared := baseLayer(t)
	diff, err := shared.DiffID()
	must.NoError(t, err)
	// The failed pull made the shared layer and wrote no record.
	first, err := f.store.Pull(context.Background(), f.layout(t, "failed", "1", mustImage(t, imagebuild.Spec{}, shared)), PullRequest{})
	must.NoError(t, err)
	must.NoError(t, os.Remove(f.store.recordPath(first.Digest)))

	ref := f.layout(t, "app", "1", mustImage(t, imagebuild.Spec{}, shared, mustLayer(t, imagebuild.File("app", []byte("app"), 0o644))))
	var once sync.Once
	discard := func(Progress) {
		// While this pull downloads its own layer, the failed one
		// takes away what it made.
		once.Do(func() { f.store.discard([]string{diff.String()}, "") })
	}
	img, err := f.store.Pull(context.Background(), ref, PullRequest{Progress: discard})
	must.NoError(t, err)
	must.SliceLen(t, 2, img.Layers)
	b, err := os.ReadFile(filepath.Join(img.Layers[0], "etc", "os-release"))
	must.NoError(t, err)
	must.Eq(t, "ID=test\n", string(b))
	assertTmpClean(t, f.store)
}

// local_image_dirs that resolve into root_dir, around it, or to the host's
// root (a symlink the operator made, /proc/self/root) are refused when a
// pull opens them: a job would read through them what tasks wrote there
// (their writable layers) as its image. A fifo in them blocks nothing.
func TestLocalImageDirsThatResolveIntoRootDir(t *testing.T) {
	f := newFixture(t)
	// An image archive a task wrote, inside root_dir.
	inside := filepath.Join(f.root, "tasks", "other", "export.tar")
	must.NoError(t, os.MkdirAll(filepath.Dir(inside), 0o755))
	must.NoError(t, imagebuild.WriteOCIArchive(inside, "1", mustImage(t, imagebuild.Spec{}, baseLayer(t))))
	link := filepath.Join(t.TempDir(), "images")
	must.NoError(t, os.Symlink(f.root, link))
	parentLink := filepath.Join(t.TempDir(), "parent")
	must.NoError(t, os.Symlink(filepath.Dir(f.root), parentLink))
	for dir, ref := range map[string]string{
		link:              "oci-archive:" + filepath.Join(link, "tasks", "other", "export.tar"),
		parentLink:        "oci-archive:" + filepath.Join(parentLink, filepath.Base(f.root), "tasks", "other", "export.tar"),
		"/proc/self/root": "oci-archive:/proc/self/root" + inside,
	} {
		s, err := Open(f.root, Options{LocalDirs: []string{dir}})
		must.NoError(t, err)
		_, err = s.Pull(context.Background(), ref, PullRequest{})
		must.ErrorIs(t, err, ErrNotAllowed, must.Sprint(dir))
		must.ErrorContains(t, err, "root_dir")
		assertEmpty(t, s)
	}

	// A fifo where a job names an archive or a layout's file is refused
	// at once: opening it would wait for a writer.
	must.NoError(t, unix.Mkfifo(filepath.Join(f.images, "fifo.tar"), 0o644))
	must.NoError(t, os.MkdirAll(filepath.Join(f.images, "layout"), 0o755))
	must.NoError(t, unix.Mkfifo(filepath.Join(f.images, "layout", "index.json"), 0o644))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, ref := range []string{"oci-archive:" + filepath.Join(f.images, "fifo.tar"), "oci:" + filepath.Join(f.images, "layout")} {
		_, err := f.store.Pull(ctx, ref, PullRequest{})
		must.ErrorIs(t, err, ErrInvalid, must.Sprint(ref))
		must.ErrorContains(t, err, "not a regular file")
	}
	must.NoError(t, ctx.Err())
}

// Entries that name the store's own files, the layer's root, or odd types:
// a whiteout only hides in its own layer (it deletes nothing, of the store
// or of another image), a fifo or a hard link to one or to a whiteout
// stays an entry of the layer (nothing opens it while it unpacks), and a
// root entry that is not a directory, a device number the kernel cannot
// hold or a tar type no layer has is refused.
func TestHostileLayerNamesAndTypes(t *testing.T) {
	f := newFixture(t)
	victimRef := f.layout(t, "victim", "1", mustImage(t, imagebuild.Spec{}, baseLayer(t)))
	victim, err := f.store.Pull(context.Background(), victimRef, PullRequest{})
	must.NoError(t, err)
	victimMeta := filepath.Join(filepath.Dir(victim.Layers[0]), "layer.json")
	meta, err := os.ReadFile(victimMeta)
	must.NoError(t, err)

	fifo := imagebuild.Entry{Header: tar.Header{Typeflag: tar.TypeFifo, Name: "p", Mode: 0o644, ModTime: time.Unix(1700000000, 0)}}
	ref := f.layout(t, "names", "1", mustImage(t, imagebuild.Spec{}, mustLayer(t,
		imagebuild.Whiteout("layer.json"), imagebuild.Whiteout("fs"), imagebuild.Whiteout("etc"),
		fifo, imagebuild.Hardlink("p2", "p"),
		imagebuild.Whiteout("w"), imagebuild.Hardlink("w2", "w"),
		imagebuild.File("suid", []byte("x"), 0o4755),
	)))
	img, err := f.store.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	layer := img.Layers[0]
	for _, name := range []string{"layer.json", "fs", "w", "w2"} {
		var st unix.Stat_t
		must.NoError(t, unix.Lstat(filepath.Join(layer, name), &st), must.Sprint(name))
		must.Eq(t, uint32(unix.S_IFCHR), st.Mode&unix.S_IFMT, must.Sprint(name))
		must.Eq(t, uint64(0), st.Rdev, must.Sprint(name))
	}
	var p, p2 unix.Stat_t
	must.NoError(t, unix.Lstat(filepath.Join(layer, "p"), &p))
	must.NoError(t, unix.Lstat(filepath.Join(layer, "p2"), &p2))
	must.Eq(t, uint32(unix.S_IFIFO), p.Mode&unix.S_IFMT)
	must.Eq(t, p.Ino, p2.Ino)
	// The victim image and the store's own files are as they were.
	got, err := os.ReadFile(victimMeta)
	must.NoError(t, err)
	must.Eq(t, string(meta), string(got))
	b, err := os.ReadFile(filepath.Join(victim.Layers[0], "etc", "os-release"))
	must.NoError(t, err)
	must.Eq(t, "ID=test\n", string(b))
	again, err := f.store.Pull(context.Background(), victimRef, PullRequest{})
	must.NoError(t, err)
	must.Eq(t, victim.Digest, again.Digest)

	refused := map[string]imagebuild.Entry{
		"root as file":        imagebuild.File(".", nil, 0o644),
		"root as symlink":     imagebuild.Symlink(".", "/"),
		"device major":        imagebuild.CharDevice("d", 1<<12, 0),
		"device minor":        imagebuild.CharDevice("d", 1, 1<<20),
		"negative owner":      {Header: tar.Header{Typeflag: tar.TypeReg, Name: "o", Uid: -1, Mode: 0o644}},
		"owner of the kernel": {Header: tar.Header{Typeflag: tar.TypeReg, Name: "o", Uid: 1<<32 - 1, Mode: 0o644}},
		"volume header":       {Header: tar.Header{Typeflag: 'V', Name: "v", Mode: 0o644}},
		"contiguous file":     {Header: tar.Header{Typeflag: tar.TypeCont, Name: "c", Mode: 0o644}},
	}
	for name, e := range refused {
		t.Run(name, func(t *testing.T) {
			ref := f.layout(t, strings.ReplaceAll(name, " ", "-"), "1", mustImage(t, imagebuild.Spec{}, mustLayer(t, e)))
			_, err := f.store.Pull(context.Background(), ref, PullRequest{})
			must.Error(t, err)
			must.ErrorIs(t, err, ErrUnsafeLayer)
			got, err := os.ReadFile(victimMeta)
			must.NoError(t, err)
			must.Eq(t, string(meta), string(got))
		})
	}
}
