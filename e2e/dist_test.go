//go:build e2e

package e2e

// make dist's version: the tag of a clean, tagged HEAD without its "v",
// else the development version, VERSION= over both, and a tag Nomad could
// not parse refused before anything is built. Checked on a scratch git
// repository holding the GNUmakefile (no build).

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

func TestDistVersion(t *testing.T) {
	t.Parallel()
	root, err := RepoRoot()
	must.NoError(t, err)
	dir := t.TempDir()
	mk, err := os.ReadFile(filepath.Join(root, "GNUmakefile"))
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(filepath.Join(dir, "GNUmakefile"), mk, 0o644))
	// The GNUmakefile hashes the Nomad pin when it is read.
	must.NoError(t, os.MkdirAll(filepath.Join(dir, "tools", "nomad"), 0o755))
	for _, f := range []string{"go.mod", "go.sum"} {
		must.NoError(t, os.WriteFile(filepath.Join(dir, "tools", "nomad", f), nil, 0o644))
	}

	run := func(args ...string) (string, error) {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GIT_CONFIG_GLOBAL=/dev/null", "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@t",
			"GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@t")
		out, err := cmd.CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	git := func(args ...string) string {
		out, err := run(append([]string{"git"}, args...)...)
		must.NoError(t, err, must.Sprintf("git %v: %s", args, out))
		return out
	}
	version := func(args ...string) string {
		out, err := run(append([]string{"make", "-s", "dist-version"}, args...)...)
		must.NoError(t, err, must.Sprint(out))
		return out
	}
	git("init", "-q")
	git("add", "GNUmakefile")
	git("commit", "-q", "-m", "one")
	rev := git("rev-parse", "--short", "HEAD")

	dev := regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+-dev\+` + rev + `$`)
	must.RegexMatch(t, dev, version(), must.Sprint("untagged"))
	git("tag", "v1.2.3")
	must.Eq(t, "1.2.3", version(), must.Sprint("tagged v1.2.3"))
	must.Eq(t, "2.0.0-rc.1", version("VERSION=2.0.0-rc.1"), must.Sprint("VERSION= wins"))
	must.NoError(t, os.WriteFile(filepath.Join(dir, "GNUmakefile"), append(mk, '\n'), 0o644))
	must.RegexMatch(t, regexp.MustCompile(`-dev\+`+rev+`\.dirty$`), version(), must.Sprint("tagged but dirty"))
	git("checkout", "-q", "GNUmakefile")

	// A tag Nomad cannot parse as semver stops make dist before it builds.
	git("tag", "-d", "v1.2.3")
	git("tag", "release-7")
	must.Eq(t, "release-7", version())
	out, err := run("make", "-s", "dist", "DIST_DIR="+filepath.Join(dir, "out"))
	must.Error(t, err, must.Sprint(out))
	must.StrContains(t, out, `version "release-7" is not semver`)
	_, err = os.Stat(filepath.Join(dir, "out"))
	must.True(t, os.IsNotExist(err), must.Sprint("make dist made its directory for a bad version"))
}
