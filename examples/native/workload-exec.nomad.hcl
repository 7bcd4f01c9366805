# workload.nomad.hcl with Nomad's exec driver: the same plugin, run by the
# csi driver, serves workloads of any driver that supports CSI volumes.
job "native-writer-exec" {
  type = "batch"

  group "writer" {
    volume "data" {
      type            = "csi"
      source          = "data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }

    task "writer" {
      driver = "exec"

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
