# The e2e CSI fixture from its image ({{.Vars.Image}}) as a CSI plugin of
# Nomad's own (a task-level csi_plugin block): plugin id {{.Vars.PluginID}},
# monolith, privileged. Its volumes and call log are in the client's host
# volume {{.Vars.HostVolume}}, mounted at the same path
# ({{.Vars.StatePath}}) in the task.
job "{{.JobID}}" {
  type = "service"

  group "plugin" {
    restart {
      attempts = 2
      delay    = "1s"
      mode     = "fail"
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
      kill_timeout = "10s"

      volume_mount {
        volume      = "state"
        destination = "{{.Vars.StatePath}}"
      }

      config {
        image      = "{{.Vars.Image}}"
        args       = {{.Vars.Args}}
        privileged = true
      }

      csi_plugin {
        id             = "{{.Vars.PluginID}}"
        type           = "monolith"
        mount_dir      = "/csi"
        health_timeout = "30s"
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
