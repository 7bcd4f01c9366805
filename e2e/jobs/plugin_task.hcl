# A CSI plugin served by a task of the csi driver (csi_plugin block):
# {{.Vars.Command}} with {{.Vars.Args}}, plugin id {{.Vars.PluginID}} of
# type {{.Vars.Type}}, privileged = {{.Vars.Privileged}}. Nomad restarts it
# one second after it dies, so that the plugin's return can be timed.
job "{{.JobID}}" {
  type = "service"

  group "g" {
    restart {
      attempts = 3
      interval = "1m"
      delay    = "1s"
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    task "plugin" {
      driver       = "csi"
      kill_timeout = "5s"

      config {
        command    = "{{.Vars.Command}}"
        args       = {{.Vars.Args}}
        privileged = {{.Vars.Privileged}}

        csi_plugin {
          id        = "{{.Vars.PluginID}}"
          type      = "{{.Vars.Type}}"
          mount_dir = "/csi"
        }
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
