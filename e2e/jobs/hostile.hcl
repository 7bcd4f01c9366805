# Hostile-tenant suite (e2e/escape_hostile_test.go): a {{.Vars.Type}} job of
# namespace {{.Vars.Namespace}} whose task "t" runs {{.Vars.Command}} with
# {{.Vars.Args}} on the csi driver, as {{.Vars.User}} when set, in
# {{.Vars.WorkDir}} when set. The command, work_dir and user may hold a
# terminal's escape sequences (the strings are rendered as JSON, which HCL
# reads). It never restarts nor reschedules, so a failure stays visible.
job "{{.JobID}}" {
  type      = "{{.Vars.Type}}"
  namespace = "{{.Vars.Namespace}}"

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    # Small: the full-disk case's node has a file system of a few MiB.
    ephemeral_disk {
      size = 10
    }

    task "t" {
      driver       = "csi"
      kill_signal  = "SIGTERM"
      kill_timeout = "3s"
{{- if .Vars.User}}
      user         = {{.Vars.User}}
{{- end}}

      config {
        command  = {{.Vars.Command}}
        args     = {{.Vars.Args}}
{{- if .Vars.WorkDir}}
        work_dir = {{.Vars.WorkDir}}
{{- end}}
      }

      logs {
        max_files     = 1
        max_file_size = 2
      }

      resources {
        cpu    = 20
        memory = {{.Vars.Memory}}
      }
    }
  }
}
