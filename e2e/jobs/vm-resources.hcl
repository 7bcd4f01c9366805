# The resources a production-shaped host enforces (TestVMCgroupV2): a task
# with memory_max above its memory (oversubscription) that holds twice its
# memory, a task with reserved cores, and a busy task whose usage
# "nomad alloc status" reports. Each prints "ready" once set up.
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

    task "over" {
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

      # The shell's buffer for the 64 MB grows by doubling: its peak is
      # well above 64 MB, and below memory_max.
      resources {
        cpu        = 500
        memory     = 32
        memory_max = 256
      }
    }

    task "cores" {
      driver = "{{.Vars.Driver}}"

      config {
        command = "/bin/sh"
        args    = ["-c", "echo ready; exec sleep 3600"]
      }

      resources {
        cores  = 1
        memory = 32
      }
    }

    task "busy" {
      driver = "{{.Vars.Driver}}"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          x=$(head -c 40000000 /dev/zero | tr '\0' b)
          echo ready
          while :; do
            i=0
            while [ $i -lt 2000 ]; do i=$((i + 1)); done
            sleep 0.5
          done
        EOT
        ]
      }

      resources {
        cpu    = 100
        memory = 256
      }
    }
  }
}
