# Every key of a csi task's volume block (docs/volumes.md says what each
# does). A reference to copy from: "my-plugin" and /usr/bin/postgres stand
# for your plugin and program.
job "volume-options" {
  group "db" {
    task "postgres" {
      driver = "csi"
      user   = "postgres"

      config {
        command = "/usr/bin/postgres"

        volume "data" {
          plugin_id       = "my-plugin"
          volume_id       = "pg-data"
          destination     = "/data"
          read_only       = false
          access_mode     = "single-node-writer"
          attachment_mode = "file-system"
          mount_group     = true

          mount_options {
            fs_type     = "ext4"
            mount_flags = ["noatime"]
          }

          context {
            tier = "fast"
          }

          secrets {
            token = "..."
          }

          create {
            capacity_min = "10GiB"
            capacity_max = "20GiB"
            parameters {
              type = "ssd"
            }
          }
        }
      }
    }
  }
}
