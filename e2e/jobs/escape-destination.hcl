# Escape suite, attack 8a: a volume destination below an existing host
# directory (/srv/escape-<unique>/data) must be made on the task's own root,
# never on the host.
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

    task "t" {
      driver       = "csi"
      kill_timeout = "3s"
{{- if .Vars.User}}
      user         = "{{.Vars.User}}"
{{- end}}

      config {
        command = "/bin/sh"
        args    = ["-c", "echo uid=$(id -u); ls -ld \"$1\"; echo DONE", "escape", "{{.Vars.Dest}}"]
{{.Vars.Volumes}}
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
