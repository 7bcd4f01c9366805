# democratic-csi (a Node.js program) as a node plugin, run from its image
# by the csi driver: a system job, as democratic-csi's own Nomad example has
# it with Docker. The image brings node, the plugin and nfs-common; the
# host needs nothing but the kernel's nfs support.
#
# Its node-manual driver mounts volumes that already exist on a server:
# register each with Nomad (nomad volume register) with plugin_id
# "org.democratic-csi.node-manual" and a context that names it, e.g.
#
#   context {
#     node_attach_driver = "nfs"
#     provisioner_driver = "node-manual"
#     server             = "nfs.example.internal"
#     share              = "/srv/nfs/nomad/db"
#   }
#
# and claim it with a volume block in any job. (democratic-csi's drivers
# that create volumes, such as nfs-client or the ZFS ones, run from the
# same image with their own driver-config-file and a controller job.)
#
# Privileged: the plugin mounts for the host. Grant it in the agent's
# plugin "nomad-driver-csi" config block, pinned to the image's digest:
#
#   allow_privileged = true
#   privileged_grant {
#     namespace = "default"
#     job       = "democratic-csi-node"
#     image     = "docker.io/democraticcsi/democratic-csi@sha256:<digest>"
#     plugin_id = "org.democratic-csi.node-manual"
#   }
variable "image" {
  type    = string
  default = "docker.io/democraticcsi/democratic-csi:v1.9.3"
}

job "democratic-csi-node" {
  type = "system"

  group "node" {
    task "plugin" {
      driver = "csi"

      config {
        image = var.image
        # The image's entrypoint is democratic-csi itself: these are its
        # arguments. The socket is the one csi_plugin's mount_dir holds.
        args = [
          "--csi-version=1.5.0",
          "--csi-name=org.democratic-csi.node-manual",
          "--driver-config-file=${NOMAD_TASK_DIR}/driver-config-file.yaml",
          "--log-level=info",
          "--csi-mode=node",
          "--server-socket=/csi/csi.sock",
        ]
        privileged = true
      }

      template {
        destination = "${NOMAD_TASK_DIR}/driver-config-file.yaml"
        data        = <<-EOT
          driver: node-manual
        EOT
      }

      csi_plugin {
        id        = "org.democratic-csi.node-manual"
        type      = "node"
        mount_dir = "/csi"
      }

      resources {
        cpu    = 100
        memory = 256
      }
    }
  }
}
