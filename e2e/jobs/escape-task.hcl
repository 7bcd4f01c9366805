# Escape suite: one attack (or victim) job, rendered by escJob in
# e2e/escape_helpers.go. A {{.Vars.Type}} job whose task "t" runs the
# attack's shell script (Vars.Script, written in e2e/escape_test.go) with
# /bin/sh -c, $0 "escape" and Vars.Args as $1..., on the driver Vars.Driver,
# as Vars.User (unset when empty), with the CSI volumes the test rendered.
# With Vars.Image, the task runs from that image (TestEscapeImage).
# With Vars.Prestart, a prestart task "prestart" runs that script to its end
# first, as the same user on the same driver. It never restarts nor
# reschedules, so a failure stays visible.
job "{{.JobID}}" {
  type = "{{.Vars.Type}}"

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }
{{- if .Vars.Prestart}}

    task "prestart" {
      driver       = "{{.Vars.Driver}}"
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
        args    = ["-c", {{.Vars.Prestart}}]
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
{{- end}}

    task "t" {
      driver       = "{{.Vars.Driver}}"
      kill_signal  = "SIGTERM"
      kill_timeout = "3s"
{{- if .Vars.User}}
      user         = "{{.Vars.User}}"
{{- end}}

      config {
{{- if .Vars.Image}}
        image    = "{{.Vars.Image}}"
{{- end}}
        command  = "/bin/sh"
        args     = concat(["-c", {{.Vars.Script}}, "escape"], {{.Vars.Args}})
{{- if .Vars.PidMode}}
        pid_mode = "{{.Vars.PidMode}}"
{{- end}}
{{.Vars.Volumes}}
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
