package driver

import (
	"testing"

	"github.com/hashicorp/nomad/helper/pluginutils/hclutils"
	"github.com/shoenig/test/must"
)

// The task config schema parses what a job author writes, as Nomad parses
// it: every block, maps written as blocks or as `x = { ... }`, and defaults.
func TestTaskConfigSpec_parsesJobHCL(t *testing.T) {
	var tc TaskConfig
	hclutils.NewConfigParser(taskConfigSpec).ParseHCL(t, `config {
  command    = "/usr/bin/app"
  args       = ["-v"]
  privileged = true

  csi_plugin {
    id   = "hostpath"
    type = "node"
  }

  volume "data" {
    plugin_id       = "hostpath"
    volume_id       = "db"
    destination     = "/srv/data"
    read_only       = true
    access_mode     = "single-node-reader-only"
    attachment_mode = "file-system"
    context         = { zone = "a" }
    secrets { token = "s3cr3t" }
    mount_options {
      fs_type     = "ext4"
      mount_flags = ["noatime"]
    }
    create {
      capacity_min = "1GiB"
      capacity_max = "2GiB"
      parameters   = { type = "ext4" }
    }
  }

  volume "scratch" {
    plugin_id   = "hostpath"
    volume_id   = "tmp"
    destination = "/scratch"
  }
}`, &tc)

	must.Eq(t, "/usr/bin/app", tc.Command)
	must.True(t, tc.Privileged)
	must.Eq(t, &PluginTaskConfig{ID: "hostpath", Type: "node", MountDir: "/csi", HealthTimeout: "30s", StopWait: "1m"}, tc.CSIPlugin)

	data := tc.Volumes["data"]
	must.Eq(t, "db", data.VolumeID)
	must.True(t, data.ReadOnly)
	must.Eq(t, map[string]string{"zone": "a"}, data.Context)
	must.Eq(t, map[string]string{"token": "s3cr3t"}, data.Secrets)
	must.Eq(t, &MountOptions{FSType: "ext4", MountFlags: []string{"noatime"}}, data.MountOptions)
	must.Eq(t, "1GiB", data.Create.CapacityMin)
	must.Eq(t, map[string]string{"type": "ext4"}, data.Create.Parameters)

	scratch := tc.Volumes["scratch"]
	must.Eq(t, "single-node-writer", scratch.AccessMode)
	must.Eq(t, "file-system", scratch.AttachmentMode)

	reqs, err := volumeRequests(tc.Volumes)
	must.NoError(t, err)
	must.Len(t, 2, reqs)
	must.Eq(t, "data", reqs[0].Name)
	must.Eq(t, int64(1<<30), reqs[0].Create.CapacityMin)
	must.Eq(t, int64(2<<30), reqs[0].Create.CapacityMax)
	must.Eq(t, "ext4", reqs[0].FSType)
}

func TestVolumeRequests_badSizes(t *testing.T) {
	_, err := volumeRequests(map[string]VolumeConfig{"d": {Create: &VolumeCreateBlock{CapacityMin: "lots"}}})
	must.ErrorContains(t, err, `volume "d": create capacity_min "lots" is not a size`)
	_, err = volumeRequests(map[string]VolumeConfig{"d": {Create: &VolumeCreateBlock{CapacityMin: "2GiB", CapacityMax: "1GiB"}}})
	must.ErrorContains(t, err, `capacity_min "2GiB" is larger than capacity_max "1GiB"`)
}
