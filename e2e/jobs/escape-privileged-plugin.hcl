# Escape suite, the control: a privileged CSI plugin task (monolith,
# plugin id {{.Vars.PluginID}}) that must keep the host's powers the attacks
# are denied. Its task "plugin" runs the control's shell script (Vars.Script,
# written in e2e/escape_test.go) with /bin/sh -c, $0 "escape" and Vars.Args
# as $1...; the script ends by running the fixture plugin, so that the task
# is a real plugin.
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

      config {
        command    = "/bin/sh"
        privileged = true
        args       = concat(["-c", {{.Vars.Script}}, "escape"], {{.Vars.Args}})

        csi_plugin {
          id        = "{{.Vars.PluginID}}"
          type      = "monolith"
          mount_dir = "/csi"
        }
      }

      resources {
        cpu    = 50
        memory = 128
      }
    }
  }
}
