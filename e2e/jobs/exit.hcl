# A batch task that writes to stdout and stderr and exits with
# {{.Vars.ExitCode}}. No restarts, no rescheduling: one run, one verdict.
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
      driver = "{{.Vars.Driver}}"

      config {
        command = "/bin/sh"
        args    = ["-c", "echo hello-from-task; echo hello-on-stderr >&2; exit {{.Vars.ExitCode}}"]
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
