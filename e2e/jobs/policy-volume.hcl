# A service task of namespace {{.Vars.Namespace}} with one volume of the
# driver's volume block: volume_id {{.Vars.VolumeID}} of plugin
# {{.Vars.PluginID}} at {{.Vars.Dest}}. It never restarts nor reschedules,
# so a refusal stays visible.
job "{{.JobID}}" {
  type      = "service"
  namespace = "{{.Vars.Namespace}}"

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
      driver       = "csi"
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args    = ["-c", "echo started; exec sleep 3600"]

        volume "data" {
          plugin_id   = "{{.Vars.PluginID}}"
          volume_id   = "{{.Vars.VolumeID}}"
          destination = "{{.Vars.Dest}}"
          access_mode = "multi-node-multi-writer"

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
}
