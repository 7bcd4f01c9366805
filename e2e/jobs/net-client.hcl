# A batch group in network mode {{.Vars.Mode}} that tries to connect to
# each of {{.Vars.Addrs}} and prints "ADDR=ok NAME" or "ADDR=fail REASON".
job "{{.JobID}}" {
  type = "batch"

  group "client" {
    network {
      mode = "{{.Vars.Mode}}"
    }

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
        command = "{{.Vars.Probe}}"
        args    = ["dial", {{.Vars.Addrs}}]
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
