# A CSI plugin run by the csi driver and registered with Nomad's own CSI
# support: the task-level csi_plugin block is Nomad's, so the servers track
# the plugin (nomad plugin status), volumes are created and claimed through
# them (nomad volume create, volume blocks in job groups), and Nomad's client
# stages and publishes volumes by calling the plugin.
#
# Only the task's driver and config differ from a Docker-run plugin: the
# plugin binary is on the client instead of in an image.
#
# The csi driver builds each task's root itself (file system isolation
# "image"), so Nomad gives the plugin CSI_ENDPOINT as
# unix://<mount_dir>/csi.sock, where the driver binds the plugin's socket
# directory; the plugin must take its endpoint from it. stage_publish_base_dir can stay at its default
# (/local/csi, made on the task's own root, not on the host), or be the
# host directory Nomad keeps the plugin's mounts in,
# <client state_dir>/csi/<type>/<id>, so that the plugin sees the same
# paths as the host.
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

job "csi-fixture-plugin" {
  type = "system"

  group "plugin" {
    task "plugin" {
      driver = "csi"

      config {
        command = var.plugin_command
        args    = var.plugin_args
        # The plugin mounts volumes that must reach the host: the driver
        # refuses Nomad's bidirectional plugin mounts without it.
        privileged = true
      }

      csi_plugin {
        id        = var.plugin_id
        type      = "monolith"
        mount_dir = "/csi"
      }

      resources {
        cpu    = 100
        memory = 64
      }
    }
  }
}
