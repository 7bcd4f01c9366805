# Escape suite, the control: a privileged CSI plugin task (monolith) keeps
# the host's powers the attacks must not have. It writes a file into the
# test's directory ($1), looks for the host sleeper (pid $2, "sleep 300.$3")
# in /proc, prints its capabilities, and then runs the fixture plugin ($4,
# state in $5) so that it is a real plugin.
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

    task "plugin" {
      driver       = "csi"
      kill_timeout = "5s"

      config {
        command    = "/bin/sh"
        privileged = true
        args = concat(["-c", <<-EOT
          try() {
            n=$1; shift
            if out=$("$@" 2>&1); then echo "RESULT $n OK $(printf '%s' "$out" | tr '\n' ' ')"
            else echo "RESULT $n FAILED rc=$? $(printf '%s' "$out" | tr '\n' ' ')"; return 1; fi
          }
          put() { echo "written by a privileged plugin task" > "$1"; }
          seen() {
            c=$(tr '\0' ' ' < "/proc/$1/cmdline") || return 1
            case "$c" in *"$2"*) echo "/proc/$1: $c" ;; *) echo "/proc/$1 is another process: $c"; return 1 ;; esac
          }
          echo "SELF CapEff=$(awk '/^CapEff/ {print $2}' /proc/self/status) uid=$(id -u)"
          try write-host "put" "$1/written-by-plugin"
          try see-sleeper seen "$2" "sleep 300.$3"
          echo DONE
          exec "$4" --state-dir "$5" --node-id e2e-escape-node
        EOT
        , "escape"], {{.Vars.Args}})

        csi_plugin {
          id        = "{{.Vars.PluginID}}"
          type      = "monolith"
          mount_dir = "/csi"
        }
      }

      resources {
        cpu    = 50
        memory = 128
      }
    }
  }
}
