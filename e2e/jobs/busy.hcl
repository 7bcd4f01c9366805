# A service task that keeps one core busy, for the CPU stats Nomad shows.
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
        args    = ["-c", "echo busy; while :; do :; done"]
      }

      resources {
        cpu    = 100
        memory = 64
      }
    }
  }
}
