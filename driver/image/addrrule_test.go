package image

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// Addresses that reach the node, its network or a metadata service
// without being written as 127.0.0.1, 10/8 or 169.254/16: each is judged
// by what it reaches. A pull from a public registry reaches none of them;
// one from the operator's registry on the node reaches the local ones but
// never a link-local, "this network" or metadata service's one.
func TestAddressRuleSeesThroughOtherSpellings(t *testing.T) {
	public := &addrRule{registry: "203.0.113.7"}
	local := &addrRule{registry: "127.0.0.1:5000", local: true}
	cases := []struct {
		addr    string
		never   bool // refused to a local registry too
		allowed bool // reached from a public registry
	}{
		{addr: "::ffff:127.0.0.1"},
		{addr: "::ffff:10.1.2.3"},
		{addr: "::ffff:169.254.169.254", never: true},
		{addr: "::1"},
		{addr: "fd00:ec2::254", never: true}, // AWS's metadata service over IPv6
		{addr: "fd00:ec2::253"},
		{addr: "fe80::1", never: true},
		{addr: "0.0.0.0", never: true},
		{addr: "0.0.0.1", never: true},
		{addr: "0.1.2.3", never: true},
		{addr: "::", never: true},
		// Shared address space (RFC 6598): carrier NAT, tailnets, and
		// the metadata service of some clouds (100.100.100.200).
		{addr: "100.64.0.1"},
		{addr: "100.100.100.200", never: true},
		{addr: "100.100.100.201"},
		{addr: "100.127.255.254"},
		// NAT64's well-known prefix reaches the IPv4 address it embeds.
		{addr: "64:ff9b::7f00:1"},
		{addr: "64:ff9b::a00:1"},
		{addr: "64:ff9b::a9fe:a9fe", never: true},
		{addr: "64:ff9b::cb00:7107", allowed: true}, // 203.0.113.7
		{addr: "203.0.113.8", allowed: true},
		{addr: "100.128.0.1", allowed: true},
		{addr: "2001:db8::1", allowed: true},
	}
	for _, c := range cases {
		t.Run(c.addr, func(t *testing.T) {
			ip := net.ParseIP(c.addr)
			must.NotNil(t, ip)
			err := public.check("the connection to "+c.addr, ip)
			if c.allowed {
				must.NoError(t, err)
				must.NoError(t, local.check("the connection to "+c.addr, ip))
				return
			}
			var ra *refusedAddrError
			must.True(t, errors.As(err, &ra), must.Sprintf("%s reached from a public registry: %v", c.addr, err))
			must.ErrorContains(t, err, c.addr)
			err = local.check("the connection to "+c.addr, ip)
			if c.never {
				must.True(t, errors.As(err, &ra), must.Sprintf("%s reached from a local registry: %v", c.addr, err))
			} else {
				must.NoError(t, err)
			}
			// A redirect is held to the same rule.
			from := mustRequest(t, "https://203.0.113.7/v2/x/blobs/sha256:aa")
			to := mustRequest(t, "https://"+net.JoinHostPort(c.addr, "443")+"/")
			must.Error(t, checkRedirect(to, []*http.Request{from}))
		})
	}
	// A link-local address with a zone is refused at the dial and by name.
	must.Error(t, local.control("tcp6", "[fe80::1%lo]:443", nil))
	must.Error(t, local.control("tcp6", "[fe80::1%eth0]:443", nil))
}

// A token realm or redirect on a loopback host spelled otherwise than
// the registry (another case, a trailing dot, an explicit port) is
// judged as any other host, and reaches nothing.
func TestRealmSpelledLikeTheRegistry(t *testing.T) {
	s, err := Open(t.TempDir(), Options{})
	must.NoError(t, err)
	svc, accepted := tcpWitness(t)
	_, port, err := net.SplitHostPort(svc)
	must.NoError(t, err)
	for _, realm := range []string{
		"https://LOCALHOST:" + port + "/token",
		"https://localhost.:" + port + "/token",
		"https://127.0.0.1:" + port + "/token",
		"https://[::ffff:127.0.0.1]:" + port + "/token",
		"https://user@localhost:" + port + "/token",
	} {
		t.Run(realm, func(t *testing.T) {
			conns, rt := s.pullTransport(context.Background(), "203.0.113.7")
			defer conns.CloseIdleConnections()
			// Refused, or (localhost. here) not resolved at all.
			_, err := rt.RoundTrip(mustRequest(t, realm))
			must.Error(t, err)
			must.Eq(t, int64(0), accepted.Load())
		})
	}
}

// openFDs counts the process's open files.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	must.NoError(t, err)
	return len(ents)
}

// settled waits (a bounded number of polls) until the goroutines and files
// are back to at most want; it returns the last counts.
func settled(t *testing.T, goroutines, fds int) (int, int) {
	var g, f int
	for i := 0; i < 100; i++ {
		runtime.GC()
		g, f = runtime.NumGoroutine(), openFDs(t)
		if g <= goroutines && f <= fds {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	return g, f
}

// A pull's connections are its own and end with it: many pulls, some
// that fail early (a missing image, a registry refusing the credentials),
// some of one image at once, leave no connection or goroutine behind.
// The registry speaks HTTP/2 over TLS, as public ones do.
func TestPullsLeaveNoConnections(t *testing.T) {
	needRoot(t)
	backend := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "/locked/") {
			w.Header().Set("WWW-Authenticate", `Basic realm="x"`)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		backend.ServeHTTP(w, r)
	}))
	srv.EnableHTTP2 = true
	srv.StartTLS()
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "https://")
	img := mustImage(t, imagebuild.Spec{}, baseLayer(t))
	tag, err := name.NewTag(host + "/x/app:latest")
	must.NoError(t, err)
	must.NoError(t, remote.Write(tag, img, remote.WithTransport(srv.Client().Transport)))

	// A registry whose API answers nothing a client can use: the pull
	// fails while it opens.
	teapot := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusTeapot)
	}))
	teapot.EnableHTTP2 = true
	teapot.StartTLS()
	defer teapot.Close()

	s, err := Open(t.TempDir(), Options{RegistryCAFile: caFile(t, srv, teapot)})
	must.NoError(t, err)
	s.retryBase = time.Millisecond
	good := host + "/x/app:latest"
	pull := func(ref string, auth *Credentials) error {
		_, err := s.Pull(context.Background(), ref, PullRequest{Auth: auth})
		return err
	}
	must.NoError(t, pull(good, nil))
	g0, f0 := settled(t, 0, 0)

	for i := 0; i < 10; i++ {
		must.NoError(t, pull(good, nil))
		must.NoError(t, pull(good, &Credentials{Username: "u", Password: fmt.Sprint(i)}))
		must.Error(t, pull(host+"/x/missing:latest", nil))
		must.Error(t, pull(host+"/locked/app:latest", nil))
		must.Error(t, pull(strings.TrimPrefix(teapot.URL, "https://")+"/x/app:latest", nil))
		var wg sync.WaitGroup
		for j := 0; j < 4; j++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _ = s.Pull(context.Background(), good, PullRequest{ForcePull: true})
			}()
		}
		wg.Wait()
	}
	g, f := settled(t, g0, f0)
	must.LessEq(t, g0, g, must.Sprintf("goroutines: %d before, %d after", g0, g))
	must.LessEq(t, f0, f, must.Sprintf("open files: %d before, %d after", f0, f))
}
