# The e2e CSI fixture as a system job of the csi driver, for the cluster
# cases: plugin id {{.Vars.PluginID}} (monolith) on every client, each
# instance with its node's name as its CSI node id and its state and call
# log under {{.Vars.StateBase}}/<node name>. Version only changes the
# task's environment: a new version of the job for an update.
job "{{.JobID}}" {
  type = "system"

  group "plugin" {
    restart {
      attempts = 10
      interval = "10m"
      delay    = "1s"
      mode     = "delay"
    }

    task "plugin" {
      driver       = "csi"
      kill_timeout = "5s"

      config {
        command = "{{.Vars.Command}}"
        args = [
          "--state-dir", "{{.Vars.StateBase}}/${node.unique.name}/state",
          "--node-id", "${node.unique.name}",
          "--log-calls", "{{.Vars.StateBase}}/${node.unique.name}/calls.log",
        ]
        privileged = true

        csi_plugin {
          id        = "{{.Vars.PluginID}}"
          type      = "monolith"
          mount_dir = "/csi"
          stop_wait = "{{.Vars.StopWait}}"
        }
      }

      env {
        FIXTURE_VERSION = "{{.Vars.Version}}"
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
