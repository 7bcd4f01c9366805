# The e2e CSI fixture as a system job with Nomad's own task-level
# csi_plugin block, run by the csi driver on every client (the cluster
# benchmark's counterpart of cluster_plugin.hcl). Vars: PluginID, Command,
# StateBase (each instance's state and call log under <StateBase>/<node
# name>), MountDir. Each instance's topology is its node: a volume it creates
# is placed by Nomad's CSI scheduling on that node only.
job "{{.JobID}}" {
  type = "system"

  group "plugin" {
    task "plugin" {
      driver       = "csi"
      kill_timeout = "5s"

      config {
        command = "{{.Vars.Command}}"
        args = [
          "--state-dir", "{{.Vars.StateBase}}/${node.unique.name}/state",
          "--node-id", "${node.unique.name}",
          "--log-calls", "{{.Vars.StateBase}}/${node.unique.name}/calls.log",
          "--topology", "e2e.csi/node=${node.unique.name}",
        ]
        privileged = true
      }

      csi_plugin {
        id             = "{{.Vars.PluginID}}"
        type           = "monolith"
        mount_dir      = "{{.Vars.MountDir}}"
        health_timeout = "30s"
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
