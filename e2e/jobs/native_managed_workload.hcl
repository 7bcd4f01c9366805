# A task that gets a driver-managed CSI volume (the csi driver's volume
# block, created by name if missing) at {{.Vars.Dest}} and runs Script
# (batch) or sleeps (service).
# Vars: Type, PluginID, VolumeID, Dest, Script, Count.
job "{{.JobID}}" {
  type = "{{.Vars.Type}}"

  constraint {
    attribute = "${attr.driver.csi.plugin.{{.Vars.PluginID}}.healthy}"
    value     = "true"
  }

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

    task "t" {
      driver = "csi"
      # The volume belongs to root; a task that is not privileged runs as nobody
      # unless it names its user.
      user         = "root"
      kill_timeout = "5s"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
{{.Vars.Script}}
EOT
        ]

        volume "data" {
          plugin_id       = "{{.Vars.PluginID}}"
          volume_id       = "{{.Vars.VolumeID}}"
          destination     = "{{.Vars.Dest}}"
          access_mode     = "{{.Vars.AccessMode}}"
          attachment_mode = "file-system"

          create {
            capacity_min = "64MiB"
            parameters = {
              type = "{{.Vars.VolumeType}}"
            }
          }
        }
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
