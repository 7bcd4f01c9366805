# The smallest client agent with the csi driver. Run as root:
# nomad agent -config=agent-minimal.hcl (examples/agent.hcl has every key).
data_dir   = "/var/lib/nomad"
plugin_dir = "/var/lib/nomad/plugins"

client {
  enabled = true
}

plugin "nomad-driver-csi" {
  config {
    # CSI node and monolith plugins run privileged, each plugin job by the
    # operator's grant (examples/jobs/csi-plugin.nomad.hcl's here).
    allow_privileged = true
    privileged_grant {
      namespace = "default"
      job       = "csi-plugin"
      plugin_id = "fixture"
    }
  }
}
