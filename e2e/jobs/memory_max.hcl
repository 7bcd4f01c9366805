# A task with memory_max above its memory (oversubscription) that holds
# twice its memory, then sleeps.
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

    task "t" {
      driver = "{{.Vars.Driver}}"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          x=$(head -c 64000000 /dev/zero | tr '\0' a)
          echo "ready holding $(printf %s "$x" | wc -c) bytes"
          # Not exec: the shell keeps holding x.
          sleep 3600
        EOT
        ]
      }

      resources {
        cpu        = 100
        memory     = 32
        memory_max = 256
      }
    }
  }
}
