package metrics

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

// unixGet GETs /metrics over the unix socket at path, with the bearer
// token when it is set, and returns the status and body.
func unixGet(t *testing.T, path, token string) (int, string, error) {
	t.Helper()
	c := http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		},
	}}
	req, err := http.NewRequest(http.MethodGet, "http://metrics/metrics", nil)
	must.NoError(t, err)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	must.NoError(t, err)
	return resp.StatusCode, string(b), nil
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the socket's directory must be root's")
	}
}

// A TCP endpoint with a token serves only requests that carry it.
func TestServe_token(t *testing.T) {
	m := New(Source{Counts: func() csihook.VolumeCounts { return csihook.VolumeCounts{Staged: 1, Published: 2} }})
	srv, err := m.Serve(Listen{Address: "127.0.0.1:0", Token: "0123456789abcdef-token"})
	must.NoError(t, err)
	defer srv.Close()
	for _, tc := range []struct {
		auth string
		want int
	}{
		{"", http.StatusUnauthorized},
		{"Bearer wrong-token-0123456789", http.StatusUnauthorized},
		{"Bearer 0123456789abcdef-toke", http.StatusUnauthorized},
		{"Bearer 0123456789abcdef-token-", http.StatusUnauthorized},
		{"Basic 0123456789abcdef-token", http.StatusUnauthorized},
		{"0123456789abcdef-token", http.StatusUnauthorized},
		{"Bearer 0123456789abcdef-token", http.StatusOK},
	} {
		req, err := http.NewRequest(http.MethodGet, "http://"+srv.ListenAddr()+"/metrics", nil)
		must.NoError(t, err)
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		must.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		must.Eq(t, tc.want, resp.StatusCode, must.Sprintf("Authorization %q", tc.auth))
		if tc.want == http.StatusOK {
			must.StrContains(t, string(b), "nomad_driver_csi_volumes_published 2")
		} else {
			must.StrNotContains(t, string(b), "nomad_driver_csi")
			must.Eq(t, `Bearer realm="nomad-driver-csi metrics"`, resp.Header.Get("WWW-Authenticate"))
		}
	}
}

// The socket is root's, mode 0600, in place of a stale one, and goes when
// the server closes (unless another server's socket replaced it).
func TestServe_unixSocket(t *testing.T) {
	requireRoot(t)
	dir := filepath.Join(t.TempDir(), "run")
	path := filepath.Join(dir, "m.sock")
	m := New(Source{Counts: func() csihook.VolumeCounts { return csihook.VolumeCounts{Staged: 1, Published: 2} }})

	// A socket left by an earlier process is replaced.
	must.NoError(t, os.Mkdir(dir, 0o700))
	old, err := net.Listen("unix", path)
	must.NoError(t, err)
	old.(*net.UnixListener).SetUnlinkOnClose(false)
	must.NoError(t, old.Close())

	srv, err := m.Serve(Listen{Address: UnixPrefix + path})
	must.NoError(t, err)
	must.Eq(t, UnixPrefix+path, srv.ListenAddr())
	fi, err := os.Lstat(path)
	must.NoError(t, err)
	must.Eq(t, os.ModeSocket, fi.Mode().Type())
	must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())
	must.Eq(t, uint32(0), fi.Sys().(*syscall.Stat_t).Uid)
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	must.SliceLen(t, 1, entries, must.Sprint("a temporary socket was left"))
	code, body, err := unixGet(t, path, "")
	must.NoError(t, err)
	must.Eq(t, http.StatusOK, code)
	must.StrContains(t, body, "nomad_driver_csi_volumes_staged 1")

	// Another server takes the path over: closing the first leaves it.
	srv2, err := m.Serve(Listen{Address: UnixPrefix + path, Token: "0123456789abcdef-token"})
	must.NoError(t, err)
	must.NoError(t, srv.Close())
	code, _, err = unixGet(t, path, "")
	must.NoError(t, err)
	must.Eq(t, http.StatusUnauthorized, code)
	code, _, err = unixGet(t, path, "0123456789abcdef-token")
	must.NoError(t, err)
	must.Eq(t, http.StatusOK, code)
	must.NoError(t, srv2.Close())
	_, err = os.Lstat(path)
	must.True(t, os.IsNotExist(err), must.Sprintf("the socket is left: %v", err))

	// A missing directory is made, root's only.
	made := filepath.Join(t.TempDir(), "new", "dir")
	srv3, err := m.Serve(Listen{Address: UnixPrefix + filepath.Join(made, "m.sock")})
	must.NoError(t, err)
	fi, err = os.Stat(made)
	must.NoError(t, err)
	must.Eq(t, os.FileMode(0o700), fi.Mode().Perm())
	must.NoError(t, srv3.Close())
}

// A socket's directory that someone but root could change, a path that is
// not a socket, or a path too long for a socket is refused, saying why.
func TestServe_unixSocketRefused(t *testing.T) {
	requireRoot(t)
	m := New(Source{})
	base := t.TempDir()
	mk := func(name string, mode os.FileMode, uid int) string {
		dir := filepath.Join(base, name)
		must.NoError(t, os.Mkdir(dir, 0o700))
		must.NoError(t, os.Chmod(dir, mode))
		must.NoError(t, os.Chown(dir, uid, 0))
		return dir
	}
	notSocket := mk("file", 0o700, 0)
	must.NoError(t, os.WriteFile(filepath.Join(notSocket, "m.sock"), []byte("data"), 0o600))
	sticky := mk("sticky", os.ModeSticky|0o777, 0)
	cases := []struct {
		path, want string
	}{
		{filepath.Join(mk("groupw", 0o770, 0), "m.sock"), "is writable by others"},
		{filepath.Join(mk("worldw", 0o777, 0), "m.sock"), "is writable by others"},
		{filepath.Join(sticky, "m.sock"), "is writable by others"},
		{filepath.Join(mk("nobody", 0o700, 65534), "m.sock"), "is owned by uid 65534, not root"},
		{filepath.Join(notSocket, "m.sock"), "exists and is not a socket"},
		{"relative/m.sock", "must be absolute and clean"},
		{"/run/../run/m.sock", "must be absolute and clean"},
		{filepath.Join(base, strings.Repeat("x", 120)), "is too long"},
	}
	for _, tc := range cases {
		t.Run(tc.want, func(t *testing.T) {
			_, err := m.Serve(Listen{Address: UnixPrefix + tc.path})
			must.ErrorContains(t, err, tc.want)
			must.ErrorContains(t, err, "metrics_address")
		})
	}
	// Below a sticky directory (/tmp), a directory of root's own is fine.
	ok := filepath.Join(sticky, "own")
	must.NoError(t, os.Mkdir(ok, 0o700))
	srv, err := m.Serve(Listen{Address: UnixPrefix + filepath.Join(ok, "m.sock")})
	must.NoError(t, err)
	must.NoError(t, srv.Close())
	data, err := os.ReadFile(filepath.Join(notSocket, "m.sock"))
	must.NoError(t, err)
	must.Eq(t, "data", string(data))
}
