# The e2e CSI fixture as a plugin task run from its image ({{.Vars.Image}}):
# plugin id {{.Vars.PluginID}} ({{.Vars.PluginType}}), privileged. The
# fixture keeps its volumes and call log in the client's host volume
# {{.Vars.HostVolume}}, mounted at the same path ({{.Vars.StatePath}}) in the
# task, so that the host sees them where the test looks. An optional
# Entrypoint var (an HCL list) replaces the image's entrypoint.
job "{{.JobID}}" {
  type = "service"

  group "plugin" {
    restart {
      attempts = 10
      interval = "10m"
      delay    = "1s"
      mode     = "delay"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    volume "state" {
      type   = "host"
      source = "{{.Vars.HostVolume}}"
    }

    task "plugin" {
      driver       = "csi"
      kill_timeout = "5s"

      volume_mount {
        volume      = "state"
        destination = "{{.Vars.StatePath}}"
      }

      config {
        image      = "{{.Vars.Image}}"
        args       = {{.Vars.Args}}
        privileged = true
{{- with index .Vars "Entrypoint"}}
        entrypoint = {{.}}
{{- end}}

        csi_plugin {
          id        = "{{.Vars.PluginID}}"
          type      = "{{.Vars.PluginType}}"
          mount_dir = "/csi"
        }
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
