package image

import (
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// Plain HTTP is spoken only to insecure_registries, loopback addresses
// included (go-containerregistry would of its own accord). A registry of
// go-containerregistry's in process stands in for a plain-HTTP one; the
// e2e tests run the real registry with TLS.
func TestPlainHTTPOnlyForInsecureRegistries(t *testing.T) {
	f := newFixture(t)
	var hits atomic.Int64
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		reg.ServeHTTP(w, r)
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	img := mustImage(t, imagebuild.Spec{}, baseLayer(t))
	ref := host + "/plain/app:1"
	tag, err := name.NewTag(ref, name.Insecure)
	must.NoError(t, err)
	must.NoError(t, remote.Write(tag, img))
	hits.Store(0)

	_, err = f.store.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrNotAllowed)
	must.ErrorContains(t, err, "list it in the plugin option insecure_registries")
	// Not one request reached the registry over plain HTTP.
	must.Eq(t, int64(0), hits.Load())
	assertEmpty(t, f.store)

	insecure, err := Open(f.root, Options{InsecureRegistries: []string{host}})
	must.NoError(t, err)
	got, err := insecure.Pull(context.Background(), ref, PullRequest{})
	must.NoError(t, err)
	want, err := img.Digest()
	must.NoError(t, err)
	must.Eq(t, want.String(), got.Digest)
	must.Positive(t, hits.Load())
}
