# Escape suite, attack 2: make a node for a host block device (major $1,
# minor $2) in /tmp and read from it, then read the host's own node ($3).
# The node is /tmp/escape-blk-$4, removed by the task (and by the test when
# the task could not). A read prints the device's first printable bytes.
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
          readdev() {
            c=$(dd if="$1" bs=512 count=1 2>/dev/null | tr -cd '[:print:]')
            [ -n "$c" ] || { dd if="$1" of=/dev/null bs=512 count=1 2>&1 | head -1; return 1; }
            echo "first bytes: $c"
          }
          node=/tmp/escape-blk-$4
          try mknod mknod "$node" b "$1" "$2"
          try read-node readdev "$node"
          try read-host-node readdev "$3"
          rm -f "$node"
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
