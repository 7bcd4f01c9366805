# Escape suite, attack 3: a host process (pid $1, running "sleep 300.$2")
# and the Nomad agent (pid $3): can the task see them in /proc, or signal
# the sleeper? The pattern is built at run time so that the task's own argv
# does not match it.
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
          pat="sleep 300.$2"
          seen() {
            c=$(tr '\0' ' ' < "/proc/$1/cmdline") || return 1
            case "$c" in *"$2"*) echo "/proc/$1: $c" ;; *) echo "/proc/$1 is another process: $c"; return 1 ;; esac
          }
          scan() {
            for f in /proc/[0-9]*/cmdline; do
              c=$(tr '\0' ' ' 2>/dev/null < "$f")
              case "$c" in *"$1"*) echo "$f: $c"; return 0 ;; esac
            done
            echo "none of $(ls -d /proc/[0-9]* | wc -l) processes in /proc runs $1"; return 1
          }
          try see-sleeper seen "$1" "$pat"
          try scan-sleeper scan "$pat"
          try see-agent seen "$3" nomad
          try kill-0 kill -0 "$1"
          try kill-term kill -TERM "$1"
          echo "processes in /proc: $(ls -d /proc/[0-9]* | wc -l)"
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
