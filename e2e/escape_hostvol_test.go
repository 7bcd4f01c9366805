//go:build e2e

package e2e

// With ACLs off, Nomad registers a dynamic host volume at any existing
// host path (it checks only that the path exists), and any job mounts it.
// A host volume of "/" bound (recursively) into an ordinary task brought
// the host's /proc with it: on the code before this case a nobody task of
// one namespace read the environment of another namespace's nobody task
// through it, and wrote into that task's /alloc/data through
// /proc/<pid>/root; the host's /sys/fs/cgroup came along too. A host
// volume at that task's own /secrets directory, on the host under
// Nomad's allocations, read the file it kept there.

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/hashicorp/nomad/api"
	"github.com/shoenig/test/must"
)

func TestEscapeHostVolumeRegistered(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	u := escUniq()
	nsVictim, nsAttack := "hostvol-victim-"+u, "hostvol-attack-"+u
	a := grantAgent(t, "", `    denied_host_uids = "0"
    denied_host_gids = "0"`, nil)
	grantNamespace(t, a, nsVictim)
	grantNamespace(t, a, nsAttack)

	secret := "hostvol-secret-" + u
	victim := grantRun(t, a, grantJob{Namespace: nsVictim, Type: "service", Env: map[string]string{"HOSTVOL_SECRET": secret},
		Script: `echo "$HOSTVOL_SECRET" > /secrets/token; echo ready; exec sleep 300`})
	vAl := waitNamespacedAlloc(t, a, nsVictim, victim, escTimeout, StatusRunning)
	victimData := filepath.Join(a.DataDir, "alloc", vAl.ID, "alloc", "data")

	t.Run("root", func(t *testing.T) {
		resp, _, err := a.api.HostVolumes().Register(&api.HostVolumeRegisterRequest{Volume: &api.HostVolume{
			Namespace: nsAttack, Name: "root-" + u, NodeID: a.NodeID, HostPath: "/",
			RequestedCapabilities: []*api.HostVolumeCapability{{AttachmentMode: "file-system", AccessMode: "single-node-writer"}},
		}}, &api.WriteOptions{Namespace: nsAttack})
		must.NoError(t, err, must.Sprint("register a host volume at /"))
		t.Logf("registered host volume %s at / in namespace %s: state %s", resp.Volume.ID, nsAttack, resp.Volume.State)
		t.Cleanup(func() {
			if _, _, err := a.api.HostVolumes().Delete(&api.HostVolumeDeleteRequest{ID: resp.Volume.ID}, &api.WriteOptions{Namespace: nsAttack}); err != nil {
				t.Logf("delete host volume %s: %v", resp.Volume.ID, err)
			}
		})

		job := grantParse(t, a, grantJob{Namespace: nsAttack, Script: escTry + escWho + fmt.Sprintf(`
find_victim() {
  for e in /host/proc/[0-9]*/environ; do
    if tr '\0' '\n' < "$e" 2>/dev/null | grep -qx 'HOSTVOL_SECRET=%[1]s'; then basename "$(dirname "$e")"; return 0; fi
  done
  return 1
}
pid=$(find_victim)
try read_environ sh -c "tr '\0' '\n' < /host/proc/$pid/environ | grep HOSTVOL_SECRET"
try write_alloc_data sh -c "echo pwned > /host/proc/$pid/root/alloc/data/pwned-%[2]s"
try see_cgroupfs ls /host/sys/fs/cgroup
echo DONE
`, secret, u)})
		g := job.TaskGroups[0]
		g.Volumes = map[string]*api.VolumeRequest{"root": {Name: "root", Type: "host", Source: "root-" + u,
			AccessMode: "single-node-writer", AttachmentMode: "file-system"}}
		vol, dest := "root", "/host"
		g.Tasks[0].VolumeMounts = append(g.Tasks[0].VolumeMounts, &api.VolumeMount{Volume: &vol, Destination: &dest})
		grantTrack(t, a, nsAttack, *job.ID)
		_, _, err = a.api.Jobs().Register(job, &api.WriteOptions{Namespace: nsAttack})
		must.NoError(t, err)

		grantRefused(t, a, nsAttack, *job.ID, `is in or holds the host's proc file system at "/proc"`)
		escMustNotExist(t, filepath.Join(victimData, "pwned-"+u), "a file in the victim's /alloc/data")
	})

	t.Run("other_secrets", func(t *testing.T) {
		// The victim's /secrets itself, registered by its host path (its
		// allocation's id is in nomad job status, with ACLs off).
		hostSecrets := filepath.Join(a.DataDir, "alloc", vAl.ID, "t", "secrets")
		resp2, _, err := a.api.HostVolumes().Register(&api.HostVolumeRegisterRequest{Volume: &api.HostVolume{
			Namespace: nsAttack, Name: "secrets-" + u, NodeID: a.NodeID, HostPath: hostSecrets,
			RequestedCapabilities: []*api.HostVolumeCapability{{AttachmentMode: "file-system", AccessMode: "single-node-writer"}},
		}}, &api.WriteOptions{Namespace: nsAttack})
		must.NoError(t, err, must.Sprint("register a host volume at the victim's secrets"))
		t.Cleanup(func() {
			if _, _, err := a.api.HostVolumes().Delete(&api.HostVolumeDeleteRequest{ID: resp2.Volume.ID}, &api.WriteOptions{Namespace: nsAttack}); err != nil {
				t.Logf("delete host volume %s: %v", resp2.Volume.ID, err)
			}
		})
		job := grantParse(t, a, grantJob{Namespace: nsAttack, Script: escTry + escWho + `try read_secret cat /victim/token
echo DONE
`})
		g := job.TaskGroups[0]
		g.Volumes = map[string]*api.VolumeRequest{"secrets": {Name: "secrets", Type: "host", Source: "secrets-" + u,
			AccessMode: "single-node-writer", AttachmentMode: "file-system"}}
		vol, dest := "secrets", "/victim"
		g.Tasks[0].VolumeMounts = append(g.Tasks[0].VolumeMounts, &api.VolumeMount{Volume: &vol, Destination: &dest})
		grantTrack(t, a, nsAttack, *job.ID)
		_, _, err = a.api.Jobs().Register(job, &api.WriteOptions{Namespace: nsAttack})
		must.NoError(t, err)
		grantRefused(t, a, nsAttack, *job.ID, "the directories of other allocations or of the driver")
	})
}
