package image

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// The registry client: go-containerregistry's transport does the ping and
// the auth handshake (basic, or a bearer token from the challenge's
// realm); the manifest and blob requests are the store's own, so that
// their limits, their verification and the scheme they use are decided
// here.

// errPlainHTTP is a request over http to a registry (or a token realm, or a
// redirect) that is not in insecure_registries.
var errPlainHTTP = errors.New("plain HTTP to a registry not in insecure_registries")

// maxManifestSize bounds a manifest or index (registries cap them at 4 MiB).
const maxManifestSize = 4 << 20

// schemeGuard refuses every request that is not HTTPS, but to the
// registries the operator listed as insecure. go-containerregistry speaks
// plain HTTP to loopback and private addresses of its own accord; here the
// operator's list decides, for token realms and redirects too.
type schemeGuard struct {
	next     http.RoundTripper
	insecure []string
}

func (g schemeGuard) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "https" && !isInsecure(req.URL.Host, g.insecure) {
		return nil, errPlainHTTP
	}
	return g.next.RoundTrip(req)
}

// newBaseTransport is the store's HTTP transport: Go's system roots (so
// SSL_CERT_FILE and SSL_CERT_DIR work) plus registry_ca_file. Each pull
// uses a clone of it of its own (pullTransport).
func newBaseTransport(opts Options) (*http.Transport, error) {
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if opts.RegistryCAFile != "" {
		pem, err := os.ReadFile(opts.RegistryCAFile)
		if err != nil {
			return nil, fmt.Errorf("registry_ca_file %q cannot be read: %w", opts.RegistryCAFile, errors.Unwrap(err))
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("registry_ca_file %q holds no PEM certificate: give a file of CA certificates in PEM form", opts.RegistryCAFile)
		}
	}
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	t.ResponseHeaderTimeout = time.Minute
	t.MaxIdleConnsPerHost = 8
	return t, nil
}

// pullTransport is the transport of one pull from registry (host[:port],
// as the job named it): connections of its own, shared with no other pull
// (whose registry may reach other addresses), each held to the pull's
// addrRule when it is dialed, by the address it connects to (a name that
// answers one address to a check and another to the dial gains nothing);
// requests to other hosts (token realms, redirects) held to it by name
// before they leave, which is what holds them behind a proxy; and the
// scheme guard.
func (s *Store) pullTransport(ctx context.Context, registry string) (*http.Transport, http.RoundTripper) {
	host := registry
	if h, _, err := net.SplitHostPort(registry); err == nil {
		host = h
	}
	rule := &addrRule{registry: registry, local: isLocalHost(ctx, host), proxies: map[string]bool{}}
	t := s.transport.Clone()
	if proxy := t.Proxy; proxy != nil {
		t.Proxy = func(req *http.Request) (*url.URL, error) {
			u, err := proxy(req)
			if u != nil {
				rule.addProxy(u)
			}
			return u, err
		}
	}
	guarded := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second, Control: rule.control}
	direct := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		// A proxy is the operator's: it connects for the pull.
		if rule.isProxy(addr) {
			return direct.DialContext(ctx, network, addr)
		}
		return guarded.DialContext(ctx, network, addr)
	}
	return t, schemeGuard{next: hostGuard{next: t, rule: rule}, insecure: s.opts.InsecureRegistries}
}

// addrRule is what one pull may reach: never a link-local or unspecified
// address (cloud metadata services live there), and a loopback or private
// one only when the registry the job named is on such addresses itself
// (the operator's registry on the node or its network); a registry the
// job named on a public address cannot send the driver to a service of
// the node's own, by a redirect, a token realm or a name.
type addrRule struct {
	registry string
	local    bool

	mu      sync.Mutex
	proxies map[string]bool
}

// check judges one address of what (a connection, a host).
func (r *addrRule) check(what string, ip net.IP) error {
	if neverReached(ip) {
		return &refusedAddrError{what: what, ip: ip, linkLocal: true}
	}
	if localAddr(ip) && !r.local {
		return &refusedAddrError{what: what, ip: ip, registry: r.registry}
	}
	return nil
}

var (
	// sharedSpace is RFC 6598's shared address space: carrier NAT,
	// tailnets, the metadata service of some clouds (100.100.100.200);
	// not the internet's.
	sharedSpace = &net.IPNet{IP: net.IPv4(100, 64, 0, 0), Mask: net.CIDRMask(10, 32)}
	// nat64 is NAT64's well-known prefix (RFC 6052): an address in it
	// reaches the IPv4 address it embeds.
	nat64 = &net.IPNet{IP: net.ParseIP("64:ff9b::"), Mask: net.CIDRMask(96, 128)}
	// metadataAddrs are the cloud metadata services that are not on a
	// link-local address: AWS's over IPv6 (unique local) and Alibaba
	// Cloud's (shared space). The others are at 169.254.169.254.
	metadataAddrs = []net.IP{net.ParseIP("fd00:ec2::254"), net.IPv4(100, 100, 100, 200)}
)

// metadataAddr is the address of a cloud metadata service outside the
// link-local range.
func metadataAddr(ip net.IP) bool {
	return slices.ContainsFunc(metadataAddrs, ip.Equal)
}

// reached is the address a connection to ip reaches: the IPv4 address a
// NAT64 one embeds, else ip.
func reached(ip net.IP) net.IP {
	if ip.To4() == nil && nat64.Contains(ip) {
		return net.IPv4(ip[12], ip[13], ip[14], ip[15])
	}
	return ip
}

// neverReached is an address no pull connects to: link-local (cloud
// metadata services live there), unspecified, of "this network"
// (0.0.0.0/8, which Linux takes for the node itself), or a metadata
// service's elsewhere.
func neverReached(ip net.IP) bool {
	ip = reached(ip)
	v4 := ip.To4()
	return ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() || ip.IsUnspecified() || (v4 != nil && v4[0] == 0) || metadataAddr(ip)
}

// localAddr is an address of the node or its networks: loopback,
// private, unique local or shared.
func localAddr(ip net.IP) bool {
	ip = reached(ip)
	return ip.IsLoopback() || ip.IsPrivate() || sharedSpace.Contains(ip)
}

// control judges the address a connection of the pull is about to connect
// to, after its name was resolved for the dial.
func (r *addrRule) control(_, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return err
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return fmt.Errorf("dial to %q, not an address", address)
	}
	return r.check("the connection to "+address, ip)
}

func (r *addrRule) addProxy(u *url.URL) {
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443", "socks5": "1080", "socks5h": "1080"}[u.Scheme]
	}
	r.mu.Lock()
	r.proxies[net.JoinHostPort(u.Hostname(), port)] = true
	r.mu.Unlock()
}

func (r *addrRule) isProxy(addr string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.proxies[addr]
}

// refusedAddrError is a connection, redirect or token realm of a pull
// refused for its address.
type refusedAddrError struct {
	// what was refused: a connection, a host a request went to.
	what      string
	ip        net.IP
	linkLocal bool
	registry  string
}

func (e *refusedAddrError) Error() string {
	// A NAT64 address is named with the address it reaches.
	addr := e.ip.String()
	ip := reached(e.ip)
	if !ip.Equal(e.ip) {
		addr = fmt.Sprintf("%s (NAT64 for %s)", e.ip, ip)
	}
	if e.linkLocal {
		switch v4 := ip.To4(); {
		case ip.IsUnspecified():
			return fmt.Sprintf("%s is refused: %s is an unspecified address (it reaches the node itself)", e.what, addr)
		case metadataAddr(ip):
			return fmt.Sprintf("%s is refused: %s is a cloud metadata service's address", e.what, addr)
		case v4 != nil && v4[0] == 0:
			return fmt.Sprintf("%s is refused: %s is in 0.0.0.0/8 (\"this network\"), which no pull reaches", e.what, addr)
		}
		return fmt.Sprintf("%s is refused: %s is a link-local address (cloud metadata services live there)", e.what, addr)
	}
	return fmt.Sprintf("%s is refused: %s is a loopback, private or shared address, and registry %s is not on one", e.what, addr, e.registry)
}

// hostGuard judges, by the addresses its name resolves to, every request
// to a host other than the pull's registry: the token realm the
// registry's challenge names, the hosts its redirects lead to.
type hostGuard struct {
	next http.RoundTripper
	rule *addrRule
}

func (g hostGuard) RoundTrip(req *http.Request) (*http.Response, error) {
	if !strings.EqualFold(req.URL.Host, g.rule.registry) {
		for _, ip := range hostIPs(req.Context(), req.URL.Hostname()) {
			if err := g.rule.check("the token realm or redirect to "+req.URL.Host, ip); err != nil {
				return nil, err
			}
		}
	}
	return g.next.RoundTrip(req)
}

// remoteSource reads an image from a registry.
type remoteSource struct {
	ref    Reference
	repo   name.Repository
	scheme string
	client *http.Client
	// conns are the pull's own connections, closed with it.
	conns *http.Transport
}

func (s *Store) openRemote(ctx context.Context, ref Reference, creds *Credentials, notify func(string)) (*remoteSource, error) {
	repo := ref.Remote.Context()
	auth, err := s.authenticator(ctx, repo.RegistryStr(), creds)
	if err != nil {
		return nil, err
	}
	scheme := "https"
	if isInsecure(repo.RegistryStr(), s.opts.InsecureRegistries) {
		scheme = "http"
	}
	conns, guarded := s.pullTransport(ctx, repo.RegistryStr())
	var rt http.RoundTripper
	err = s.retry(ctx, ref, "the registry's API", notify, func() error {
		var err error
		rt, err = transport.NewWithContext(ctx, repo.Registry, auth, guarded, []string{repo.Scope(transport.PullScope)})
		return statusOf(err)
	})
	if err != nil {
		conns.CloseIdleConnections()
		return nil, classify(ref, "the registry's API", err)
	}
	client := &http.Client{Transport: rt, CheckRedirect: checkRedirect}
	return &remoteSource{ref: ref, repo: repo, scheme: scheme, client: client, conns: conns}, nil
}

// checkRedirect follows at most 10 redirects, never to a link-local
// address (cloud metadata services live there), nor from a public host to a
// loopback or private one. A host given by name is judged by the addresses
// it resolves to ("localhost" is a loopback address).
func checkRedirect(req *http.Request, via []*http.Request) error {
	if len(via) >= 10 {
		return errors.New("stopped after 10 redirects")
	}
	// The origin is resolved once, and only when the redirect leads to a
	// local address.
	originLocal := sync.OnceValue(func() bool { return isLocalHost(via[0].Context(), via[0].URL.Hostname()) })
	for _, ip := range hostIPs(req.Context(), req.URL.Hostname()) {
		if neverReached(ip) {
			return fmt.Errorf("redirect to the link-local or unspecified address %s refused", ip)
		}
		if localAddr(ip) && !originLocal() {
			return fmt.Errorf("redirect from %s to the local address %s refused", via[0].URL.Host, ip)
		}
	}
	return nil
}

// hostIPs are the addresses of host: the host itself when it is an
// address, else what it resolves to (none when it does not: the request
// fails on its own).
func hostIPs(ctx context.Context, host string) []net.IP {
	if ip := net.ParseIP(host); ip != nil {
		return []net.IP{ip}
	}
	addrs, err := net.DefaultResolver.LookupIPAddr(ctx, host)
	if err != nil {
		return nil
	}
	ips := make([]net.IP, 0, len(addrs))
	for _, a := range addrs {
		ips = append(ips, a.IP)
	}
	return ips
}

// isLocalHost says whether every address of host is a loopback or private
// one.
func isLocalHost(ctx context.Context, host string) bool {
	ips := hostIPs(ctx, host)
	for _, ip := range ips {
		if !localAddr(ip) {
			return false
		}
	}
	return len(ips) > 0
}

// statusOf turns go-containerregistry's error for a registry's answer into
// a statusError (codes, no text of the registry's).
func statusOf(err error) error {
	var te *transport.Error
	if errors.As(err, &te) {
		return newStatusError(te)
	}
	return err
}

var acceptedManifests = strings.Join([]string{
	string(types.OCIImageIndex), string(types.OCIManifestSchema1),
	string(types.DockerManifestList), string(types.DockerManifestSchema2),
}, ",")

func (r *remoteSource) get(ctx context.Context, kind, id string, accept string) (*http.Response, error) {
	u := fmt.Sprintf("%s://%s/v2/%s/%s/%s", r.scheme, r.repo.RegistryStr(), r.repo.RepositoryStr(), kind, id)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return nil, err
	}
	if err := transport.CheckError(resp, http.StatusOK); err != nil {
		resp.Body.Close()
		return nil, statusOf(err)
	}
	return resp, nil
}

func (r *remoteSource) fetchManifest(ctx context.Context, id string) ([]byte, types.MediaType, error) {
	resp, err := r.get(ctx, "manifests", id, acceptedManifests)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxManifestSize+1))
	if err != nil {
		return nil, "", err
	}
	if len(b) > maxManifestSize {
		return nil, "", errorf(ErrTooLarge, "image %q: the registry's manifest is over %d MiB; no image has one that large", r.ref.Raw, maxManifestSize>>20)
	}
	return b, types.MediaType(strings.TrimSpace(strings.Split(resp.Header.Get("Content-Type"), ";")[0])), nil
}

func (r *remoteSource) top(ctx context.Context) ([]byte, types.MediaType, error) {
	return r.fetchManifest(ctx, r.ref.Remote.Identifier())
}

func (r *remoteSource) manifest(ctx context.Context, d v1.Hash) ([]byte, types.MediaType, error) {
	return r.fetchManifest(ctx, d.String())
}

func (r *remoteSource) blob(ctx context.Context, d v1.Descriptor) (io.ReadCloser, error) {
	resp, err := r.get(ctx, "blobs", d.Digest.String(), "")
	if err != nil {
		return nil, err
	}
	return resp.Body, nil
}

func (r *remoteSource) close() error {
	r.conns.CloseIdleConnections()
	return nil
}
