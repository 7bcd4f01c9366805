# A service task that ignores its kill_signal (and SIGTERM/SIGINT): Nomad
# must kill it once kill_timeout (3s) has passed.
job "{{.JobID}}" {
  type = "service"

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    task "t" {
      driver       = "{{.Vars.Driver}}"
      kill_signal  = "SIGUSR1"
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          trap '' USR1 TERM INT
          echo ready
          while :; do sleep 0.2; done
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
