# Privilege is the operator's grant (e2e/escape_grant_test.go): one job,
# attack or operator's plugin, in namespace {{.Vars.Namespace}}. Its task
# "t" runs {{.Vars.Command}} with Vars.Args on the csi driver, privileged =
# {{.Vars.Privileged}}, as Vars.User (unset when empty), with a csi_plugin
# block when Vars.PluginID is set, the volume blocks of Vars.Volumes, the env
# lines of Vars.Env, and Vars.Data rendered into Vars.DataDest (local/data by
# default) with mode Vars.DataPerms (its lines the task's env with
# Vars.DataEnv). Nomad restarts it Vars.Attempts times, Vars.Delay
# apart; it never reschedules, so a failure stays visible.
job "{{.JobID}}" {
  namespace = "{{.Vars.Namespace}}"
  type      = "{{.Vars.Type}}"

  group "g" {
    restart {
      attempts = {{.Vars.Attempts}}
      interval = "10m"
      delay    = "{{.Vars.Delay}}"
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
{{- if .Vars.Env}}

      env {
{{.Vars.Env}}
      }
{{- end}}
{{- if .Vars.Data}}

      template {
        data            = {{.Vars.Data}}
        destination     = "{{.Vars.DataDest}}"
        perms           = "{{.Vars.DataPerms}}"
        env             = {{.Vars.DataEnv}}
        left_delimiter  = "[[["
        right_delimiter = "]]]"
      }
{{- end}}

      config {
        command    = {{.Vars.Command}}
        args       = {{.Vars.Args}}
        privileged = {{.Vars.Privileged}}
{{- if .Vars.PluginID}}

        csi_plugin {
          id        = "{{.Vars.PluginID}}"
          type      = "{{.Vars.PluginType}}"
          mount_dir = "/csi"
        }
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
