# A batch job that writes to the CSI volume of volume.hcl, claimed through
# Nomad (group volume block) and mounted by the csi driver at /data (made on the
# task's own root, not on the host).
job "native-writer" {
  type = "batch"

  group "writer" {
    volume "data" {
      type            = "csi"
      source          = "data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }

    task "writer" {
      driver = "csi"
      # The volume belongs to root; a task that is not privileged runs as nobody
      # unless it names its user.
      user = "root"

      volume_mount {
        volume      = "data"
        destination = "/data"
      }

      config {
        command = "/bin/sh"
        args    = ["-c", "date >> /data/written-at && echo wrote: && cat /data/written-at"]
      }

      resources {
        cpu    = 100
        memory = 32
      }
    }
  }
}
