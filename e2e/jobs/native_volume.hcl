# A volume spec for nomad volume create, made by plugin {{.Vars.PluginID}}.
# Vars: VolumeID, PluginID, AccessMode, VolumeType.
id        = "{{.Vars.VolumeID}}"
name      = "{{.Vars.VolumeID}}"
type      = "csi"
plugin_id = "{{.Vars.PluginID}}"

capacity_min = "64MiB"
capacity_max = "128MiB"

capability {
  access_mode     = "{{.Vars.AccessMode}}"
  attachment_mode = "file-system"
}

parameters {
  type = "{{.Vars.VolumeType}}"
}
