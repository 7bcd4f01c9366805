# A batch task that asks for privileged = true without being a CSI plugin
# task (no csi_plugin block, neither the driver's nor Nomad's). On an agent
# with allow_privileged = true and privileged_plugins_only left at its
# default (true), the driver refuses it; it never restarts, so the refusal
# stays in its events.
job "{{.JobID}}" {
  type = "batch"

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
      driver = "csi"

      config {
        command    = "/bin/sh"
        args       = ["-c", "echo ran-privileged"]
        privileged = true
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }
  }
}
