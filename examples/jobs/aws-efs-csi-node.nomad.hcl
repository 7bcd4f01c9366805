# The AWS EFS CSI driver's node plugin, run from its image by the csi
# driver: the system job Nomad's CSI documentation runs with Docker, with
# only the task's driver changed. The driver pulls the image itself (no
# Docker, no Podman), makes it the task's root, and runs its entrypoint
# (/bin/aws-efs-csi-driver) with these args; efs-utils and stunnel, which the
# plugin runs to mount, are the image's, not the host's.
#
# The task-level csi_plugin block is Nomad's: Nomad tracks the plugin
# (nomad plugin status) and stages and publishes EFS volumes for any job's
# volume blocks through it. The controller is not needed for static EFS
# volumes (nomad volume register).
#
# Privileged: the plugin mounts for the host. The operator grants it on the
# plugin nodes, pinned to the image's digest (nomad-driver-csi refuses a
# privileged task that no grant matches, and says which grant to add), in
# the agent's plugin "nomad-driver-csi" config block:
#
#   allow_privileged = true
#   privileged_grant {
#     namespace = "default"
#     job       = "aws-efs-csi-node"
#     image     = "public.ecr.aws/efs-csi-driver/amazon/aws-efs-csi-driver@sha256:<digest>"
#     plugin_id = "aws-efs0"
#   }
variable "image" {
  description = "The plugin's image; a tag or, better, the digest the grant pins."
  type        = string
  default     = "public.ecr.aws/efs-csi-driver/amazon/aws-efs-csi-driver:v2.1.0"
}

job "aws-efs-csi-node" {
  type = "system"

  group "node" {
    task "plugin" {
      driver = "csi"

      config {
        image      = var.image
        args       = ["node", "--endpoint=${CSI_ENDPOINT}", "--logtostderr", "--v=2"]
        privileged = true
      }

      csi_plugin {
        id        = "aws-efs0"
        type      = "node"
        mount_dir = "/csi"
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
