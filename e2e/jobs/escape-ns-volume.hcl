# Namespace escape cases (e2e/escape_namespace_test.go,
# e2e/escape_volgrant_test.go): a batch job of namespace {{.Vars.Namespace}}
# whose task "t" runs {{.Vars.Script}} with /bin/sh -c, with one volume of
# the driver's volume block: volume_id {{.Vars.VolumeID}} of plugin
# {{.Vars.PluginID}} at /data, created when Vars.Create is set. Vars.Node,
# when set, places it on that client node; Vars.User, when set, is the
# task's user. It never restarts nor reschedules, so a refusal stays
# visible.
job "{{.JobID}}" {
  type      = "batch"
  namespace = "{{.Vars.Namespace}}"
{{- if .Vars.Node}}

  constraint {
    attribute = "${node.unique.name}"
    value     = "{{.Vars.Node}}"
  }
{{- end}}

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
{{- if .Vars.User}}
      user         = "{{.Vars.User}}"
{{- end}}
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args    = ["-c", {{.Vars.Script}}]

        volume "data" {
          plugin_id   = "{{.Vars.PluginID}}"
          volume_id   = {{.Vars.VolumeID}}
          destination = "/data"
          access_mode = "multi-node-multi-writer"
{{- if .Vars.Create}}

          create {
            parameters {
              type = "dir"
            }
          }
{{- end}}
        }
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }
  }
}
