# A trivial service job for the benchmark: {{.Vars.Count}} tasks that
# sleep, on the {{.Vars.Driver}} driver.
job "{{.JobID}}" {
  type = "service"

  group "g" {
    count = {{.Vars.Count}}

    restart {
      attempts = 0
      mode     = "fail"
    }

    task "t" {
      driver       = "{{.Vars.Driver}}"
      kill_signal  = "SIGTERM"
      kill_timeout = "5s"

      config {
        command = "/bin/sleep"
        args    = ["3600"]
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
