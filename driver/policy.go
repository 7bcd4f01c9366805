package driver

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
)

// checkPrivileged refuses privileged = true for a task that is not a CSI
// plugin task, when the operator limits privilege to plugins
// (privileged_plugins_only, on by default). allow_privileged is checked
// before, by TaskConfig.validate.
func checkPrivileged(conf *Config, cfg *drivers.TaskConfig, tc *TaskConfig) error {
	if !tc.Privileged || !conf.PrivilegedPluginsOnly || tc.CSIPlugin != nil || nomadPluginTask(cfg) {
		return nil
	}
	return errors.New("privileged = true is only allowed for CSI plugin tasks on this node (privileged_plugins_only = true in the driver's plugin config): give the task a csi_plugin block (this driver's in config, or Nomad's in the task) if it is a CSI plugin, drop privileged = true otherwise, or have the operator set privileged_plugins_only = false")
}

// nomadPluginTask reports whether the task is a plugin task of Nomad's own
// task-level csi_plugin block. Nomad's client prepares such a task (its
// csi_plugin_supervisor hook) with, among others, two bidirectional mounts
// from its state directory: the plugin's socket directory,
// <state_dir>/csi/plugins/<alloc id>, and its staging directory,
// <state_dir>/csi/<type>/<plugin id>.
//
// Neither can be faked by a job: it can set env vars and ask for
// bidirectional propagation on host volumes, but a host volume's path is
// the operator's (or, for a dynamic host volume, named by the volume's
// id), and no job knows its allocation's id before it is placed. The
// state directory is not known to the driver (Nomad does not tell it), so
// it is taken from the socket mount, and the staging mount must be under
// the same one.
func nomadPluginTask(cfg *drivers.TaskConfig) bool {
	if cfg.AllocID == "" || strings.ContainsRune(cfg.AllocID, '/') {
		return false
	}
	suffix := "/" + filepath.Join("csi", "plugins", cfg.AllocID)
	var stateDirs []string
	for _, m := range cfg.Mounts {
		if m == nil || m.PropagationMode != executor.PropagationBidirectional {
			continue
		}
		host := filepath.Clean(m.HostPath)
		if state, ok := strings.CutSuffix(host, suffix); ok && state != "" && filepath.IsAbs(state) {
			stateDirs = append(stateDirs, state)
		}
	}
	for _, state := range stateDirs {
		for _, m := range cfg.Mounts {
			if m == nil || m.PropagationMode != executor.PropagationBidirectional {
				continue
			}
			rel, err := filepath.Rel(filepath.Join(state, "csi"), filepath.Clean(m.HostPath))
			if err != nil {
				continue
			}
			typ, id, ok := strings.Cut(rel, "/")
			if !ok || id == "" || strings.ContainsRune(id, '/') || id == ".." {
				continue
			}
			switch typ {
			case PluginTypeNode, PluginTypeController, PluginTypeMonolith:
				return true
			}
		}
	}
	return false
}

// jobRef names a Nomad job: the owner of a plugin id.
type jobRef struct{ namespace, id string }

// jobOf is the job of a task ("default" namespace when Nomad gave none).
func jobOf(cfg *drivers.TaskConfig) jobRef {
	ns := cfg.Namespace
	if ns == "" {
		ns = "default"
	}
	return jobRef{namespace: ns, id: cfg.JobID}
}

// String is how the job is named in messages and recorded with volumes
// as the server of their plugin (csihook.PluginInfo.Server).
func (j jobRef) String() string { return fmt.Sprintf("job %q in namespace %q", j.id, j.namespace) }

// socketServer is how a plugin served by a socket in plugin_socket_dirs is
// named as a volume's server.
func socketServer(socket string) string {
	return fmt.Sprintf("socket %q in plugin_socket_dirs", socket)
}

// socketCheckTimeout bounds how long a plugin task's start waits for
// sockets in plugin_socket_dirs to say which plugin ids they serve.
const socketCheckTimeout = 5 * time.Second

// claimPlugin reserves a plugin id for a task that is starting. The id is
// refused when another live task serves it; when a socket in
// plugin_socket_dirs serves it (unless the task's job held it before
// that socket came: a socket appearing later does not take over a task's
// id); and when volumes recorded on this node were set up through
// another server of the id (another job, or a socket), until they are
// released. It reports whether the task takes back an id its job held
// (fingerprint.PluginSpec.Reclaim). On error nothing is claimed.
func (d *Driver) claimPlugin(cfg *drivers.TaskConfig, pc *PluginTaskConfig) (bool, error) {
	job := jobOf(cfg)
	reclaim, err := d.plugins.claim(cfg, *pc, job)
	if err != nil {
		return false, err
	}
	fail := func(err error) (bool, error) {
		d.plugins.drop(cfg.ID, pc.ID)
		return false, err
	}
	if !reclaim {
		if p := d.currentProber(); p != nil {
			ctx, cancel := context.WithTimeout(d.ctx, socketCheckTimeout)
			sock, served := p.SocketServing(ctx, pc.ID)
			cancel()
			if served {
				return fail(fmt.Errorf("csi_plugin id %q is already served on this node by the socket %q in plugin_socket_dirs: a task cannot take over the operator's plugin; choose another id", pc.ID, sock))
			}
		}
	}
	m, err := d.volumes()
	if err != nil {
		return fail(fmt.Errorf("csi_plugin id %q: cannot check the volumes recorded for it: %w", pc.ID, err))
	}
	for _, server := range m.PluginServers(pc.ID) {
		if server != job.String() {
			return fail(fmt.Errorf("csi_plugin id %q cannot be served by %s on this node: volumes of the plugin here were set up through %s and are not released yet, and their calls would go to this task; run the plugin in that job again, or stop the tasks using volumes of plugin %q and wait for their teardown",
				pc.ID, job, server, pc.ID))
		}
	}
	return reclaim, nil
}

// pluginServer says who serves a plugin id the prober knows: the job of a
// plugin task, or a socket in plugin_socket_dirs.
func (d *Driver) pluginServer(st fingerprint.PluginStatus) string {
	if st.Source == fingerprint.SourceSocketDir {
		return socketServer(st.Socket)
	}
	if job, ok := d.plugins.job(st.ID, st.TaskID); ok {
		return job.String()
	}
	return ""
}
