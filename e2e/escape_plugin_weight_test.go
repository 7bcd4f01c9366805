//go:build e2e

package e2e

// A plugin task's CPU weight is the operator's grant. A granted plugin
// task weighs at least plugin_cpu_shares (1024 here): it takes that share
// of the CPUs from the node's other tasks whenever they are contended. A
// job that writes its own csi_plugin block, for an id no grant reserves,
// must weigh its cpu and no more: otherwise any job could claim the weight
// of a plugin by declaring one, and slow every other task on a busy node.

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
)

func TestEscapePluginCPUWeight(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	u := escUniq()
	opJob, opPlugin := "weight-op-"+u, "weight-op-"+u
	a := grantAgent(t, fmt.Sprintf(`
    privileged_grant {
      namespace = "default"
      job       = %q
      plugin_id = %q
    }
`, opJob, opPlugin), "", nil)

	// The job's own plugin block, for an id nobody reserves: the
	// template's cpu = 20.
	attack := grantRun(t, a, grantJob{ID: "weight-attack-" + u, Script: "sleep 300", PluginID: "weight-free-" + u})
	// The operator's plugin, granted by its reserved id.
	op := grantRun(t, a, grantJob{ID: opJob, Script: "sleep 300", PluginID: opPlugin})

	alA := a.WaitAlloc(t, attack, escTimeout, StatusRunning)
	alO := a.WaitAlloc(t, op, escTimeout, StatusRunning)
	file, got, err := TaskCPUWeight(alA.ID, "t")
	must.NoError(t, err)
	_, granted, err := TaskCPUWeight(alO.ID, "t")
	must.NoError(t, err)
	t.Logf("%s: the job's own plugin weighs %d, the granted plugin %d", file, got, granted)
	// cpu = 20 is cpu.shares 20 on cgroup v1 and cpu.weight 6 on v2;
	// 1024 is cpu.weight 100.
	want, wantGranted := int64(20), int64(1024)
	if filepath.Base(file) == "cpu.weight" {
		want, wantGranted = 6, 100
	}
	if got > want {
		t.Errorf("ESCAPED: job %s, a csi_plugin block no grant names, weighs %d in %s, more than its cpu (%d)", attack, got, file, want)
	}
	must.Eq(t, want, got)
	// The check above proves something only if a granted plugin does get
	// the weight on this node.
	must.Eq(t, wantGranted, granted)
}
