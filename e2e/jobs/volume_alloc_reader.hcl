# One allocation whose two tasks name one single-node-writer volume in
# their own volume blocks, rendered by the test: "reader" (the main task,
# read_only, sleeping; the test runs its commands with nomad alloc exec)
# starts and publishes first; "writer", a poststart task, runs the test's
# script: one writes to the volume and exits, so the reader is left alone
# on the allocation's read/write publish, another stays beside the reader.
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

    task "reader" {
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

    task "writer" {
      lifecycle {
        hook    = "poststart"
        sidecar = false
      }

      driver       = "csi"
      user         = "root"
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args    = ["-c", {{.Vars.WriterScript}}]
{{.Vars.WriterVolumes}}
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
