package driver

import (
	"os"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// The task handle a driver built against Nomad's v1.11.3 SDK (msgpack v2
// codec) stored in Nomad's state is read back by this build (the v1.6.1
// SDK's codec) after an upgrade, field for field; and this build writes
// the same document, so a downgrade reads its handles too.
// testdata/taskstate-nomad-v1.11.3.msgpack is goldenTaskState encoded by
// drivers.TaskHandle.SetDriverState of that SDK.
func TestTaskState_readsHandlesOfTheV1_11SDK(t *testing.T) {
	golden, err := os.ReadFile("testdata/taskstate-nomad-v1.11.3.msgpack")
	must.NoError(t, err)

	h := &drivers.TaskHandle{Version: taskHandleVersion, DriverState: golden}
	var got TaskState
	must.NoError(t, h.GetDriverState(&got))
	must.Eq(t, goldenTaskState(), &got)
	must.True(t, got.StartedAt.Equal(goldenTaskState().StartedAt))

	// Encoded again: the same msgpack document, map order aside (the
	// codec writes a Go map in its iteration order, on either SDK).
	mine := drivers.NewTaskHandle(taskHandleVersion)
	must.NoError(t, mine.SetDriverState(goldenTaskState()))
	must.Eq(t, len(golden), len(mine.DriverState))
	var want, have any
	must.NoError(t, base.MsgPackDecode(golden, &want))
	must.NoError(t, base.MsgPackDecode(mine.DriverState, &have))
	must.Eq(t, want, have)

	// A pinned task's handle carries PinnedBy; a build without the field
	// (any earlier one) reads the rest of it.
	pinned := goldenTaskState()
	pinned.PinnedBy = `privileged_grant { namespace = "default", job = "plugin-job", command = "/usr/local/bin/p" }`
	must.NoError(t, mine.SetDriverState(pinned))
	var back TaskState
	must.NoError(t, mine.GetDriverState(&back))
	must.Eq(t, pinned, &back)
	var earlier struct {
		Process executor.State
		Plugin  *PluginTaskConfig
		JobID   string
	}
	must.NoError(t, base.MsgPackDecode(mine.DriverState, &earlier))
	must.Eq(t, "plugin-job", earlier.JobID)
	must.Eq(t, pinned.Process, earlier.Process)
}

// goldenTaskState is a TaskState with every field set, as
// testdata/taskstate-nomad-v1.11.3.msgpack holds it.
func goldenTaskState() *TaskState {
	return &TaskState{
		Process: executor.State{
			SupervisorPID: 4242, SupervisorStart: 987654321, TaskPID: 4243, TaskStart: 987654400,
			StateDir: "/var/lib/nomad-driver-csi/tasks/abc",
			Cgroup: cgroups.State{Version: 1, Paths: map[string]string{"memory": "/sys/fs/cgroup/memory/nomad-csi/abc", "pids": "/sys/fs/cgroup/pids/nomad-csi/abc"},
				CpusetCgroupPath: "/sys/fs/cgroup/cpuset/nomad/shared"},
			StartedAt: time.Date(2026, 11, 26, 20, 51, 7, 123456789, time.UTC),
			Profile: &executor.Profile{User: "nobody", Capabilities: []string{"CAP_CHOWN", "CAP_KILL"}, AmbientCapabilities: []string{"CAP_KILL"},
				Isolated: true, OOMScoreAdj: 100, NetNS: true},
		},
		StartedAt:     time.Date(2026, 11, 26, 20, 51, 7, 987654321, time.UTC),
		Plugin:        &PluginTaskConfig{ID: "fixture", Type: "monolith", MountDir: "/csi", HealthTimeout: "2m", StopWait: "30s"},
		Namespace:     "default",
		JobID:         "plugin-job",
		Volumes:       true,
		SharedSources: []string{"/srv/a", "/srv/b"},
	}
}
