# The fixture as a CSI plugin of Nomad's own (a task-level csi_plugin
# block), run by the csi driver: Nomad hands the task its socket and
# staging directories as bidirectional mounts and sets CSI_ENDPOINT (to the
# host path of the socket, as the driver has no filesystem isolation).
job "{{.JobID}}" {
  type = "service"

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    task "plugin" {
      driver       = "csi"
      kill_timeout = "5s"

      csi_plugin {
        id        = "{{.Vars.PluginID}}"
        type      = "monolith"
        mount_dir = "/csi"
      }

      config {
        command    = "{{.Vars.Command}}"
        args       = {{.Vars.Args}}
        privileged = true
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
