# The e2e CSI fixture as a monolith plugin task of the csi driver, for the
# volume cases: plugin id {{.Vars.PluginID}} ({{.Vars.PluginType}}), its
# state and call log under the test's directory. Nomad restarts it
# {{.Vars.RestartDelay}} after it dies.
job "{{.JobID}}" {
  type = "service"

  group "plugin" {
    restart {
      attempts = 10
      interval = "10m"
      delay    = "{{.Vars.RestartDelay}}"
      mode     = "delay"
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
        privileged = true

        csi_plugin {
          id        = "{{.Vars.PluginID}}"
          type      = "{{.Vars.PluginType}}"
          mount_dir = "/csi"
        }
      }

      resources {
        cpu    = {{with index .Vars "CPU"}}{{.}}{{else}}100{{end}}
        memory = {{.Vars.Memory}}
      }
    }
  }
}
