package image

import (
	"context"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
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

// tcpWitness is a listener that counts the connections it accepts (and
// closes them): a service of the node's own that a pull must not reach.
func tcpWitness(t *testing.T) (addr string, accepted *atomic.Int64) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	accepted = new(atomic.Int64)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			c.Close()
		}
	}()
	return l.Addr().String(), accepted
}

// Each connection of a pull is judged by the address it connects to, as
// the dial resolved it: a name that answered a public address to the
// check of a redirect or a realm and answers 127.0.0.1 to the dial (DNS
// rebinding) reaches nothing. The connection layer alone is used here, as
// if every check by name above it had been passed.
func TestConnectionsAreJudgedByTheAddressDialed(t *testing.T) {
	s, err := Open(t.TempDir(), Options{})
	must.NoError(t, err)
	svc, accepted := tcpWitness(t)
	_, port, err := net.SplitHostPort(svc)
	must.NoError(t, err)
	get := func(registry, u string) error {
		conns, _ := s.pullTransport(context.Background(), registry)
		defer conns.CloseIdleConnections()
		resp, err := conns.RoundTrip(mustRequest(t, u))
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	cases := []struct {
		name, registry, to string
		refused            string
	}{
		{name: "public registry, loopback by name", registry: "203.0.113.7", to: "https://localhost:" + port + "/", refused: "the connection to 127.0.0.1:" + port + " is refused: 127.0.0.1 is a loopback, private or shared address, and registry 203.0.113.7 is not on one"},
		{name: "public registry, loopback address", registry: "203.0.113.7", to: "https://" + svc + "/", refused: "loopback, private or shared address"},
		{name: "public registry, link-local", registry: "203.0.113.7", to: "https://169.254.169.254:" + port + "/", refused: "169.254.169.254 is a link-local address"},
		{name: "loopback registry, link-local", registry: "127.0.0.1:5000", to: "https://169.254.169.254:" + port + "/", refused: "link-local"},
		{name: "loopback registry, unspecified", registry: "127.0.0.1:5000", to: "https://0.0.0.0:" + port + "/", refused: "0.0.0.0 is an unspecified address"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := get(c.registry, c.to)
			var ra *refusedAddrError
			must.True(t, errors.As(err, &ra), must.Sprint(err))
			must.ErrorContains(t, err, c.refused)
			must.Eq(t, int64(0), accepted.Load())
		})
	}
	// A registry the operator runs on the node reaches the node: the
	// connection is made (and fails at TLS, which the witness does not
	// speak).
	err = get("localhost:5000", "https://localhost:"+port+"/")
	must.Error(t, err)
	var ra *refusedAddrError
	must.False(t, errors.As(err, &ra))
	must.Eq(t, int64(1), accepted.Load())
}

// A proxy is the operator's: a pull from a public registry reaches it on
// a loopback or private address, and the proxy connects for it.
func TestProxyOnALocalAddressIsReached(t *testing.T) {
	s, err := Open(t.TempDir(), Options{})
	must.NoError(t, err)
	proxy, accepted := tcpWitness(t)
	s.transport.Proxy = http.ProxyURL(&url.URL{Scheme: "http", Host: proxy})
	conns, _ := s.pullTransport(context.Background(), "203.0.113.7")
	defer conns.CloseIdleConnections()
	_, err = conns.RoundTrip(mustRequest(t, "https://203.0.113.7/v2/"))
	must.Error(t, err) // the witness is no proxy
	var ra *refusedAddrError
	must.False(t, errors.As(err, &ra), must.Sprint(err))
	must.Eq(t, int64(1), accepted.Load())
}

// A token realm (or any host but the registry's) is judged by the
// addresses its name resolves to before the request leaves, as a redirect
// is: a public registry cannot have the driver send a token request (with
// the registry's credentials) to a service of the node's own.
func TestRealmIsJudgedByItsAddress(t *testing.T) {
	s, err := Open(t.TempDir(), Options{})
	must.NoError(t, err)
	svc, accepted := tcpWitness(t)
	_, port, err := net.SplitHostPort(svc)
	must.NoError(t, err)
	_, rt := s.pullTransport(context.Background(), "203.0.113.7")
	_, err = rt.RoundTrip(mustRequest(t, "https://localhost:"+port+"/token?scope=repository:x:pull"))
	must.ErrorContains(t, err, "the token realm or redirect to localhost:"+port+" is refused: 127.0.0.1 is a loopback, private or shared address")
	must.Eq(t, int64(0), accepted.Load())
}

// A job that names a link-local registry: the pull fails at once (no
// retries), naming the image and the address, and nothing is kept.
// (go-containerregistry itself refuses a token realm given as a loopback,
// private or link-local address literal.)
func TestLinkLocalRegistryIsRefused(t *testing.T) {
	f := newFixture(t)
	for _, c := range []struct{ ref, refused string }{
		{ref: "169.254.169.254/x/app:1", refused: "the connection to 169.254.169.254:443 is refused: 169.254.169.254 is a link-local address"},
		{ref: "[fe80::1]:5000/x/app:1", refused: "fe80::1 is a link-local address"},
		{ref: "[64:ff9b::a9fe:a9fe]/x/app:1", refused: "64:ff9b::a9fe:a9fe (NAT64 for 169.254.169.254) is a link-local address"},
		{ref: "0.0.0.1/x/app:1", refused: `0.0.0.1 is in 0.0.0.0/8 ("this network")`},
		{ref: "[fd00:ec2::254]/x/app:1", refused: "fd00:ec2::254 is a cloud metadata service's address"},
		{ref: "100.100.100.200/x/app:1", refused: "100.100.100.200 is a cloud metadata service's address"},
	} {
		var said []string
		_, err := f.store.Pull(context.Background(), c.ref, PullRequest{Notify: func(m string) { said = append(said, m) }})
		must.ErrorIs(t, err, ErrNotAllowed)
		must.ErrorContains(t, err, `image "`+c.ref+`"`)
		must.ErrorContains(t, err, c.refused)
		must.SliceEmpty(t, said)
	}
	assertEmpty(t, f.store)
}
