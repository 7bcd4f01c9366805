# A batch task limited to 32 MB whose child builds a 200 MB string: the
# kernel's OOM killer ends the child, and the task itself, which holds
# little, goes on and exits 0. Nomad's exec reports the kill
# (oom_killed) and the task's success alike.
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
          # The child and its pipeline are the OOM killer's choice, the
          # task never: a second OOM, while the first victim's memory is
          # still being freed, takes the highest score left.
          /bin/sh -c 'echo 1000 > /proc/self/oom_score_adj || exit 9; x=$(head -c 200000000 /dev/zero | tr "\0" a); echo "child survived"'
          echo "child exited $?"
          exit 0
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
