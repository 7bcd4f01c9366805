# Bidirectional propagation from a plugin task, without CSI: the prestart
# sidecar "mounter" is a privileged node-plugin task (so the driver binds
# the stage root {{.Vars.StageRoot}} into it, shared with the host); once
# the test creates {{.Vars.Trigger}}, it mounts a tmpfs at {{.Vars.Probe}}
# from inside its own mount namespace and writes a file there. The main
# task "watcher", privileged (with the host's view) and started after the mounter but before the
# mount, waits for the file and prints it and its mountinfo line. The
# sidecar "private" is the control (see there).
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

    task "mounter" {
      driver       = "csi"
      kill_timeout = "3s"

      lifecycle {
        hook    = "prestart"
        sidecar = true
      }

      config {
        command    = "/bin/sh"
        privileged = true
        args = ["-c", <<-EOT
          set -e
          echo "mounter waiting mntns=$(readlink /proc/self/ns/mnt)"
          while [ ! -e "{{.Vars.Trigger}}" ]; do sleep 0.1; done
          mkdir -p "{{.Vars.Probe}}"
          mount -t tmpfs -o size=1m "{{.Vars.Source}}" "{{.Vars.Probe}}"
          echo "{{.Vars.Token}}" > "{{.Vars.Probe}}/hello"
          echo mounted
          exec sleep 3600
        EOT
        ]

        csi_plugin {
          id   = "{{.Vars.PluginID}}"
          type = "node"
        }
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }

    # The control: privileged too, but a controller plugin (the driver
    # allows privilege only to plugin tasks by default), so it has no
    # bidirectional mount; its tmpfs at {{.Vars.Probe}}-private must stay in
    # its own mount namespace.
    task "private" {
      driver       = "csi"
      kill_timeout = "3s"

      lifecycle {
        hook    = "prestart"
        sidecar = true
      }

      config {
        command    = "/bin/sh"
        privileged = true
        args = ["-c", <<-EOT
          set -e
          echo "private waiting mntns=$(readlink /proc/self/ns/mnt)"
          while [ ! -e "{{.Vars.Trigger}}" ]; do sleep 0.1; done
          mkdir -p "{{.Vars.Probe}}-private"
          mount -t tmpfs -o size=1m "{{.Vars.Source}}-private" "{{.Vars.Probe}}-private"
          echo "{{.Vars.Token}}" > "{{.Vars.Probe}}-private/hello"
          echo "mounted: $(grep " {{.Vars.Probe}}-private " /proc/self/mountinfo)"
          exec sleep 3600
        EOT
        ]

        csi_plugin {
          id   = "{{.Vars.PluginID}}-private"
          type = "controller"
        }
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }

    task "watcher" {
      driver       = "csi"
      kill_timeout = "3s"

      # It looks at a host path, so it needs the host's view: privileged,
      # which the driver allows to plugin tasks only (a task that is not
      # privileged sees none of the host's paths).
      config {
        command    = "/bin/sh"
        privileged = true
        args = ["-c", <<-EOT
          echo "watching mntns=$(readlink /proc/self/ns/mnt)"
          while [ ! -e "{{.Vars.Probe}}/hello" ]; do sleep 0.1; done
          echo "seen: $(cat "{{.Vars.Probe}}/hello")"
          echo "mountinfo: $(grep " {{.Vars.Probe}} " /proc/self/mountinfo)"
          exec sleep 3600
        EOT
        ]

        csi_plugin {
          id   = "{{.Vars.PluginID}}-watcher"
          type = "controller"
        }
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }
  }
}
