# A batch task whose logs are disabled: Nomad runs no logmon for it and
# hands the driver /dev/null as its stdout and stderr. It runs, writes,
# and exits with {{.Vars.ExitCode}}.
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

      logs {
        disabled = true
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
