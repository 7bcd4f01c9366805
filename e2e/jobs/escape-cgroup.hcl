# Escape suite, attack 7: leave the task's cgroup. The task and a
# background child each write their pid into the root of every hierarchy
# under /sys/fs/cgroup (tasks, cgroup.procs) and into a new group
# escape-$2-<task|child> made there; the child then becomes
# "sleep 301.$1", which must not outlive the job.
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
          putpid() { echo "$1" > "$2"; }
          leave() {
            for h in /sys/fs/cgroup/*; do
              [ -d "$h" ] && [ ! -L "$h" ] || continue
              for f in tasks cgroup.procs; do
                [ -e "$h/$f" ] && try "$2:write:$h/$f" putpid "$1" "$h/$f"
              done
              if try "$2:mkdir:$h/escape-$3-$2" mkdir "$h/escape-$3-$2"; then
                try "$2:move:$h/escape-$3-$2" putpid "$1" "$h/escape-$3-$2/cgroup.procs"
              fi
            done
          }
          (
            read -r pid _ < /proc/self/stat
            leave "$pid" child "$2"
            echo "child cgroups: $(tr '\n' ' ' < /proc/self/cgroup)"
            echo DONE-child
            exec sleep "301.$1"
          ) &
          sleep 1
          leave "$$" task "$2"
          echo "task cgroups: $(tr '\n' ' ' < /proc/self/cgroup)"
          echo DONE-task
          wait
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
