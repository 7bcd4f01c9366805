# Task config with a key the driver's schema does not have.
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
        command         = "/bin/true"
        no_such_setting = "surprise"
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
