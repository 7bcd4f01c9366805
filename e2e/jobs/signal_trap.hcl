# A service task that traps its kill_signal (SIGUSR1), leaves a marker in
# its log and its task dir, and exits 0 — well before kill_timeout.
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
      kill_timeout = "20s"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          trap 'echo caught-usr1 > "$NOMAD_TASK_DIR/marker"; echo caught-usr1; exit 0' USR1
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
