# A service group in bridge mode: netprobe answers on 0.0.0.0:8080, which
# Nomad maps to the host port "http", and on 127.0.0.1:8081, the group's
# own loopback only.
job "{{.JobID}}" {
  group "server" {
    network {
      mode = "bridge"
      port "http" {
        to = 8080
      }
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
        args    = ["serve", "server", "0.0.0.0:8080", "127.0.0.1:8081"]
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
