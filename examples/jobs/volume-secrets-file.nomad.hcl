# A volume whose secrets come from Nomad Variables instead of the job: the
# template renders them into the task's secrets/ directory before the task
# starts, and secrets_file reads them from there. "my-plugin" stands for your
# plugin.
job "volume-secrets-file" {
  group "app" {
    task "app" {
      driver = "csi"

      template {
        destination = "secrets/vol.env"
        data        = "{{ with nomadVar \"nomad/jobs/app\" }}token={{ .token }}{{ end }}"
      }

      config {
        command = "/bin/sh"
        args    = ["-c", "ls /data"]

        volume "data" {
          plugin_id    = "my-plugin"
          volume_id    = "app-data"
          destination  = "/data"
          secrets_file = "secrets/vol.env"
        }
      }
    }
  }
}
