# One cycle of the soak (soak_test.go): a group of {{.Vars.ManagedCount}}
# tasks with driver-managed volumes (the csi driver's volume block) - one
# volume shared by all of them, staged once and published per task, and
# one of each task's own - and a group of {{.Vars.NativeCount}} tasks
# sharing a native volume (Nomad's group volume block and volume_mount),
# staged by Nomad through a plugin the csi driver runs. Every volume is a
# bind-mode (dir) volume of the fixture: no loop device.
# Vars: Type (batch: run Script and exit; service: run Script then sleep),
# Script, ManagedCount, NativeCount, ManagedPlugin, SharedVolume,
# OwnVolumePrefix, NativeVolume, Dest.
job "{{.JobID}}" {
  type = "{{.Vars.Type}}"

  group "managed" {
    count = {{.Vars.ManagedCount}}

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
      # The fixture's volumes belong to root.
      user         = "root"
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
{{.Vars.Script}}
EOT
        ]

        volume "shared" {
          plugin_id       = "{{.Vars.ManagedPlugin}}"
          volume_id       = "{{.Vars.SharedVolume}}"
          destination     = "{{.Vars.Dest}}/shared"
          access_mode     = "multi-node-multi-writer"
          attachment_mode = "file-system"

          create {
            parameters {
              type = "dir"
            }
          }
        }

        volume "own" {
          plugin_id       = "{{.Vars.ManagedPlugin}}"
          volume_id       = "{{.Vars.OwnVolumePrefix}}-${NOMAD_ALLOC_INDEX}"
          destination     = "{{.Vars.Dest}}/own"
          access_mode     = "single-node-writer"
          attachment_mode = "file-system"

          create {
            parameters {
              type = "dir"
            }
          }
        }
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }
  }

  group "native" {
    count = {{.Vars.NativeCount}}

    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    volume "shared" {
      type            = "csi"
      source          = "{{.Vars.NativeVolume}}"
      access_mode     = "multi-node-multi-writer"
      attachment_mode = "file-system"
    }

    task "t" {
      driver       = "csi"
      user         = "root"
      kill_timeout = "3s"

      volume_mount {
        volume      = "shared"
        destination = "{{.Vars.Dest}}/shared"
      }

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
{{.Vars.Script}}
EOT
        ]
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }
  }
}
