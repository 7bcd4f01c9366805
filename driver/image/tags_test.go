package image

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// tagRegistry is a registry in process that counts the requests it serves.
type tagRegistry struct {
	host string
	hits atomic.Int64
}

func newTagRegistry(t testing.TB) *tagRegistry {
	t.Helper()
	r := &tagRegistry{}
	backend := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.hits.Add(1)
		backend.ServeHTTP(w, req)
	}))
	t.Cleanup(srv.Close)
	r.host = strings.TrimPrefix(srv.URL, "http://")
	return r
}

// push writes img under ref and returns its digest.
func (r *tagRegistry) push(t testing.TB, ref string, img v1.Image) string {
	t.Helper()
	tag, err := name.NewTag(ref, name.Insecure)
	must.NoError(t, err)
	must.NoError(t, remote.Write(tag, img))
	d, err := img.Digest()
	must.NoError(t, err)
	return d.String()
}

// A registry's tag other than latest that the store has is served from the
// store without asking the registry, as Nomad's docker driver does;
// latest, force_pull and credentials the image was not served to ask it. A
// tag pushed again and pulled with force_pull names the new image from
// then on, also for pulls without it.
func TestPinnedTagServedFromStore(t *testing.T) {
	needRoot(t)
	reg := newTagRegistry(t)
	s, err := Open(t.TempDir(), Options{InsecureRegistries: []string{reg.host}})
	must.NoError(t, err)
	s.retryBase, s.attempts = 0, 1
	ctx := context.Background()
	first := mustImage(t, imagebuild.Spec{Env: []string{"V=1"}}, baseLayer(t))
	second := mustImage(t, imagebuild.Spec{Env: []string{"V=2"}}, baseLayer(t))
	pinned, latest := reg.host+"/csi/plugin:1.2", reg.host+"/csi/plugin"
	d1 := reg.push(t, pinned, first)
	reg.push(t, latest, first)

	// As a task's: with a lease (a pull without one always writes the
	// record, which would hide what these check).
	tasks := 0
	pull := func(ref string, req PullRequest) (*Image, int64) {
		t.Helper()
		if req.Use == nil {
			tasks++
			req.Use = &Use{TaskID: fmt.Sprintf("a/t/%d", tasks)}
		}
		before := reg.hits.Load()
		img, err := s.Pull(ctx, ref, req)
		must.NoError(t, err)
		return img, reg.hits.Load() - before
	}
	// expect pulls ref and checks the image it got (unless digest is "")
	// and whether the registry was asked.
	expect := func(ref string, req PullRequest, digest string, asked bool) {
		t.Helper()
		img, hits := pull(ref, req)
		if digest != "" {
			must.Eq(t, digest, img.Digest)
		}
		if asked {
			must.Positive(t, hits)
		} else {
			must.Eq(t, 0, hits)
		}
	}
	expect(pinned, PullRequest{}, d1, true)
	expect(pinned, PullRequest{Use: &Use{TaskID: "x/t/1"}}, d1, false)
	// The lease is there though nothing asked the registry.
	uses, err := s.uses()
	must.NoError(t, err)
	must.SliceLen(t, 2, uses)
	for _, u := range uses {
		must.Eq(t, d1, u.Digest)
	}

	// latest (implied) is asked each time.
	expect(latest, PullRequest{}, "", true)
	expect(latest, PullRequest{}, "", true)

	// The tag pushed again: without force_pull the node keeps what it has.
	d2 := reg.push(t, pinned, second)
	expect(pinned, PullRequest{}, d1, false)
	expect(pinned, PullRequest{ForcePull: true}, d2, true)
	// From now on the tag names the new image; the old one keeps it, for
	// credentials the new one was not served to.
	expect(pinned, PullRequest{}, d2, false)
	// Pushed back: the tag follows, though the old image was pulled first.
	reg.push(t, pinned, first)
	expect(pinned, PullRequest{ForcePull: true}, d1, true)
	expect(pinned, PullRequest{}, d1, false)

	// A copy of a record read before another pull moved the tag (a pull
	// by another reference that found the image in the store) does not
	// take the tag back when it is committed.
	reg.push(t, pinned, second)
	stale, err := s.readRecord(d1)
	must.NoError(t, err)
	img, _ := pull(pinned, PullRequest{ForcePull: true})
	must.Eq(t, d2, img.Digest)
	ref, err := ParseReference(latest, s.opts.InsecureRegistries)
	must.NoError(t, err)
	fl := &flight{leased: map[*PullRequest]bool{}}
	_, err = s.present(ctx, stale, ref, "", true, fl)
	must.NoError(t, err)
	expect(pinned, PullRequest{}, d2, false)

	// Credentials the image was not served to ask the registry, which
	// decides (this one lets anyone read); served once, they are kept.
	mallory := &Credentials{Username: "mallory", Password: "guess"}
	expect(pinned, PullRequest{Auth: mallory}, "", true)
	expect(pinned, PullRequest{Auth: mallory}, "", false)
}

// A store written before resolution times were kept, where two images
// hold one tag: the tag is asked of the registry rather than guessed, and
// names its answer from then on.
func TestPinnedTagAmbiguousAsksTheRegistry(t *testing.T) {
	needRoot(t)
	reg := newTagRegistry(t)
	s, err := Open(t.TempDir(), Options{InsecureRegistries: []string{reg.host}})
	must.NoError(t, err)
	ctx := context.Background()
	pinned := reg.host + "/csi/plugin:1.2"
	d1 := reg.push(t, reg.host+"/csi/plugin:1.2.0", mustImage(t, imagebuild.Spec{Env: []string{"V=1"}}, baseLayer(t)))
	d2 := reg.push(t, pinned, mustImage(t, imagebuild.Spec{Env: []string{"V=2"}}, baseLayer(t)))
	_, err = s.Pull(ctx, reg.host+"/csi/plugin:1.2.0", PullRequest{})
	must.NoError(t, err)
	_, err = s.Pull(ctx, pinned, PullRequest{})
	must.NoError(t, err)
	// As an older store left them: both hold the tag, no times.
	unlock, err := s.lockMeta(ctx)
	must.NoError(t, err)
	for _, d := range []string{d1, d2} {
		r, err := s.readRecord(d)
		must.NoError(t, err)
		r.Refs = append(r.Refs, pinned)
		r.Resolved = nil
		b, err := json.Marshal(r)
		must.NoError(t, err)
		must.NoError(t, os.WriteFile(s.recordPath(d), b, 0o600))
	}
	unlock()
	before := reg.hits.Load()
	img, err := s.Pull(ctx, pinned, PullRequest{})
	must.NoError(t, err)
	must.Eq(t, d2, img.Digest)
	must.Positive(t, reg.hits.Load()-before)
	before = reg.hits.Load()
	img, err = s.Pull(ctx, pinned, PullRequest{})
	must.NoError(t, err)
	must.Eq(t, d2, img.Digest)
	must.Eq(t, 0, reg.hits.Load()-before)
}

// A job naming one image by many digests (an index's, the manifest's,
// through other repositories) does not push the image's tags out of its
// record.
func TestDigestRefsDoNotEvictTags(t *testing.T) {
	r := &record{Refs: []string{"r/x:1.2", "r/x:1"}}
	for i := range 40 {
		r.addRef(fmt.Sprintf("r/y%d@sha256:%064d", i, i))
	}
	r.Resolved = map[string]time.Time{"r/x:1.2": time.Now(), "gone:1": time.Now()}
	r.trimRefs()
	must.SliceLen(t, maxRefs, r.Refs)
	must.SliceContains(t, r.Refs, "r/x:1.2")
	must.SliceContains(t, r.Refs, "r/x:1")
	must.MapContainsKey(t, r.Resolved, "r/x:1.2")
	must.MapNotContainsKey(t, r.Resolved, "gone:1")
}

// A warm start of an image the store has, with a lease, writes only the
// lease: the record is not rewritten (its release stamps the last use),
// and GC keeps the image while the lease is held.
func TestWarmPullWritesOnlyTheLease(t *testing.T) {
	f := newFixture(t)
	now := time.Now()
	f.store.now = func() time.Time { return now }
	ref := f.layout(t, "warm", "1", mustImage(t, imagebuild.Spec{}, baseLayer(t)))
	ctx := context.Background()
	img, err := f.store.Pull(ctx, ref, PullRequest{})
	must.NoError(t, err)
	rec := f.store.recordPath(img.Digest)
	fi, err := os.Stat(rec)
	must.NoError(t, err)
	before, err := os.ReadFile(rec)
	must.NoError(t, err)

	now = now.Add(3 * time.Hour)
	_, err = f.store.Pull(ctx, ref, PullRequest{Use: &Use{TaskID: "alloc/warm/1"}})
	must.NoError(t, err)
	after, err := os.ReadFile(rec)
	must.NoError(t, err)
	must.Eq(t, string(before), string(after))
	fi2, err := os.Stat(rec)
	must.NoError(t, err)
	must.Eq(t, fi.ModTime(), fi2.ModTime())

	// A pull without a lease (images pull) stamps the last use.
	now = now.Add(time.Minute)
	_, err = f.store.Pull(ctx, ref, PullRequest{})
	must.NoError(t, err)
	r, err := f.store.readRecord(img.Digest)
	must.NoError(t, err)
	must.Eq(t, now.UTC(), r.LastUsed.UTC())
	must.NoError(t, os.WriteFile(rec, after, 0o600))

	// Held: kept however old its last use.
	now = now.Add(3 * time.Hour)
	live := func(u Use) bool { return true }
	removed, err := f.store.GC(time.Hour, live)
	must.NoError(t, err)
	must.SliceEmpty(t, removed)
	// Released: stamped now, kept for image_gc from then, then removed.
	must.NoError(t, f.store.Release(ctx, "alloc/warm/1"))
	removed, err = f.store.GC(time.Hour, live)
	must.NoError(t, err)
	must.SliceEmpty(t, removed)
	now = now.Add(2 * time.Hour)
	removed, err = f.store.GC(time.Hour, live)
	must.NoError(t, err)
	must.Eq(t, []string{img.Digest}, removed)
}
