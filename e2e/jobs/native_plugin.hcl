# The csi-fixture as a CSI plugin registered with Nomad's own CSI support
# (task-level csi_plugin), run by the {{.Vars.Driver}} driver.
# Vars: Fixture, StateDir, PluginID, MountDir, StageDir (empty: Nomad's
# default /local/csi; or the plugin's <state_dir>/csi/monolith/<id> on the
# client), Privileged, Attempts.
job "{{.JobID}}" {
  type = "service"

  group "plugin" {
    restart {
      attempts = {{.Vars.Attempts}}
      delay    = "1s"
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    task "plugin" {
      driver       = "{{.Vars.Driver}}"
      kill_timeout = "10s"

      config {
        command    = "{{.Vars.Fixture}}"
        args       = ["--state-dir", "{{.Vars.StateDir}}", "--node-id", "e2e-native", "--log-calls", "{{.Vars.StateDir}}/calls.log"]
        privileged = {{.Vars.Privileged}}
      }

      csi_plugin {
        id                     = "{{.Vars.PluginID}}"
        type                   = "monolith"
        mount_dir              = "{{.Vars.MountDir}}"
{{- if .Vars.StageDir}}
        stage_publish_base_dir = "{{.Vars.StageDir}}"
{{- end}}
        health_timeout         = "30s"
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
