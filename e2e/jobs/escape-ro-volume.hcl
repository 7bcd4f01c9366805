# Escape suite, attack 5: write into another task's read-only volume
# through the paths given after the script (its publish target under
# root_dir/mnt/publish, its staging path, the plugin's backing directory):
# overwrite "file" and create "escape-new" in each.
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
          put() { echo "overwritten by a non-privileged task" > "$1"; }
          for p in "$@"; do
            try "overwrite:$p" put "$p/file"
            try "create:$p" put "$p/escape-new"
          done
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
