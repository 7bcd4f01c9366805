# A batch job that may only run where the CSI plugin {{.Vars.Key}} is
# healthy on the node.
job "{{.JobID}}" {
  type = "batch"

  constraint {
    attribute = "${attr.driver.csi.plugin.{{.Vars.Key}}.healthy}"
    value     = "true"
  }

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
        command = "/bin/sh"
        args    = ["-c", "echo placed-where-the-plugin-is-healthy"]
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }
  }
}
