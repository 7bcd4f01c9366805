package image

import (
	"context"
	"encoding/base64"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/shoenig/test/must"
)

// helperScript installs docker-credential-<name> into a directory put
// first in PATH for the test.
func helperScript(t *testing.T, name, body string) {
	t.Helper()
	dir := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(dir, "docker-credential-"+name), []byte("#!/bin/sh\n"+body), 0o755))
	t.Setenv("PATH", dir+":"+os.Getenv("PATH"))
}

func authOf(t *testing.T, a authn.Authenticator) authn.AuthConfig {
	t.Helper()
	c, err := a.Authorization()
	must.NoError(t, err)
	return *c
}

func TestAuthenticatorOrder(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.json")
	basic := base64.StdEncoding.EncodeToString([]byte("fileuser:filepass"))
	must.NoError(t, os.WriteFile(cfg, []byte(`{
		"auths": {"https://reg.example:5000/v1/": {"auth": "`+basic+`"}, "token.example": {"identitytoken": "tok"}},
		"credHelpers": {"helped.example": "stub"},
		"credsStore": "stub"
	}`), 0o600))
	helperScript(t, "stub", `read server; echo "{\"ServerURL\":\"$server\",\"Username\":\"helper-$server\",\"Secret\":\"s3cret\"}"`)
	s := &Store{opts: Options{AuthConfigFile: cfg}}

	a, err := s.authenticator(ctx, "reg.example:5000", &Credentials{Username: "task", Password: "tp"})
	must.NoError(t, err)
	must.Eq(t, "task", authOf(t, a).Username)
	a, err = s.authenticator(ctx, "reg.example:5000", nil)
	must.NoError(t, err)
	must.Eq(t, authn.AuthConfig{Username: "fileuser", Password: "filepass"}, authOf(t, a))
	a, err = s.authenticator(ctx, "token.example", nil)
	must.NoError(t, err)
	must.Eq(t, "tok", authOf(t, a).IdentityToken)
	a, err = s.authenticator(ctx, "helped.example", nil)
	must.NoError(t, err)
	must.Eq(t, authn.AuthConfig{Username: "helper-helped.example", Password: "s3cret"}, authOf(t, a))
	// credsStore answers for any other registry of the file.
	a, err = s.authenticator(ctx, "other.example", nil)
	must.NoError(t, err)
	must.Eq(t, "helper-other.example", authOf(t, a).Username)

	// The plugin's helper alone, and none.
	s = &Store{opts: Options{AuthHelper: "stub"}}
	a, err = s.authenticator(ctx, "x.example", nil)
	must.NoError(t, err)
	must.Eq(t, "s3cret", authOf(t, a).Password)
	s = &Store{}
	a, err = s.authenticator(ctx, "x.example", nil)
	must.NoError(t, err)
	must.Eq(t, authn.Anonymous, a)
}

func TestHelperFailuresKeepSecrets(t *testing.T) {
	ctx := context.Background()
	helperScript(t, "leaky", `echo "password=hunter2 for $(cat)"; exit 3`)
	helperScript(t, "notfound", `echo "credentials not found in native keychain"; exit 1`)
	helperScript(t, "garbage", `echo "hunter2"`)
	_, _, err := fromHelper(ctx, "leaky", "reg.example")
	must.ErrorContains(t, err, "docker-credential-leaky failed for registry reg.example (exit status 3)")
	must.StrNotContains(t, err.Error(), "hunter2")
	_, found, err := fromHelper(ctx, "notfound", "reg.example")
	must.NoError(t, err)
	must.False(t, found)
	_, _, err = fromHelper(ctx, "garbage", "reg.example")
	must.ErrorContains(t, err, "gave no valid answer")
	must.StrNotContains(t, err.Error(), "hunter2")
	_, _, err = fromHelper(ctx, "missing", "reg.example")
	must.ErrorContains(t, err, "docker-credential-missing is not in the driver's PATH")
	_, _, err = fromHelper(ctx, "../../bin/sh", "reg.example")
	must.ErrorContains(t, err, "is not a helper name")

	// A config file that is not JSON is not quoted.
	cfg := filepath.Join(t.TempDir(), "config.json")
	must.NoError(t, os.WriteFile(cfg, []byte("root:hunter2:19000::::::\n"), 0o600))
	_, _, err = fromDockerConfig(ctx, cfg, "reg.example")
	must.ErrorContains(t, err, "is not a docker config file")
	must.StrNotContains(t, err.Error(), "hunter2")
	must.False(t, strings.Contains(Credentials{Username: "u", Password: "hunter2"}.String(), "hunter2"))
}
