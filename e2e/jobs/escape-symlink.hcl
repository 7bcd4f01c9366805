# Escape suite, attack 8b: a prestart task points
# ${NOMAD_ALLOC_DIR}/data/link at /etc; the main task's volume destination
# goes through that link, written from the task's environment so that it
# holds whether the alloc dir is the host path or /alloc. The target must be
# made inside the task's root, never as /etc/escape-<unique> on the host.
job "{{.JobID}}" {
  type = "batch"

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    task "link" {
      driver       = "csi"
      kill_timeout = "3s"
{{- if .Vars.User}}
      user         = "{{.Vars.User}}"
{{- end}}

      lifecycle {
        hook    = "prestart"
        sidecar = false
      }

      config {
        command = "/bin/sh"
        args    = ["-c", "mkdir -p \"$NOMAD_ALLOC_DIR/data\" && ln -sfn /etc \"$NOMAD_ALLOC_DIR/data/link\" && ls -l \"$NOMAD_ALLOC_DIR/data\""]
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }

    task "t" {
      driver       = "csi"
      kill_timeout = "3s"
{{- if .Vars.User}}
      user         = "{{.Vars.User}}"
{{- end}}

      config {
        command = "/bin/sh"
        args    = ["-c", "echo uid=$(id -u); ls -ld \"$NOMAD_ALLOC_DIR/data/link\" \"$NOMAD_ALLOC_DIR/data/link/\"*escape* ; echo DONE"]
{{.Vars.Volumes}}
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
