# Volume grant escape case (e2e/escape_volgrant_test.go): a batch job of
# namespace {{.Vars.Namespace}}, placed on client node {{.Vars.Node}},
# whose task "t" runs {{.Vars.Script}} with /bin/sh -c, with one volume of
# the driver's volume block: volume_id {{.Vars.VolumeID}} of plugin
# {{.Vars.PluginID}} at /data, a volume the plugin already has (no create
# block). It runs as root (the fixture's volumes are root's), never
# restarts nor reschedules, so a refusal stays visible.
job "{{.JobID}}" {
  type      = "batch"
  namespace = "{{.Vars.Namespace}}"

  constraint {
    attribute = "${node.unique.name}"
    value     = "{{.Vars.Node}}"
  }

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
      user         = "root"
      kill_timeout = "3s"

      config {
        command = "/bin/sh"
        args    = ["-c", {{.Vars.Script}}]

        volume "data" {
          plugin_id   = "{{.Vars.PluginID}}"
          volume_id   = {{.Vars.VolumeID}}
          destination = "/data"
          access_mode = "multi-node-multi-writer"
        }
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }
  }
}
