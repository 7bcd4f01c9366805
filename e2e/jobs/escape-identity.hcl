# Escape suite: a batch job whose task "t" has its workload identity in a
# file (secrets/nomad_token) and one restart. It runs the attack's shell
# script (Vars.Script, written in e2e/escape_identity_test.go) with
# /bin/sh -c, $0 "escape" and Vars.Args as $1..., as Vars.User (unset when
# empty), on the csi driver.
job "{{.JobID}}" {
  type = "batch"

  group "g" {
    restart {
      attempts = 1
      delay    = "1s"
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    task "t" {
      driver       = "csi"
      kill_timeout = "3s"
{{- if .Vars.User}}
      user         = "{{.Vars.User}}"
{{- end}}

      identity {
        file = true
      }

      config {
        command = "/bin/sh"
        args    = concat(["-c", {{.Vars.Script}}, "escape"], {{.Vars.Args}})
      }

      resources {
        cpu    = 20
        memory = 64
      }
    }
  }
}
