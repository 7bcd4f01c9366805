package driver

import (
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
)

const (
	// PluginName is the name jobs use in `driver = "csi"`. (Operators
	// configure the plugin under the name of its file in plugin_dir.)
	PluginName = "csi"

	// DefaultRootDir is where the driver keeps its state when the operator
	// does not say otherwise.
	DefaultRootDir = "/var/lib/nomad-driver-csi"

	// DefaultCgroupParent is the control group every task goes under.
	DefaultCgroupParent = "nomad-csi"

	// DefaultPluginMountDir is where a plugin task finds its socket
	// directory when its csi_plugin block does not say.
	DefaultPluginMountDir = "/csi"

	// taskHandleVersion is the version of TaskState below.
	taskHandleVersion = 1
)

// Version is the driver's version, set at build time with
// -ldflags "-X github.com/nomad-driver-csi/nomad-driver-csi/driver.Version=...".
var Version = "0.1.0-dev"

var pluginInfo = &base.PluginInfoResponse{
	Type:              base.PluginTypeDriver,
	PluginApiVersions: []string{drivers.ApiVersion010},
	PluginVersion:     Version,
	Name:              PluginName,
}

var capabilities = &drivers.Capabilities{
	SendSignals: true,
	Exec:        true,
	// The driver builds each task's root itself (no chroot copy): Nomad
	// hands it the allocation's directories to mount at /alloc, /local and
	// /secrets, as for an image-based driver.
	FSIsolation: drivers.FSIsolationImage,
	// As exec: the host's network, or the group's network namespace that
	// Nomad makes (bridge, none, cni/*) and the task joins; the driver
	// makes none of its own (see network.go).
	NetIsolationModes: []drivers.NetIsolationMode{
		drivers.NetIsolationModeHost,
		drivers.NetIsolationModeGroup,
	},
	MustInitiateNetwork: false,
	MountConfigs:        drivers.MountConfigSupportAll,
}
