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

// A redirect is judged by the addresses its host names, not by how the
// host is written: a name that resolves to a loopback address is the
// loopback address, and a public registry may not send the driver there
// (to a service of the node's own) by naming it; a registry named by a
// host that is local may send it to another local address.
func TestRedirectByNameIsJudgedByItsAddress(t *testing.T) {
	public := mustRequest(t, "https://203.0.113.7/v2/x/blobs/sha256:aa")
	local := mustRequest(t, "https://127.0.0.1:5000/v2/x/blobs/sha256:aa")
	localByName := mustRequest(t, "https://localhost:5000/v2/x/blobs/sha256:aa")
	cases := []struct {
		name    string
		from    *http.Request
		to      string
		refused string
	}{
		{name: "public to loopback by name", from: public, to: "https://localhost:4646/v1/agent/self", refused: "local address"},
		{name: "public to loopback address", from: public, to: "https://127.0.0.1:4646/", refused: "local address"},
		{name: "public to v4-mapped loopback", from: public, to: "https://[::ffff:127.0.0.1]:4646/", refused: "local address"},
		{name: "public to link-local", from: public, to: "https://169.254.169.254/", refused: "link-local"},
		{name: "public to public", from: public, to: "https://198.51.100.1/blob"},
		{name: "loopback to loopback by name", from: local, to: "https://localhost:5001/blob"},
		{name: "loopback by name to loopback", from: localByName, to: "https://127.0.0.1:5001/blob"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := checkRedirect(mustRequest(t, c.to), []*http.Request{c.from})
			if c.refused == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, c.refused)
		})
	}
}

func mustRequest(t *testing.T, u string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, u, nil)
	must.NoError(t, err)
	return req
}
