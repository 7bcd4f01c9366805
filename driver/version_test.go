package driver

import (
	"os/exec"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/hashicorp/go-version"
	"github.com/shoenig/test/must"
)

// stampRE finds the -X flag in the GNUmakefile's driver build command.
var stampRE = regexp.MustCompile(`-ldflags "[^"]*-X ([^= ]+)=([^" ]*)`)

// makeStamp returns the symbol and value `make dev` stamps into the driver,
// read from the commands `make -n` prints (nothing is built), with vars
// as extra make arguments.
func makeStamp(t *testing.T, vars ...string) (symbol, value string) {
	t.Helper()
	args := append([]string{"-n", "--no-print-directory", "-C", "..", "dev"}, vars...)
	out, err := exec.Command("make", args...).CombinedOutput()
	must.NoError(t, err, must.Sprintf("make %s: %s", strings.Join(args, " "), out))
	var build string
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, "go build ") && strings.Contains(line, " .") && strings.Contains(line, "-X ") {
			build = line
		}
	}
	m := stampRE.FindStringSubmatch(build)
	must.SliceLen(t, 3, m, must.Sprintf("no -X flag in the driver's build command; make -n dev printed:\n%s", out))
	return m[1], m[2]
}

// Nomad refuses to load a plugin whose PluginInfo version is not semver.
// The version `make dev` stamps ("<base>+<commit>[.dirty]", or the base
// alone outside git) must parse, with the commit as build metadata, and
// must land in this package's Version (go build ignores -X of a symbol
// that does not exist), which PluginInfo reports.
func TestVersionIsSemver(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("needs make to read the GNUmakefile's build command")
	}
	pkg := reflect.TypeOf(Driver{}).PkgPath()

	cases := []struct {
		name     string
		vars     []string
		metadata string
	}{
		{name: "clean checkout", vars: []string{"GIT_REV=c80d0ec", "GIT_DIRTY="}, metadata: "c80d0ec"},
		{name: "dirty checkout", vars: []string{"GIT_REV=c80d0ec", "GIT_DIRTY=.dirty"}, metadata: "c80d0ec.dirty"},
		{name: "outside git", vars: []string{"GIT_REV=", "GIT_DIRTY="}, metadata: ""},
		{name: "this checkout"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			symbol, value := makeStamp(t, tc.vars...)
			must.Eq(t, pkg+".Version", symbol)
			v, err := version.NewVersion(value)
			must.NoError(t, err, must.Sprintf("make dev stamps version %q", value))
			must.Eq(t, value, v.Original())
			// The unstamped default is the GNUmakefile's base version, so a
			// plain go build reports the same release.
			base, _, _ := strings.Cut(value, "+")
			must.Eq(t, Version, base, must.Sprint("driver.Version's default differs from the GNUmakefile's BASE_VERSION"))
			if tc.vars != nil {
				must.Eq(t, tc.metadata, v.Metadata())
			}
		})
	}

	info, err := (&Driver{}).PluginInfo()
	must.NoError(t, err)
	must.Eq(t, Version, info.PluginVersion)
}
