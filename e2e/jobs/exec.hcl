# A service task that reports its own mount namespace, for comparison with
# what "nomad alloc exec" sees.
job "{{.JobID}}" {
  type = "service"

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    task "t" {
      driver       = "{{.Vars.Driver}}"
      kill_signal  = "SIGTERM"
      kill_timeout = "5s"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          echo "mntns=$(readlink /proc/$$/ns/mnt)"
          exec sleep 3600
        EOT
        ]
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
