package image

import (
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
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

func newTagRegistry(t *testing.T) *tagRegistry {
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
func (r *tagRegistry) push(t *testing.T, ref string, img v1.Image) string {
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

	pull := func(ref string, req PullRequest) (*Image, int64) {
		t.Helper()
		before := reg.hits.Load()
		img, err := s.Pull(ctx, ref, req)
		must.NoError(t, err)
		return img, reg.hits.Load() - before
	}
	img, hits := pull(pinned, PullRequest{})
	must.Eq(t, d1, img.Digest)
	must.Positive(t, hits)
	img, hits = pull(pinned, PullRequest{Use: &Use{TaskID: "a/t/1"}})
	must.Eq(t, d1, img.Digest)
	must.Eq(t, 0, hits)
	// The lease is there though nothing asked the registry.
	uses, err := s.uses()
	must.NoError(t, err)
	must.SliceLen(t, 1, uses)
	must.Eq(t, d1, uses[0].Digest)

	// latest (implied) is asked each time.
	_, hits = pull(latest, PullRequest{})
	must.Positive(t, hits)
	_, hits = pull(latest, PullRequest{})
	must.Positive(t, hits)

	// The tag pushed again: without force_pull the node keeps what it has.
	d2 := reg.push(t, pinned, second)
	img, hits = pull(pinned, PullRequest{})
	must.Eq(t, d1, img.Digest)
	must.Eq(t, 0, hits)
	img, hits = pull(pinned, PullRequest{ForcePull: true})
	must.Eq(t, d2, img.Digest)
	must.Positive(t, hits)
	// From now on the tag names the new image, and the old one keeps its
	// other reference only.
	img, hits = pull(pinned, PullRequest{})
	must.Eq(t, d2, img.Digest)
	must.Eq(t, 0, hits)
	old, err := s.readRecord(d1)
	must.NoError(t, err)
	must.False(t, slices.Contains(old.Refs, pinned))
	must.SliceContains(t, old.Refs, latest)

	// Credentials the image was not served to ask the registry, which
	// decides (this one lets anyone read).
	_, hits = pull(pinned, PullRequest{Auth: &Credentials{Username: "mallory", Password: "guess"}})
	must.Positive(t, hits)
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
