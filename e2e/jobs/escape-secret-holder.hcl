# Escape suite, the victim of attack 4: a service task that keeps a secret
# ({{.Vars.Token}}) in its own secrets directory and uses a CSI volume whose
# secrets block puts a second one into the driver's journal.
job "{{.JobID}}" {
  type = "service"

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    task "t" {
      driver       = "csi"
      kill_signal  = "SIGTERM"
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          echo "{{.Vars.Token}}" > "$NOMAD_SECRETS_DIR/escape-secret"
          echo "secret written to $NOMAD_SECRETS_DIR/escape-secret"
          exec sleep 3600
        EOT
        ]
{{.Vars.Volumes}}
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
