# Two tasks: one with a reserved core, one on the shared cores. Each
# prints the CPUs it may run on and sleeps.
job "{{.JobID}}" {
  type = "service"

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    task "reserved" {
      driver = "{{.Vars.Driver}}"

      config {
        command = "/bin/sh"
        args    = ["-c", "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"]
      }

      resources {
        cores  = 1
        memory = 32
      }
    }

    task "shared" {
      driver = "{{.Vars.Driver}}"

      config {
        command = "/bin/sh"
        args    = ["-c", "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"]
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
