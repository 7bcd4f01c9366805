# Escape suite, attack 1: a non-privileged batch task writes files where
# only the host's root may, each path given after the script (/etc, /var/tmp,
# /root). One "RESULT write:<path> OK|FAILED <why>" line per path; the test
# checks the host for the files.
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
      driver       = "{{.Vars.Driver}}"
      kill_signal  = "SIGTERM"
      kill_timeout = "3s"
{{- if .Vars.User}}
      user         = "{{.Vars.User}}"
{{- end}}

      config {
        command = "/bin/sh"
        args = concat(["-c", <<-EOT
          try() {
            n=$1; shift
            if out=$("$@" 2>&1); then echo "RESULT $n OK $(printf '%s' "$out" | tr '\n' ' ')"
            else echo "RESULT $n FAILED rc=$? $(printf '%s' "$out" | tr '\n' ' ')"; return 1; fi
          }
          echo "uid=$(id -u) $(grep CapEff /proc/self/status)"
          put() { echo "written by a non-privileged task" > "$1"; }
          for p in "$@"; do try "write:$p" put "$p"; done
          echo DONE
        EOT
        , "escape"], {{.Vars.Args}})
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
