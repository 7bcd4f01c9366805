# A batch job that gets a CSI volume from the csi driver: the volume is
# created if the plugin has none by that name yet, staged, published and
# bound at /data inside the task, and torn down when the task ends.
job "volume-writer" {
  type = "batch"

  # Only nodes where the plugin is running and healthy.
  constraint {
    attribute = "${attr.driver.csi.plugin.fixture.healthy}"
    value     = "true"
  }

  group "writer" {
    task "writer" {
      driver = "csi"
      # The volume belongs to root; a task that is not privileged runs as nobody
      # unless it names its user.
      user = "root"

      config {
        command = "/bin/sh"
        args    = ["-c", "date > /data/written-at && echo wrote: && cat /data/written-at"]

        volume "data" {
          plugin_id       = "fixture"
          volume_id       = "example-data"
          destination     = "/data"
          access_mode     = "single-node-writer"
          attachment_mode = "file-system"

          create {
            capacity_min = "64MiB"
            parameters = {
              type = "ext4"
            }
          }
        }
      }

      resources {
        cpu    = 100
        memory = 32
      }
    }
  }
}
