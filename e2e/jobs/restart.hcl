# A long-running service task for the agent restart case: it prints its PID
# once, then a tick a second, and exits 3 on SIGTERM so that its exit code
# after recovery is recognisable.
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
      kill_timeout = "10s"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          trap 'echo got-term; exit 3' TERM
          echo "started pid=$$"
          echo "$$" > "$NOMAD_TASK_DIR/pid"
          i=0
          while :; do i=$((i+1)); echo "tick $i"; sleep 1; done
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
