# A Nomad client agent with the csi task driver.
#
# Copy build/plugins/nomad-driver-csi (from `make dev`) into plugin_dir, then
# start the agent as root: nomad agent -config=agent.hcl
data_dir   = "/var/lib/nomad"
plugin_dir = "/var/lib/nomad/plugins"

client {
  enabled = true
}

plugin "nomad-driver-csi" {
  config {
    # Turn the driver off without removing it.
    enabled = true

    # Let jobs run tasks with privileged = true (CSI node and monolith
    # plugins need it). Off by default, as with Docker's driver.
    allow_privileged = true

    # Where the driver keeps task state. Keep it short: CSI socket paths
    # under it must stay below 107 bytes.
    root_dir = "/var/lib/nomad-driver-csi"

    # The control group every task goes under.
    cgroup_parent = "nomad-csi"
  }
}
