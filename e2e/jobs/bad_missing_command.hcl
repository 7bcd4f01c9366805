# Task config without the required command.
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
        args = ["-c", "true"]
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
