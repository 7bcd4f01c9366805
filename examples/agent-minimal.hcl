# The smallest client agent with the csi driver. Run as root:
# nomad agent -config=agent-minimal.hcl (examples/agent.hcl has every key).
data_dir   = "/var/lib/nomad"
plugin_dir = "/var/lib/nomad/plugins"

client {
  enabled = true
}

plugin "nomad-driver-csi" {
  config {
    # CSI node and monolith plugins run privileged.
    allow_privileged = true
  }
}
