//go:build e2e

package e2e

// A real registry for the image tests: Debian's docker-registry
// (distribution 2.8, `make deps` installs it) on 127.0.0.1 with TLS from a
// CA made here and htpasswd basic auth (bcrypt). A proxy in front of it
// (TLS from the same CA) counts the requests and can slow blobs down, so a
// test can see how often each blob was fetched, or kill a pull in the
// middle of a layer.

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// TestRegistry is a docker-registry process and the proxy in front of it.
type TestRegistry struct {
	imagebuild.Registry // Host is the proxy's address; pushes go through it too
	// Direct is the registry's own host:port.
	Direct string
	// Dir holds the CA, the certificate, htpasswd, the config and the
	// registry's storage (Dir/data).
	Dir string

	cmd    *exec.Cmd
	exited <-chan struct{} // closed once cmd has exited (startTied)
	log    *os.File
	proxy  *http.Server

	mu       sync.Mutex
	requests map[string]int // "GET /v2/..." -> count
	// delay is slept per 32 KiB of a blob's body sent through the proxy.
	delay time.Duration
}

// StartRegistry starts a registry with user "e2e" and a random password.
// It is stopped, by PID, when the test ends.
func StartRegistry(t testing.TB) *TestRegistry {
	t.Helper()
	if _, err := exec.LookPath("docker-registry"); err != nil {
		t.Fatalf("docker-registry is not installed: run make deps (Debian's docker-registry package)")
	}
	// Owned: a sweep by a run beside this one leaves it alone while this
	// process lives (under ncsi-, the agents' prefix, it was taken for a
	// dead agent's after two minutes and removed under the registry).
	dir := OwnedTempDir(t, "ncsr-")
	t.Cleanup(func() { os.RemoveAll(dir) })
	r := &TestRegistry{Dir: dir, requests: map[string]int{}}
	r.Username, r.Password = "e2e", randomString(24)
	if err := r.writeTLS(); err != nil {
		t.Fatal(err)
	}
	hash, err := bcrypt.GenerateFromPassword([]byte(r.Password), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	fatalIf(t, os.WriteFile(filepath.Join(dir, "htpasswd"), []byte(r.Username+":"+string(hash)+"\n"), 0o600))
	ports, err := freePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	r.Direct = fmt.Sprintf("127.0.0.1:%d", ports[0])
	r.Host = fmt.Sprintf("127.0.0.1:%d", ports[1])
	config := fmt.Sprintf(`version: 0.1
log:
  level: info
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %s/data
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: %s
  tls:
    certificate: %s/server.pem
    key: %s/server-key.pem
auth:
  htpasswd:
    realm: e2e
    path: %s/htpasswd
`, dir, r.Direct, dir, dir, dir)
	fatalIf(t, os.WriteFile(filepath.Join(dir, "config.yml"), []byte(config), 0o600))
	if err := r.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
	if err := r.startProxy(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.proxy.Close() })
	return r
}

func fatalIf(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func randomString(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)[:n]
}

// Start starts (or starts again) the registry process and waits until it
// answers.
func (r *TestRegistry) Start() error {
	logFile, err := os.OpenFile(filepath.Join(r.Dir, "registry.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	cmd := exec.Command("docker-registry", "serve", filepath.Join(r.Dir, "config.yml"))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	exited, err := startTied(cmd)
	if err != nil {
		logFile.Close()
		return fmt.Errorf("failed to start docker-registry: %w", err)
	}
	r.cmd, r.exited, r.log = cmd, exited, logFile
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.DialTimeout("tcp", r.Direct, 200*time.Millisecond); err == nil {
			c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.Stop()
	b, _ := os.ReadFile(filepath.Join(r.Dir, "registry.log"))
	return fmt.Errorf("docker-registry did not listen on %s within 15s:\n%s", r.Direct, b)
}

// Stop stops the registry process by its PID (the proxy stays: requests
// through it fail as a registry that is down).
func (r *TestRegistry) Stop() {
	if r.cmd == nil || r.cmd.Process == nil {
		return
	}
	_ = r.cmd.Process.Kill()
	<-r.exited
	r.cmd = nil
	r.log.Close()
}

// Requests returns how many requests the proxy saw for "METHOD path"
// keys whose path contains substr.
func (r *TestRegistry) Requests(method, substr string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for k, c := range r.requests {
		if strings.HasPrefix(k, method+" ") && strings.Contains(k, substr) {
			n += c
		}
	}
	return n
}

// ResetRequests forgets the counts.
func (r *TestRegistry) ResetRequests() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requests = map[string]int{}
}

// SetBlobDelay slows each blob body sent through the proxy by d per 32 KiB.
func (r *TestRegistry) SetBlobDelay(d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.delay = d
}

// BlobFile is the registry's file of a blob (to tamper with).
func (r *TestRegistry) BlobFile(digest string) string {
	hex := strings.TrimPrefix(digest, "sha256:")
	return filepath.Join(r.Dir, "data", "docker", "registry", "v2", "blobs", "sha256", hex[:2], hex, "data")
}

// DockerConfig writes a docker-style config.json with the credentials for
// the registry (password as given) and returns its path.
func (r *TestRegistry) DockerConfig(t testing.TB, password string) string {
	t.Helper()
	auth := base64.StdEncoding.EncodeToString([]byte(r.Username + ":" + password))
	p := filepath.Join(r.Dir, "config-"+randomString(6)+".json")
	fatalIf(t, os.WriteFile(p, []byte(fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, r.Host, auth)), 0o600))
	return p
}

func (r *TestRegistry) startProxy() error {
	target, _ := url.Parse("https://" + r.Direct)
	rp := httputil.NewSingleHostReverseProxy(target)
	pool := x509.NewCertPool()
	ca, err := os.ReadFile(r.CAFile)
	if err != nil {
		return err
	}
	pool.AppendCertsFromPEM(ca)
	rp.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	rp.ErrorLog = log.New(io.Discard, "", 0)
	rp.ModifyResponse = func(resp *http.Response) error {
		if strings.Contains(resp.Request.URL.Path, "/blobs/sha256:") && resp.Request.Method == http.MethodGet {
			r.mu.Lock()
			d := r.delay
			r.mu.Unlock()
			if d > 0 {
				resp.Body = &slowBody{rc: resp.Body, delay: d}
			}
		}
		return nil
	}
	handler := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		r.requests[req.Method+" "+req.URL.Path]++
		r.mu.Unlock()
		rp.ServeHTTP(w, req)
	})
	cert, err := tls.LoadX509KeyPair(filepath.Join(r.Dir, "server.pem"), filepath.Join(r.Dir, "server-key.pem"))
	if err != nil {
		return err
	}
	ln, err := tls.Listen("tcp", r.Host, &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		return err
	}
	r.proxy = &http.Server{Handler: handler, ErrorLog: nil}
	go func() { _ = r.proxy.Serve(ln) }()
	return nil
}

// slowBody sends a body 32 KiB at a time, sleeping between.
type slowBody struct {
	rc    io.ReadCloser
	delay time.Duration
}

func (s *slowBody) Read(p []byte) (int, error) {
	if len(p) > 32<<10 {
		p = p[:32<<10]
	}
	time.Sleep(s.delay)
	return s.rc.Read(p)
}

func (s *slowBody) Close() error { return s.rc.Close() }

// writeTLS makes a CA and a certificate for 127.0.0.1 signed by it.
func (r *TestRegistry) writeTLS() error {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "nomad-driver-csi e2e CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	r.CAFile = filepath.Join(r.Dir, "ca.pem")
	for name, block := range map[string]*pem.Block{
		"ca.pem":         {Type: "CERTIFICATE", Bytes: caDER},
		"server.pem":     {Type: "CERTIFICATE", Bytes: der},
		"server-key.pem": {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(filepath.Join(r.Dir, name), pem.EncodeToMemory(block), 0o600); err != nil {
			return err
		}
	}
	return nil
}
