//go:build e2e

package bench

// What isolation costs (issue 9: "isolation may add at most 10 %"): the
// DriverOverhead and Volumes benchmarks start the same csi task as the
// same user (root) isolated, as every task that is not privileged is, and
// privileged, which is the absence of every isolation layer (the
// chroot_env root, /dev, /proc, /sys, PID and IPC namespaces, the device
// filter, the capability set), interleaved on one agent. Their agent's
// driver lets a task that is not a CSI plugin be privileged
// (privileged_plugins_only = false) for that.

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

// Variants of the csi sleep task (see submit): the task as root,
// isolated, and the same privileged.
const (
	variantIsolated   = "csi-root"
	variantPrivileged = "csi-privileged"
)

// taskVariants change a csi task of a parsed job (the API's JSON form) into
// a variant.
var taskVariants = map[string]func(task map[string]any){
	variantIsolated: func(task map[string]any) { task["User"] = "root" },
	variantPrivileged: func(task map[string]any) {
		task["User"] = "root"
		taskConfig(task)["privileged"] = true
	},
}

// variantDriver is the driver a variant's task runs on.
func variantDriver(name string) string {
	if _, ok := taskVariants[name]; ok {
		return "csi"
	}
	return name
}

// taskConfig is the config block of a parsed job's task.
func taskConfig(task map[string]any) map[string]any {
	c, _ := task["Config"].(map[string]any)
	if c == nil {
		c = map[string]any{}
		task["Config"] = c
	}
	return c
}

// tweakTasks applies tweak to every task of a parsed job.
func tweakTasks(tb testing.TB, job map[string]any, tweak func(task map[string]any)) {
	tb.Helper()
	groups, _ := job["TaskGroups"].([]any)
	n := 0
	for _, g := range groups {
		tasks, _ := g.(map[string]any)["Tasks"].([]any)
		for _, t := range tasks {
			tweak(t.(map[string]any))
			n++
		}
	}
	if n == 0 {
		tb.Fatalf("no task in the parsed job to change: %v", job)
	}
}

// startIsolationAgent starts the agent of a benchmark that compares
// isolated tasks with privileged ones: opts, with a driver that allows
// privileged tasks that are not plugins (privileged_plugins_only = false
// in the harness's driver block, whose cgroup_parent is the agent's own,
// and a grant for the sleep and volume jobs).
// Its root_dir is in a directory of the benchmark's own, which is cleaned
// up after the agent.
func startIsolationAgent(b *testing.B, opts e2e.AgentOptions) *e2e.Agent {
	b.Helper()
	// An OwnedTempDir: SweepStale takes it only once this process is gone.
	base := e2e.OwnedTempDir(b, "ncsb-")
	// Registered before StartAgent, so it runs after the agent's Close.
	b.Cleanup(func() {
		if err := e2e.UnmountUnder(base); err != nil {
			b.Errorf("mounts left under %s, not removing it: %v", base, err)
			return
		}
		if err := os.RemoveAll(base); err != nil {
			b.Errorf("failed to remove %s: %v", base, err)
		}
	})
	driverRoot := filepath.Join(base, "root")
	if err := os.MkdirAll(driverRoot, 0o700); err != nil {
		b.Fatal(err)
	}
	opts.AllowPrivileged = true
	opts.DriverRoot = driverRoot
	opts.DriverConfig += "\n    privileged_plugins_only = false"
	// The privileged variants of the benchmarks' sleep and volume jobs.
	for _, job := range []string{"sleep-*", "volume_task-*"} {
		opts.Grants += fmt.Sprintf("\n    privileged_grant {\n      namespace = \"*\"\n      job       = %q\n    }", job)
	}
	return e2e.StartAgent(b, opts)
}
