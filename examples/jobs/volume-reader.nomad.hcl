# Reads back what volume-writer wrote, with the volume read-only.
job "volume-reader" {
  type = "batch"

  constraint {
    attribute = "${attr.driver.csi.plugin.fixture.healthy}"
    value     = "true"
  }

  group "reader" {
    task "reader" {
      driver = "csi"

      config {
        command = "/bin/sh"
        args    = ["-c", "echo read: && cat /data/written-at && if touch /data/x 2>/dev/null; then echo writable; exit 1; else echo read-only as asked; fi"]

        volume "data" {
          plugin_id   = "fixture"
          volume_id   = "example-data"
          destination = "/data"
          read_only   = true
          access_mode = "single-node-reader-only"
        }
      }

      resources {
        cpu    = 100
        memory = 32
      }
    }
  }
}
