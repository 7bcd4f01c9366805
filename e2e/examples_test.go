//go:build e2e

package e2e

// Every example the README and docs/ show is a file under examples/
// (tools/docscheck checks the pages against the files), and every such file
// is checked against the real agent: the job files of examples/jobs with
// "nomad job validate" and the config of each of their csi tasks through
// the driver's own schema (which "nomad job validate" does not check), the
// agent configurations (examples/*.hcl) with "nomad config validate".
// examples/native is checked the same way by TestNativeCSI, which also runs
// it.

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/hashicorp/nomad/api"
	"github.com/hashicorp/nomad/helper/pluginutils/hclspecutils"
	"github.com/hashicorp/nomad/helper/pluginutils/hclutils"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"github.com/zclconf/go-cty/cty"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
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
			vars := map[string]string{}
			for _, m := range hclVariable.FindAllStringSubmatch(string(src), -1) {
				if v, ok := values[m[1]]; ok {
					args = append(args, "-var", m[1]+"="+v)
					vars[m[1]] = v
				}
			}
			out, err := a.Nomad(append(args, file)...)
			must.NoError(t, err, must.Sprintf("nomad %v %s:\n%s", args, file, out))
			must.StrContains(t, out, "Job validation successful")
			must.Positive(t, checkCSITaskConfigs(t, a, file, vars), must.Sprint("every job of examples/jobs runs on the csi driver"))
		})
	}

	agents, err := filepath.Glob(filepath.Join(a.Root, "examples", "*.hcl"))
	must.NoError(t, err)
	must.SliceContains(t, agents, filepath.Join(a.Root, "examples", "agent.hcl"))
	for _, file := range agents {
		t.Run(filepath.Base(file), func(t *testing.T) {
			t.Parallel()
			out, err := a.Nomad("config", "validate", file)
			must.NoError(t, err, must.Sprintf("nomad config validate %s:\n%s", file, out))
			must.StrContains(t, out, "Configuration is valid")
		})
	}
}

// checkCSITaskConfigs parses a job file with the agent (with the HCL2
// variables given) and decodes the config of each task with driver = "csi"
// through the driver's task config schema and into its struct, as the Nomad
// client does before it hands the task to the driver: a key the driver does
// not know, or a value of the wrong type, fails here rather than at a
// user's first run. It returns the number of csi tasks it checked.
func checkCSITaskConfigs(t *testing.T, a *Agent, file string, vars map[string]string) int {
	t.Helper()
	src, err := os.ReadFile(file)
	must.NoError(t, err)
	var lines []string
	for k, v := range vars {
		lines = append(lines, fmt.Sprintf("%s = %s", k, hclValue(v)))
	}
	sort.Strings(lines)
	job, err := a.API().Jobs().ParseHCLOpts(&api.JobsParseRequest{JobHCL: string(src), Variables: strings.Join(lines, "\n")})
	must.NoError(t, err, must.Sprintf("parsing %s", file))

	schema, err := new(driver.Driver).TaskConfigSchema()
	must.NoError(t, err)
	spec, diags := hclspecutils.Convert(schema)
	must.False(t, diags.HasErrors(), must.Sprintf("the driver's task config schema: %v", diags))
	n := 0
	for _, g := range job.TaskGroups {
		for _, task := range g.Tasks {
			if task.Driver != driver.PluginName {
				continue
			}
			n++
			where := fmt.Sprintf("%s: group %q task %q", filepath.Base(file), *g.Name, task.Name)
			val, diags, _ := hclutils.ParseHclInterface(task.Config, spec, exampleTaskEnv)
			must.False(t, diags.HasErrors(), must.Sprintf("%s: the driver refuses its config: %v", where, diags))
			var cfg drivers.TaskConfig
			must.NoError(t, cfg.EncodeDriverConfig(val), must.Sprint(where))
			var tc driver.TaskConfig
			must.NoError(t, cfg.DecodeDriverConfig(&tc), must.Sprint(where))
			must.True(t, tc.Command != "" || tc.Image != "", must.Sprintf("%s: no command or image decoded", where))
		}
	}
	return n
}

// exampleTaskEnv are the variables of a task's environment that the
// examples' configs interpolate (as "${CSI_ENDPOINT}"), as the Nomad
// client gives them to a driver's config when it starts a task.
var exampleTaskEnv = map[string]cty.Value{
	"CSI_ENDPOINT":   cty.StringVal("unix:///csi/csi.sock"),
	"NOMAD_TASK_DIR": cty.StringVal("/local"),
}

// hclValue writes a -var value as the HCL of a variables file: lists as
// they are, anything else quoted.
func hclValue(v string) string {
	if strings.HasPrefix(v, "[") {
		return v
	}
	return fmt.Sprintf("%q", v)
}
