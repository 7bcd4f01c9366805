# A task that gets the Nomad-claimed CSI volume {{.Vars.VolumeID}} at
# {{.Vars.Dest}} (group volume block + volume_mount) on the
# {{.Vars.Driver}} driver, and runs Script (batch) or sleeps (service).
# Vars: Type (batch|service), VolumeID, Dest, Script, Count.
job "{{.JobID}}" {
  type = "{{.Vars.Type}}"

  group "g" {
    count = {{.Vars.Count}}

    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    volume "data" {
      type            = "csi"
      source          = "{{.Vars.VolumeID}}"
      access_mode     = "{{.Vars.AccessMode}}"
      attachment_mode = "file-system"
      per_alloc       = false
    }

    task "t" {
      driver = "{{.Vars.Driver}}"
{{- if eq .Vars.Driver "csi"}}
      # The volume belongs to root; a task of the csi driver that is not
      # privileged runs as nobody unless it names its user.
      user         = "root"
{{- end}}
      kill_timeout = "5s"

      volume_mount {
        volume      = "data"
        destination = "{{.Vars.Dest}}"
      }

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
{{.Vars.Script}}
EOT
        ]
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
