# A task run from an image ({{.Vars.Image}}): {{.Vars.Count}} allocations of
# a {{.Vars.Type}} job whose task "t" runs /bin/sh -c {{.Vars.Script}} as
# {{.Vars.User}} (unset when empty). It never restarts nor reschedules.
job "{{.JobID}}" {
  type = "{{.Vars.Type}}"

  group "g" {
    count = {{.Vars.Count}}

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
        image           = "{{.Vars.Image}}"
        command         = "/bin/sh"
        args            = ["-c", {{.Vars.Script}}]
        readonly_rootfs = {{if .Vars.ReadOnly}}true{{else}}false{{end}}
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
