# A privileged task on an agent whose csi plugin does not allow_privileged.
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
        args       = ["-c", "echo should-not-run"]
        privileged = true
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
