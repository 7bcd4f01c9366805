//go:build e2e

package bench

import (
	"testing"

	"github.com/shoenig/test/must"
)

// The variants change only what they say: the user, and privileged for the
// privileged one, in every task of a parsed job.
func TestTaskVariants(t *testing.T) {
	cases := []struct {
		variant    string
		privileged bool
	}{
		{variantIsolated, false},
		{variantPrivileged, true},
	}
	for _, c := range cases {
		t.Run(c.variant, func(t *testing.T) {
			must.Eq(t, "csi", variantDriver(c.variant))
			job := map[string]any{"TaskGroups": []any{map[string]any{"Tasks": []any{
				map[string]any{"Name": "t", "Config": map[string]any{"command": "/bin/sleep"}},
				map[string]any{"Name": "u"},
			}}}}
			tweakTasks(t, job, taskVariants[c.variant])
			for _, task := range job["TaskGroups"].([]any)[0].(map[string]any)["Tasks"].([]any) {
				task := task.(map[string]any)
				must.Eq(t, "root", task["User"])
				priv, set := taskConfig(task)["privileged"]
				must.Eq(t, c.privileged, set && priv == true, must.Sprintf("task %s: config %v", task["Name"], task["Config"]))
			}
		})
	}
	must.Eq(t, "exec", variantDriver("exec"))
}

func TestWithoutArgs(t *testing.T) {
	cases := []struct {
		name       string
		args, want []any
	}{
		{"middle", []any{"--state-dir", "s", "--hang", "NodeStageVolume", "--x"}, []any{"--state-dir", "s", "--x"}},
		{"end", []any{"a", "--hang", "NodeStageVolume"}, []any{"a"}},
		{"absent", []any{"a", "--hang", "Probe"}, []any{"a", "--hang", "Probe"}},
		{"empty", nil, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			must.Eq(t, c.want, withoutArgs(c.args, "--hang", "NodeStageVolume"))
		})
	}
}
