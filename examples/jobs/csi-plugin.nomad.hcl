# A CSI plugin run by the csi driver on every client: no Docker.
#
# Any CSI node or monolith plugin binary works; the driver gives it its
# socket directory at mount_dir (CSI_ENDPOINT points there) and the stage
# root with bidirectional mount propagation. The node then advertises the
# plugin under driver.csi.plugin.<id>.* (nomad node status -verbose).
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

job "csi-plugin" {
  type = "system"

  # One plugin task per node.
  constraint {
    distinct_hosts = true
  }

  group "plugin" {
    task "plugin" {
      driver = "csi"

      config {
        command    = var.plugin_command
        args       = var.plugin_args
        privileged = true

        csi_plugin {
          id        = var.plugin_id
          type      = "monolith"
          mount_dir = "/csi"
        }
      }

      resources {
        cpu    = 100
        memory = 64
      }
    }
  }
}
