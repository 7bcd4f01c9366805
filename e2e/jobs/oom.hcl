# A batch task limited to 32 MB that builds a 200 MB string in the shell:
# the kernel's OOM killer must end it and Nomad must say so.
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
        args = ["-c", <<-EOT
          echo allocating
          x=$(head -c 200000000 /dev/zero | tr '\0' a)
          echo "survived with $(printf %s "$x" | wc -c) bytes"
          sleep 5
        EOT
        ]
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
