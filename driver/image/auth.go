package image

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
)

// Credentials are a task's auth block. They are never logged: String and
// GoString hide them.
type Credentials struct {
	Username string
	Password string
}

func (c Credentials) String() string   { return "Credentials{<redacted>}" }
func (c Credentials) GoString() string { return c.String() }

// empty says whether the block gives nothing.
func (c *Credentials) empty() bool { return c == nil || (c.Username == "" && c.Password == "") }

// validHelper is a credential helper's name: the suffix of
// docker-credential-<name>, looked up in the driver's PATH.
var validHelper = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// helperTimeout bounds one run of a credential helper.
const helperTimeout = 30 * time.Second

// authenticator picks the credentials for registry, in the order of
// Nomad's docker driver: the task's auth block, then the plugin's auth
// config file (its auths, credHelpers and credsStore), then the plugin's
// auth helper, then none.
func (s *Store) authenticator(ctx context.Context, registry string, task *Credentials) (authn.Authenticator, error) {
	if !task.empty() {
		return authn.FromConfig(authn.AuthConfig{Username: task.Username, Password: task.Password}), nil
	}
	if s.opts.AuthConfigFile != "" {
		cfg, found, err := fromDockerConfig(ctx, s.opts.AuthConfigFile, registry)
		if err != nil {
			return nil, err
		}
		if found {
			return authn.FromConfig(cfg), nil
		}
	}
	if s.opts.AuthHelper != "" {
		cfg, found, err := fromHelper(ctx, s.opts.AuthHelper, registry)
		if err != nil {
			return nil, err
		}
		if found {
			return authn.FromConfig(cfg), nil
		}
	}
	return authn.Anonymous, nil
}

// dockerConfig is the part of a docker-style config.json that holds
// credentials.
type dockerConfig struct {
	Auths map[string]struct {
		Auth          string `json:"auth"`
		Username      string `json:"username"`
		Password      string `json:"password"`
		IdentityToken string `json:"identitytoken"`
		RegistryToken string `json:"registrytoken"`
	} `json:"auths"`
	CredHelpers map[string]string `json:"credHelpers"`
	CredsStore  string            `json:"credsStore"`
}

// registryKey reduces a config key ("https://index.docker.io/v1/",
// "registry.example:5000") to host[:port].
func registryKey(k string) string {
	k = strings.TrimPrefix(strings.TrimPrefix(k, "https://"), "http://")
	if i := strings.IndexByte(k, '/'); i >= 0 {
		k = k[:i]
	}
	k = strings.ToLower(k)
	if k == "docker.io" || k == "registry-1.docker.io" {
		k = "index.docker.io"
	}
	return k
}

// fromDockerConfig reads the credentials for registry from a docker-style
// config file. Its errors never quote the file.
func fromDockerConfig(ctx context.Context, file, registry string) (authn.AuthConfig, bool, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return authn.AuthConfig{}, false, fmt.Errorf("the plugin's auth config %q cannot be read: %w", file, errors.Unwrap(err))
	}
	var dc dockerConfig
	if err := json.Unmarshal(b, &dc); err != nil {
		return authn.AuthConfig{}, false, fmt.Errorf("the plugin's auth config %q is not a docker config file (invalid JSON)", file)
	}
	want := registryKey(registry)
	for k, h := range dc.CredHelpers {
		if registryKey(k) == want {
			return fromHelper(ctx, h, registry)
		}
	}
	for k, a := range dc.Auths {
		if registryKey(k) != want {
			continue
		}
		cfg := authn.AuthConfig{Username: a.Username, Password: a.Password, IdentityToken: a.IdentityToken, RegistryToken: a.RegistryToken}
		if a.Auth != "" {
			raw, err := base64.StdEncoding.DecodeString(a.Auth)
			user, pass, ok := strings.Cut(string(raw), ":")
			if err != nil || !ok {
				return authn.AuthConfig{}, false, fmt.Errorf("the plugin's auth config %q has an auth entry for %s that is not base64 of user:password", file, registry)
			}
			cfg.Username, cfg.Password = user, pass
		}
		return cfg, true, nil
	}
	if dc.CredsStore != "" {
		return fromHelper(ctx, dc.CredsStore, registry)
	}
	return authn.AuthConfig{}, false, nil
}

// fromHelper runs docker-credential-<helper> get for registry. Its output
// holds the secret and is never quoted in an error; "credentials not
// found" is no credentials, not an error.
func fromHelper(ctx context.Context, helper, registry string) (authn.AuthConfig, bool, error) {
	if !validHelper.MatchString(helper) {
		return authn.AuthConfig{}, false, fmt.Errorf("credential helper %q is not a helper name (docker-credential-<name>): use letters, digits, '.', '_' and '-'", helper)
	}
	ctx, cancel := context.WithTimeout(ctx, helperTimeout)
	defer cancel()
	prog := "docker-credential-" + helper
	cmd := exec.CommandContext(ctx, prog, "get")
	server := registry
	if registryKey(registry) == "index.docker.io" {
		server = "https://index.docker.io/v1/"
	}
	cmd.Stdin = strings.NewReader(server)
	var out limitedBuffer
	cmd.Stdout = &out
	cmd.Stderr = io.Discard
	err := cmd.Run()
	if err != nil {
		if bytes.Contains(out.Bytes(), []byte("credentials not found")) {
			return authn.AuthConfig{}, false, nil
		}
		if errors.Is(err, exec.ErrNotFound) {
			return authn.AuthConfig{}, false, fmt.Errorf("credential helper %s is not in the driver's PATH: install it or fix the plugin's auth helper", prog)
		}
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			err = fmt.Errorf("exit status %d", ee.ExitCode())
		}
		return authn.AuthConfig{}, false, fmt.Errorf("credential helper %s failed for registry %s (%v); check the helper's configuration", prog, registry, err)
	}
	var resp struct {
		Username string `json:"Username"`
		Secret   string `json:"Secret"`
	}
	if out.over || json.Unmarshal(out.Bytes(), &resp) != nil {
		return authn.AuthConfig{}, false, fmt.Errorf("credential helper %s gave no valid answer for registry %s", prog, registry)
	}
	if resp.Username == "<token>" {
		return authn.AuthConfig{IdentityToken: resp.Secret}, true, nil
	}
	return authn.AuthConfig{Username: resp.Username, Password: resp.Secret}, true, nil
}

// limitedBuffer keeps the first 64 KiB written to it.
type limitedBuffer struct {
	bytes.Buffer
	over bool
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if room := 64<<10 - b.Len(); len(p) > room {
		b.over = true
		b.Buffer.Write(p[:max(room, 0)])
		return len(p), nil
	}
	return b.Buffer.Write(p)
}
