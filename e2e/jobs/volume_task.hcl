# A workload of the volume cases: {{.Vars.Count}} allocation(s) of a
# {{.Vars.Type}} job running a shell script with the CSI volumes the test
# rendered into the config block. It never restarts nor reschedules, so a
# failure stays visible.
job "{{.JobID}}" {
  type = "{{.Vars.Type}}"

  group "g" {
    count = {{.Vars.Count}}
{{.Vars.Constraint}}

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
      # The fixture's volumes belong to root: a task that is not privileged
      # runs as nobody unless it says otherwise (root unless the test says).
      user         = "{{.Vars.User}}"
      kill_signal  = "SIGTERM"
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args    = ["-c", {{.Vars.Script}}]
{{.Vars.Volumes}}
      }

{{.Vars.Template}}
      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
