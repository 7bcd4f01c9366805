# One allocation of two tasks naming one volume in their own volume blocks,
# "writer" and "reader", rendered by the test.
# Both sleep; the test runs its commands in them with nomad alloc exec. The
# reader is a prestart sidecar, so it starts, and publishes, first.
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

    task "writer" {
      driver       = "csi"
      user         = "root"
      kill_signal  = "SIGTERM"
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args    = ["-c", "echo started; exec sleep 3600"]
{{.Vars.WriterVolumes}}
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }

    task "reader" {
      lifecycle {
        hook    = "prestart"
        sidecar = true
      }

      driver       = "csi"
      user         = "root"
      kill_signal  = "SIGTERM"
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args    = ["-c", "echo started; exec sleep 3600"]
{{.Vars.ReaderVolumes}}
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
