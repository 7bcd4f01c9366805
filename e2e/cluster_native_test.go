//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// clusterNativeVolumes is case 1's native part: the fixture registered
// with Nomad's own csi_plugin block (a system job of this driver,
// jobs/cluster_plugin_native.hcl) is healthy on every client; a volume
// made with "nomad volume create" is created by one client's instance,
// which gives it that node's topology, and Nomad's CSI scheduling places
// the workload that claims it on that node, where it writes and reads its
// file; stopping the workload releases the claim and leaves no mount of
// the volume on any client.
func clusterNativeVolumes(t *testing.T, c *Cluster) {
	id := "cnat"
	base := filepath.Join(c.Server.Dir, "fx-"+id)
	for _, a := range c.Clients {
		must.NoError(t, os.MkdirAll(filepath.Join(base, a.NodeName()), 0o755))
	}
	c.Server.RunJob(t, "cluster_plugin_native", map[string]string{
		"PluginID": id, "Command": filepath.Join(VolCSIBinDir(c.Server.Root), "csi-fixture"),
		"StateBase": base, "MountDir": filepath.Join(c.Server.Dir, "sock-"+id),
	})
	_, err := c.Server.WaitNativePlugin(id, len(c.Clients), len(c.Clients), 2*time.Minute)
	must.NoError(t, err)

	vol := volUniq("cnv")
	must.NoError(t, c.Server.CreateNativeVolume(vol, id, "single-node-writer", "dir"))
	t.Cleanup(func() { _ = c.Server.DeleteNativeVolume(vol, time.Minute) })
	// Exactly one instance created it.
	var creator *Agent
	var creatorName string
	for _, a := range c.Clients {
		p := &VolFixture{ID: id, StateDir: filepath.Join(base, a.NodeName(), "state"), CallLog: filepath.Join(base, a.NodeName(), "calls.log"), agent: a, t: t}
		if p.VolumeID(vol) != "" {
			must.Nil(t, creator, must.Sprintf("volume %s created on %s and %s", vol, creatorName, a.NodeName()))
			creator, creatorName = a, a.NodeName()
		}
	}
	must.NotNil(t, creator, must.Sprintf("no instance of %s created %s", id, vol))

	dest := filepath.Join(c.Server.Dir, "mnt", vol)
	job, err := c.Server.RenderJob("native_workload", map[string]string{
		"Driver": DriverName, "Type": "service", "Count": "1", "VolumeID": vol, "AccessMode": "single-node-writer",
		"Dest": dest, "Script": fmt.Sprintf("echo native > %s/file\nexec sleep 3600", dest),
	})
	must.NoError(t, err)
	_, err = c.Server.SubmitRendered(job)
	must.NoError(t, err)
	al := c.Server.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	must.Eq(t, creator.NodeID, al.NodeID, must.Sprintf("the workload of volume %s (made on %s) was placed on %s", vol, creator.NodeName(), al.NodeID))
	out, err := c.Server.AllocExec(al.ID, "t", "/bin/sh", "-c", "cat "+dest+"/file")
	must.NoError(t, err, must.Sprint(out))
	must.StrContains(t, out, "native")

	c.Server.VolStopAndWait(t, job.ID, volTimeout)
	_, err = c.Server.WaitNativeVolumeReleased(vol, 90*time.Second)
	must.NoError(t, err)
	for _, a := range c.Clients {
		must.SliceEmpty(t, mountsNaming(t, a.NativeCSIDir(), vol), must.Sprintf("mounts of volume %s left on %s", vol, a.NodeName()))
	}
}

// mountsNaming lists the mount points under dir whose path names s.
func mountsNaming(t *testing.T, dir, s string) []string {
	t.Helper()
	all, err := MountsUnder(dir)
	must.NoError(t, err)
	var out []string
	for _, m := range all {
		if strings.Contains(m, s) {
			out = append(out, m)
		}
	}
	return out
}
