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

    # Let tasks run with privileged = true (CSI node and monolith plugins
    # need it). Off by default, as with Docker's driver. It grants no job
    # anything by itself: only the jobs of a privileged_grant below run
    # privileged.
    allow_privileged = true

    # Only CSI plugin tasks may be privileged (the default).
    privileged_plugins_only = true

    # The plugin job of examples/jobs/csi-plugin.nomad.hcl may run
    # privileged, only from this binary (a file root owns and only root can
    # write), and only it may serve the plugin id "fixture" on this node,
    # even while it restarts. Repeat the block for every plugin job; a
    # privileged task that no grant matches is refused, and the refusal
    # gives the block to add. namespace and job are globs ("*").
    privileged_grant {
      namespace = "default"
      job       = "csi-plugin"
      command   = "/usr/local/bin/csi-fixture"
      plugin_id = "fixture"
    }

    # What tasks that are not privileged see of the host, read-only (exec's
    # list, plus where the programs they run are installed).
    chroot_env {
      "/bin"                 = "/bin"
      "/etc"                 = "/etc"
      "/lib"                 = "/lib"
      "/lib32"               = "/lib32"
      "/lib64"               = "/lib64"
      "/run/resolvconf"      = "/run/resolvconf"
      "/run/systemd/resolve" = "/run/systemd/resolve"
      "/sbin"                = "/sbin"
      "/usr"                 = "/usr"
    }

    # exec's isolation options, with their defaults.
    default_pid_mode = "private"
    default_ipc_mode = "private"
    allow_caps = ["audit_write", "chown", "dac_override", "fowner", "fsetid", "kill", "mknod",
    "net_bind_service", "setfcap", "setgid", "setpcap", "setuid", "sys_chroot"]

    # Which namespaces may use which volumes. A volume's owner on a node is
    # the namespace that used it there first; with grants, the same on
    # every node, a job reaches only the volumes its namespace is granted,
    # on any node. Without any, every job may name every volume.
    # volume_grant {
    #   namespace = "default"
    #   plugin_id = "fixture"
    #   volume_id = "*"
    # }

    # To keep ordinary jobs from running as root on this node (privileged
    # plugin tasks keep root by their grant; every other task, plugin tasks
    # that are not privileged included, is checked; the example volume jobs
    # run as root, since the fixture's volumes belong to root):
    # denied_host_uids = "0"
    # denied_host_gids = "0"

    # A task's user = "name:group" may name only a group its user is a
    # member of in the host's group database, or one listed here:
    # allow_user_groups = ["www-data"]

    # Where the driver keeps task state. Keep it short: CSI socket paths
    # under it must stay below 107 bytes.
    root_dir = "/var/lib/nomad-driver-csi"

    # The control group every task goes under.
    cgroup_parent = "nomad-csi"

    # Sample each published volume's usage and condition (NodeGetVolumeStats)
    # once a minute; "0" turns it off.
    volume_stats_interval = "1m"

    # Serve Prometheus metrics on a unix socket only root can connect to
    # ("" or unset: none). A TCP address is reached by every task on the
    # host network, loopback included: it needs metrics_token_file too.
    metrics_address = "unix:///run/nomad-driver-csi/metrics.sock"
  }
}
