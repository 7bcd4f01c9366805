package image

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// What a hostile registry (or the host a registry sends the driver to) can
// get of the operator's credentials, and where it can send the driver.

// witness is a server that records every request it gets, and the
// Authorization headers among them.
type witness struct {
	srv  *httptest.Server
	mu   sync.Mutex
	seen []string // "METHOD path auth"
}

// newWitness starts one on 127.0.0.1, or on ::1 (v6): a host other than
// 127.0.0.1's by name, as Go's client tells hosts apart on redirects.
func newWitness(t *testing.T, tls, v6 bool, h http.HandlerFunc) *witness {
	w := &witness{}
	handler := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w.mu.Lock()
		w.seen = append(w.seen, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		w.mu.Unlock()
		if h != nil {
			h(rw, r)
			return
		}
		rw.WriteHeader(http.StatusNotFound)
	})
	w.srv = httptest.NewUnstartedServer(handler)
	if v6 {
		l, err := net.Listen("tcp", "[::1]:0")
		if err != nil {
			t.Skipf("no IPv6 loopback: %v", err)
		}
		w.srv.Listener.Close()
		w.srv.Listener = l
	}
	if tls {
		w.srv.StartTLS()
	} else {
		w.srv.Start()
	}
	t.Cleanup(w.srv.Close)
	return w
}

func (w *witness) host() string {
	return strings.TrimPrefix(strings.TrimPrefix(w.srv.URL, "https://"), "http://")
}

func (w *witness) requests() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.seen...)
}

// authorized says whether any request carried credentials or a token.
func (w *witness) authorized() bool {
	for _, s := range w.requests() {
		if !strings.HasSuffix(s, " ") {
			return true
		}
	}
	return false
}

// caFile writes the certificates of the TLS servers as one PEM file.
func caFile(t *testing.T, servers ...*httptest.Server) string {
	var b []byte
	for _, s := range servers {
		b = append(b, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.Certificate().Raw})...)
	}
	p := filepath.Join(t.TempDir(), "ca.pem")
	must.NoError(t, os.WriteFile(p, b, 0o600))
	return p
}

// dockerConfigFor writes a docker config.json with user:secret for host.
func dockerConfigFor(t *testing.T, host string) string {
	p := filepath.Join(t.TempDir(), "config.json")
	auth := base64.StdEncoding.EncodeToString([]byte("operator:s3cret-of-the-operator"))
	must.NoError(t, os.WriteFile(p, []byte(fmt.Sprintf(`{"auths": {%q: {"auth": %q}}}`, host, auth)), 0o600))
	return p
}

func TestHostileRegistries(t *testing.T) {
	needRoot(t)
	img := mustImage(t, imagebuild.Spec{}, baseLayer(t))
	backend := registry.New(registry.Logger(log.New(io.Discard, "", 0)))

	// target is where the hostile registry sends the driver: it records
	// what reaches it, and challenges for a token of its own.
	var target *witness
	target = newWitness(t, true, true, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/token" {
			_, _ = io.WriteString(w, `{"token": "target-token"}`)
			return
		}
		w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm="%s/token",service="target"`, target.srv.URL))
		w.WriteHeader(http.StatusUnauthorized)
	})
	plain := newWitness(t, false, true, nil)

	// The operator's registry: its credentials are in the plugin's auth
	// config; it answers with redirects chosen per case.
	var redirect sync.Map // repository -> where its layer blobs go
	cfgName, err := img.ConfigName()
	must.NoError(t, err)
	reg := newWitness(t, true, false, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") == "" {
			w.Header().Set("WWW-Authenticate", `Basic realm="registry"`)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		if repo, _, ok := strings.Cut(strings.TrimPrefix(r.URL.Path, "/v2/"), "/blobs/"); ok && r.Method == http.MethodGet {
			if to, ok := redirect.Load(repo); ok && !strings.HasSuffix(r.URL.Path, cfgName.String()) {
				http.Redirect(w, r, to.(string), http.StatusTemporaryRedirect)
				return
			}
		}
		backend.ServeHTTP(w, r)
	})
	// hostile is a registry a job names, with no credentials of the
	// operator's: its token realm is the operator's registry.
	hostile := newWitness(t, true, true, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm="%s/token",service="x"`, reg.srv.URL))
		w.WriteHeader(http.StatusUnauthorized)
	})

	ca := caFile(t, reg.srv, target.srv, hostile.srv)
	var s *Store
	s, err = Open(t.TempDir(), Options{RegistryCAFile: ca, AuthConfigFile: dockerConfigFor(t, reg.host())})
	must.NoError(t, err)
	s.retryBase, s.attempts = 0, 1
	push := func(repo string) string {
		tag, err := name.NewTag(reg.host() + "/" + repo + ":1")
		must.NoError(t, err)
		must.NoError(t, remote.Write(tag, img, remote.WithTransport(reg.srv.Client().Transport),
			remote.WithAuth(&authn.Basic{Username: "operator", Password: "s3cret-of-the-operator"})))
		return tag.String()
	}

	cases := []struct {
		name, repo, to string
		refused        string
	}{
		{name: "redirect to another host", repo: "elsewhere", to: target.srv.URL + "/blob"},
		{name: "redirect to plain http", repo: "plain", to: plain.srv.URL + "/blob", refused: "plain HTTP"},
		{name: "redirect to file", repo: "file", to: "file:///etc/shadow", refused: "plain HTTP"},
		{name: "redirect to link-local", repo: "metadata", to: "https://169.254.169.254/latest/meta-data/", refused: "link-local"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ref := push(c.repo)
			redirect.Store(c.repo, c.to)
			_, err := s.Pull(context.Background(), ref, PullRequest{})
			must.Error(t, err)
			if c.refused != "" {
				must.ErrorContains(t, err, c.refused)
			}
			must.StrNotContains(t, err.Error(), "s3cret")
			// The operator's credentials and the registry's token
			// reached the registry only.
			must.False(t, target.authorized(), must.Sprint(target.requests()))
			if c.repo == "elsewhere" {
				// It was reached, without the registry's credentials
				// (its own challenge is answered by none).
				must.SliceContains(t, target.requests(), "GET /blob ", must.Sprint(target.requests()))
			}
			must.SliceEmpty(t, plain.requests())
			must.True(t, reg.authorized())
		})
	}

	t.Run("job names a registry whose realm is the operator's", func(t *testing.T) {
		before := len(reg.requests())
		_, err := s.Pull(context.Background(), hostile.host()+"/x/y:1", PullRequest{})
		must.Error(t, err)
		must.False(t, hostile.authorized())
		for _, r := range reg.requests()[before:] {
			must.StrHasSuffix(t, " ", r, must.Sprint("the operator's credentials went to the token realm a hostile registry named"))
		}
	})
}

// An image a task pulled with its own credentials is not served from the
// store to a job without them: by digest the store asks the registry with
// the new job's credentials (which may refuse them), and a registry that is
// down stands in for none of them.
func TestPrivateImageIsServedOnlyToItsCredentials(t *testing.T) {
	needRoot(t)
	backend := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	var mu sync.Mutex
	var down bool
	var hits int
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		hits++
		isDown := down
		mu.Unlock()
		if isDown {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		if u, p, ok := r.BasicAuth(); !ok || u != "alice" || p != "alice-pw" {
			w.Header().Set("WWW-Authenticate", `Basic realm="private"`)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		backend.ServeHTTP(w, r)
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	img := mustImage(t, imagebuild.Spec{Env: []string{"SECRET=1"}}, baseLayer(t))
	tag, err := name.NewTag(host+"/private/app:1", name.Insecure)
	must.NoError(t, err)
	must.NoError(t, remote.Write(tag, img, remote.WithAuth(&authn.Basic{Username: "alice", Password: "alice-pw"})))
	d, err := img.Digest()
	must.NoError(t, err)
	byTag, byDigest := host+"/private/app:1", host+"/private/app@"+d.String()

	s, err := Open(t.TempDir(), Options{InsecureRegistries: []string{host}})
	must.NoError(t, err)
	s.retryBase, s.attempts = 0, 1
	alice := &Credentials{Username: "alice", Password: "alice-pw"}
	mallory := &Credentials{Username: "mallory", Password: "guess"}
	_, err = s.Pull(context.Background(), byTag, PullRequest{Auth: alice})
	must.NoError(t, err)

	// Alice again, by digest: from the store, the registry not asked.
	mu.Lock()
	hits = 0
	mu.Unlock()
	got, err := s.Pull(context.Background(), byDigest, PullRequest{Auth: alice})
	must.NoError(t, err)
	must.Eq(t, d.String(), got.Digest)
	mu.Lock()
	must.Eq(t, 0, hits)
	mu.Unlock()

	// Anyone else, by digest: the registry decides, and refuses.
	for _, auth := range []*Credentials{nil, mallory} {
		_, err = s.Pull(context.Background(), byDigest, PullRequest{Auth: auth})
		must.ErrorIs(t, err, ErrUnauthorized)
	}

	// The registry down: the tag alice pulled stands in for her only.
	mu.Lock()
	down = true
	mu.Unlock()
	for _, auth := range []*Credentials{nil, mallory} {
		_, err = s.Pull(context.Background(), byTag, PullRequest{Auth: auth})
		must.ErrorIs(t, err, ErrUnreachable)
	}
	got, err = s.Pull(context.Background(), byTag, PullRequest{Auth: alice})
	must.NoError(t, err)
	must.Eq(t, d.String(), got.Digest)
	// Asked of the registry (force_pull), which is down: the fallback.
	var said []string
	got, err = s.Pull(context.Background(), byTag, PullRequest{Auth: alice, ForcePull: true, Notify: func(m string) { said = append(said, m) }})
	must.NoError(t, err)
	must.Eq(t, d.String(), got.Digest)
	must.StrContains(t, strings.Join(said, "\n"), "unreachable: using image "+byTag)
	_, err = s.Pull(context.Background(), byTag, PullRequest{Auth: mallory, ForcePull: true})
	must.ErrorIs(t, err, ErrUnreachable)

	// The record keeps no credential, only keyed hashes of them.
	b, err := os.ReadFile(s.recordPath(d.String()))
	must.NoError(t, err)
	must.StrNotContains(t, string(b), "alice")
	must.StrContains(t, string(b), "auth_keys")
}

// rawRegistry serves the bodies of manifests its handler gives, by path
// under /v2/<repo>/manifests/, over plain HTTP.
func rawRegistry(t *testing.T, manifest func(w http.ResponseWriter, r *http.Request, id string)) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, id, ok := strings.Cut(r.URL.Path, "/manifests/"); ok {
			manifest(w, r, id)
			return
		}
		if r.URL.Path == "/v2/" {
			return
		}
		w.WriteHeader(http.StatusNotFound)
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// Manifests a hostile registry serves: an index whose platform's entry is
// another index, a manifest that never ends, one that never starts; and a
// layout whose configuration lies about a layer's diff id.
func TestHostileManifests(t *testing.T) {
	f := newFixture(t)
	child := []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}`)
	childDigest := digestOf(child)
	index := []byte(fmt.Sprintf(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[`+
		`{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":%q,"size":%d,"platform":{"os":"linux","architecture":%q}}]}`,
		childDigest, len(child), runtime.GOARCH))
	release := make(chan struct{})
	defer close(release)
	host := rawRegistry(t, func(w http.ResponseWriter, r *http.Request, id string) {
		switch {
		case id == "nested":
			w.Header().Set("Content-Type", "application/vnd.oci.image.index.v1+json")
			_, _ = w.Write(index)
		case id == childDigest:
			w.Header().Set("Content-Type", "application/vnd.oci.image.index.v1+json")
			_, _ = w.Write(child)
		case id == "endless":
			w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
			chunk := []byte(strings.Repeat(" ", 1<<16))
			for {
				if _, err := w.Write(chunk); err != nil {
					return
				}
			}
		case id == "silent":
			w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			select {
			case <-release:
			case <-r.Context().Done():
			}
		default:
			w.WriteHeader(http.StatusNotFound)
		}
	})
	s, err := Open(f.root, Options{InsecureRegistries: []string{host}, LocalDirs: []string{f.images}})
	must.NoError(t, err)
	s.retryBase, s.attempts = 0, 1

	_, err = s.Pull(context.Background(), host+"/x/app:nested", PullRequest{})
	must.ErrorIs(t, err, ErrInvalid)
	must.ErrorContains(t, err, "names another index; only one level is supported")

	_, err = s.Pull(context.Background(), host+"/x/app:endless", PullRequest{})
	must.ErrorIs(t, err, ErrTooLarge)
	must.ErrorContains(t, err, "manifest is over 4 MiB")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = s.Pull(ctx, host+"/x/app:silent", PullRequest{})
	must.ErrorIs(t, err, ErrUnreachable)
	must.ErrorContains(t, err, "image_pull_timeout")

	// A layer whose diff id (in the configuration) is not what it
	// unpacks to: refused, nothing kept under either digest.
	tarA, err := imagebuild.Tar(imagebuild.File("real", []byte("real"), 0o644))
	must.NoError(t, err)
	tarB, err := imagebuild.Tar(imagebuild.File("claimed", []byte("claimed"), 0o644))
	must.NoError(t, err)
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, err = zw.Write(tarA)
	must.NoError(t, err)
	must.NoError(t, zw.Close())
	liar := &bytesLayer{compressed: gz.Bytes(), uncompressed: tarB, mt: types.OCILayer}
	ref := f.layout(t, "liar", "1", mustImage(t, imagebuild.Spec{}, liar))
	_, err = s.Pull(context.Background(), ref, PullRequest{})
	must.ErrorIs(t, err, ErrDigestMismatch)
	must.ErrorContains(t, err, "not the diff id")
	assertEmpty(t, s)
}

// A job that knows the configuration digest of another's private image
// (or its whole manifest) gets nothing by naming a registry of its own
// that serves a manifest naming it: the store's copy of the configuration
// (its env may hold secrets) goes to credentials it was not served to only
// when the source serves it too. The credentials it was served to get it
// from the store without asking the registry for it again.
func TestPrivateConfigIsNotServedByItsDigest(t *testing.T) {
	needRoot(t)
	backend := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	var mu sync.Mutex
	var blobs []string
	private := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != "alice" || p != "alice-pw" {
			w.Header().Set("WWW-Authenticate", `Basic realm="private"`)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		if strings.Contains(r.URL.Path, "/blobs/") {
			mu.Lock()
			blobs = append(blobs, r.URL.Path)
			mu.Unlock()
		}
		backend.ServeHTTP(w, r)
	}))
	defer private.Close()
	host := strings.TrimPrefix(private.URL, "http://")
	img := mustImage(t, imagebuild.Spec{Env: []string{"DB_PASSWORD=hunter2"}}, baseLayer(t))
	tag, err := name.NewTag(host+"/private/app:1", name.Insecure)
	must.NoError(t, err)
	must.NoError(t, remote.Write(tag, img, remote.WithAuth(&authn.Basic{Username: "alice", Password: "alice-pw"})))

	// Mallory's registry serves, as m/app:forged, a manifest of its own
	// naming the configuration (and the layers) of alice's image, and as
	// m/app:copied the very manifest of alice's image; no blob.
	raw, err := img.RawManifest()
	must.NoError(t, err)
	m, err := img.Manifest()
	must.NoError(t, err)
	forged, err := json.Marshal(&v1.Manifest{SchemaVersion: 2, MediaType: types.OCIManifestSchema1, Config: m.Config, Layers: m.Layers,
		Annotations: map[string]string{"by": "mallory"}})
	must.NoError(t, err)
	must.NotEq(t, digestOf(raw), digestOf(forged))
	mallory := rawRegistry(t, func(w http.ResponseWriter, r *http.Request, id string) {
		w.Header().Set("Content-Type", string(types.OCIManifestSchema1))
		if id == "forged" {
			_, _ = w.Write(forged)
			return
		}
		_, _ = w.Write(raw)
	})

	s, err := Open(t.TempDir(), Options{InsecureRegistries: []string{host, mallory}})
	must.NoError(t, err)
	s.retryBase, s.attempts = 0, 1
	alice := &Credentials{Username: "alice", Password: "alice-pw"}
	got, err := s.Pull(context.Background(), host+"/private/app:1", PullRequest{Auth: alice})
	must.NoError(t, err)
	must.SliceContains(t, got.Config.Env, "DB_PASSWORD=hunter2")

	for _, ref := range []string{mallory + "/m/app:forged", mallory + "/m/app:copied"} {
		got, err := s.Pull(context.Background(), ref, PullRequest{})
		must.ErrorIs(t, err, ErrNotFound, must.Sprintf("%s served %+v", ref, got))
		must.StrNotContains(t, err.Error(), "hunter2")
	}

	// Alice again, resolved at her registry: the configuration is the
	// store's, not asked for again.
	mu.Lock()
	blobs = nil
	mu.Unlock()
	got, err = s.Pull(context.Background(), host+"/private/app:1", PullRequest{Auth: alice, ForcePull: true})
	must.NoError(t, err)
	must.SliceContains(t, got.Config.Env, "DB_PASSWORD=hunter2")
	mu.Lock()
	must.SliceEmpty(t, blobs)
	mu.Unlock()
}
