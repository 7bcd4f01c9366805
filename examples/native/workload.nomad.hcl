# A batch job that writes to the CSI volume of volume.hcl, claimed through
# Nomad (group volume block) and mounted by the csi driver at /srv/data.
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

      volume_mount {
        volume      = "data"
        destination = "/srv/data"
      }

      config {
        command = "/bin/sh"
        args    = ["-c", "date >> /srv/data/written-at && echo wrote: && cat /srv/data/written-at"]
      }

      resources {
        cpu    = 100
        memory = 32
      }
    }
  }
}
