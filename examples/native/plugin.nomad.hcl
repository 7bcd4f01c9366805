# A CSI plugin run by the csi driver and registered with Nomad's own CSI
# support: the task-level csi_plugin block is Nomad's, so the servers track
# the plugin (nomad plugin status), volumes are created and claimed through
# them (nomad volume create, volume blocks in job groups), and Nomad's client
# stages and publishes volumes by calling the plugin.
#
# Only the task's driver and config differ from a Docker-run plugin: the
# plugin binary is on the client instead of in an image.
#
# The csi driver runs tasks without filesystem isolation, so Nomad gives
# the plugin CSI_ENDPOINT as the socket's host path and the plugin must see
# the host's paths. Set stage_publish_base_dir to the host directory Nomad
# keeps this plugin's mounts in, <client state_dir>/csi/<type>/<id>
# (the client state_dir is <data_dir>/client by default): the plugin then
# stages and publishes at the same paths Nomad uses, and nothing new is
# created on the host.
variable "plugin_id" {
  type    = string
  default = "fixture"
}

variable "plugin_command" {
  description = "The CSI plugin binary on the clients."
  type        = string
  default     = "/usr/local/bin/csi-fixture"
}

variable "plugin_args" {
  type    = list(string)
  default = ["--state-dir", "/var/lib/csi-fixture"]
}

variable "stage_publish_base_dir" {
  description = "<client state_dir>/csi/monolith/<plugin_id> on the clients."
  type        = string
  default     = "/var/lib/nomad/client/csi/monolith/fixture"
}

job "csi-fixture-plugin" {
  type = "system"

  group "plugin" {
    task "plugin" {
      driver = "csi"

      config {
        command    = var.plugin_command
        args       = var.plugin_args
        # The plugin mounts volumes that must reach the host: the driver
        # refuses Nomad's bidirectional plugin mounts without it.
        privileged = true
      }

      csi_plugin {
        id                     = var.plugin_id
        type                   = "monolith"
        mount_dir              = "/csi"
        stage_publish_base_dir = var.stage_publish_base_dir
      }

      resources {
        cpu    = 100
        memory = 64
      }
    }
  }
}
