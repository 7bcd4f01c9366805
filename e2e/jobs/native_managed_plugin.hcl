# The csi-fixture as a driver-managed CSI plugin: the csi driver's own
# csi_plugin block in the task config, unknown to Nomad's servers.
# Vars: Fixture, StateDir, PluginID, MountDir.
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

    task "plugin" {
      driver       = "csi"
      kill_timeout = "10s"

      config {
        command    = "{{.Vars.Fixture}}"
        args       = ["--state-dir", "{{.Vars.StateDir}}", "--node-id", "e2e-managed", "--log-calls", "{{.Vars.StateDir}}/calls.log"]
        privileged = true

        csi_plugin {
          id        = "{{.Vars.PluginID}}"
          type      = "monolith"
          mount_dir = "{{.Vars.MountDir}}"
        }
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
