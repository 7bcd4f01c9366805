//go:build e2e

package e2e

// A reserved plugin id taken through Nomad's own csi_plugin block with a
// decoy. The driver reads which plugin a task of Nomad's block serves from
// the staging directory Nomad's plugin supervisor mounts,
// <data_dir>/client/csi/<type>/<id>. With ACLs off any job author can
// register a dynamic host volume at any existing host path, one in that
// directory included, and mount it into its task bidirectionally; Nomad's
// volume hook puts it ahead of the supervisor's mounts. On the code
// before this case, the decoy's id ("decoy-...", reserved by no grant) was
// read first, so a job the operator had granted privilege for its own
// tooling (no plugin_id) served the id the operator reserved for its
// plugin job, as Nomad registered it.

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/hashicorp/nomad/api"
	"github.com/shoenig/test/must"
)

func TestEscapeGrantNomadPluginDecoy(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	u := escUniq()
	reserved, decoy := "reserved-"+u, "decoy-"+u
	opJob, attackJob := "grant-op-"+u, "ops-decoy-"+u
	a := grantAgent(t, fmt.Sprintf(`
    privileged_grant {
      namespace = "default"
      job       = %q
      plugin_id = %q
    }
    privileged_grant {
      namespace = "default"
      job       = "ops-*"
    }
`, opJob, reserved), "", nil)

	// The decoy: a directory where Nomad keeps a plugin's staging
	// directory. A job makes Nomad create it by submitting a plugin job
	// of that id (the supervisor hook makes it before the driver runs,
	// and refuses, the task); here the test makes it.
	decoyDir := a.NativeStageDir("monolith", decoy)
	must.NoError(t, os.MkdirAll(decoyDir, 0o700))
	resp, _, err := a.api.HostVolumes().Register(&api.HostVolumeRegisterRequest{Volume: &api.HostVolume{
		Namespace: "default", Name: decoy, NodeID: a.NodeID, HostPath: decoyDir,
		RequestedCapabilities: []*api.HostVolumeCapability{{AttachmentMode: "file-system", AccessMode: "single-node-writer"}},
	}}, nil)
	must.NoError(t, err, must.Sprint("register the decoy host volume"))
	t.Logf("registered host volume %s at %s", resp.Volume.ID, decoyDir)
	t.Cleanup(func() {
		if _, _, err := a.api.HostVolumes().Delete(&api.HostVolumeDeleteRequest{ID: resp.Volume.ID}, nil); err != nil {
			t.Logf("delete host volume %s: %v", resp.Volume.ID, err)
		}
	})

	grantRunNative(t, a, attackJob, reserved, func(job *api.Job) {
		g := job.TaskGroups[0]
		g.Volumes = map[string]*api.VolumeRequest{"decoy": {Name: "decoy", Type: "host", Source: decoy,
			AccessMode: "single-node-writer", AttachmentMode: "file-system"}}
		vol, dest, prop := "decoy", "/decoy", "bidirectional"
		g.Tasks[0].VolumeMounts = append(g.Tasks[0].VolumeMounts, &api.VolumeMount{Volume: &vol, Destination: &dest, PropagationMode: &prop})
	})

	al := waitNamespacedAlloc(t, a, "default", attackJob, escTimeout, StatusRunning, StatusFailed)
	text := eventsText(al, "plugin")
	t.Logf("events of job %s:\n%s", attackJob, text)
	if al.ClientStatus == StatusRunning {
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			p, _, err := a.api.CSIPlugins().Info(reserved, nil)
			if err == nil && p.NodesHealthy > 0 {
				t.Errorf("ESCAPED: job %s serves plugin %q, reserved for job %s, through Nomad's csi_plugin block (%d healthy nodes)", attackJob, reserved, opJob, p.NodesHealthy)
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
		for _, pid := range TaskPIDs(al.ID, "plugin") {
			capEff, _ := CapEff(pid)
			t.Errorf("ESCAPED: the decoy job's plugin task runs privileged: pid %d, CapEff %016x", pid, capEff)
		}
		t.Fatalf("job %s runs: it was not refused", attackJob)
	}
	must.StrContains(t, text, "the task has mounts of Nomad's csi_plugin staging directories of more than one plugin")
	must.StrContains(t, text, fmt.Sprintf("%q", decoy))
	must.StrContains(t, text, fmt.Sprintf("%q", reserved))
	must.SliceEmpty(t, TaskPIDs(al.ID, "plugin"), must.Sprint("a refused task has processes"))
}
