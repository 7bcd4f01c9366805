# Escape suite, attack 4: read the driver's state and another
# allocation's secrets: list root_dir ($1), read its journal ($2), list the
# other task's secrets dir ($3) and read the file in it ($4).
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
          readfile() { c=$(cat "$1") && printf '%s' "$c" | tr -cd '[:print:]'; }
          try list-root-dir ls -la "$1"
          try read-journal readfile "$2"
          try list-secrets-dir ls -la "$3"
          try read-secret readfile "$4"
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
