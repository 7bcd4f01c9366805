# A volume for `nomad volume create volume.hcl`, made by the fixture plugin
# of plugin.nomad.hcl: a 64 MiB ext4 file system.
id        = "data"
name      = "data"
type      = "csi"
plugin_id = "fixture"

capacity_min = "64MiB"
capacity_max = "128MiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

parameters {
  type = "ext4"
}
