# A batch task from an image in a registry, with the task's own
# credentials ({{.Vars.Username}} empty: none), pulled within {{.Vars.Timeout}}.
# {{.Vars.Count}} copies, one run each (RestartAttempts restarts when set),
# no rescheduling; force_pull when the variable ForcePull is set.
job "{{.JobID}}" {
  type = "batch"

  group "g" {
    count = {{.Vars.Count}}

    restart {
      attempts = {{or (index .Vars "RestartAttempts") "0"}}
      delay    = "1s"
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    task "t" {
      driver = "csi"

      config {
        image              = "{{.Vars.Image}}"
        image_pull_timeout = "{{.Vars.Timeout}}"
        command            = "/usr/local/bin/csi-fixture"
        args               = ["--help"]
{{- if index .Vars "ForcePull"}}
        force_pull         = true
{{- end}}
{{- if .Vars.Username}}

        auth {
          username = "{{.Vars.Username}}"
          password = "{{.Vars.Password}}"
        }
{{- end}}
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
