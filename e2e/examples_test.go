//go:build e2e

package e2e

// Every example the README points at is checked against the real agent:
// the job files with "nomad job validate", the agent configuration with
// "nomad config validate".

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/shoenig/test/must"
)

var hclVariable = regexp.MustCompile(`(?m)^variable\s+"([^"]+)"`)

func TestExamplesValidate(t *testing.T) {
	t.Parallel()
	a := shared(t)

	// Values for the examples' HCL2 variables, given whether or not the
	// variable has a default, so that the defaults need not exist here.
	values := map[string]string{
		"plugin_id":      "fixture",
		"plugin_command": "/bin/true",
		"plugin_args":    HCLList("--state-dir", "/tmp/csi-fixture-example"),
	}
	files, err := filepath.Glob(filepath.Join(a.Root, "examples", "jobs", "*.hcl"))
	must.NoError(t, err)
	must.SliceNotEmpty(t, files, must.Sprint("no job files in examples/jobs"))
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			t.Parallel()
			src, err := os.ReadFile(file)
			must.NoError(t, err)
			args := []string{"job", "validate"}
			for _, m := range hclVariable.FindAllStringSubmatch(string(src), -1) {
				if v, ok := values[m[1]]; ok {
					args = append(args, "-var", m[1]+"="+v)
				}
			}
			out, err := a.Nomad(append(args, file)...)
			must.NoError(t, err, must.Sprintf("nomad %v %s:\n%s", args, file, out))
			must.StrContains(t, out, "Job validation successful")
		})
	}

	t.Run("agent.hcl", func(t *testing.T) {
		t.Parallel()
		file := filepath.Join(a.Root, "examples", "agent.hcl")
		out, err := a.Nomad("config", "validate", file)
		must.NoError(t, err, must.Sprintf("nomad config validate %s:\n%s", file, out))
		must.StrContains(t, out, "Configuration is valid")
	})
}
