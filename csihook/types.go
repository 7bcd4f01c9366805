package csihook

import (
	"context"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// Access modes accepted in VolumeRequest.AccessMode.
const (
	AccessSingleNodeWriter       = "single-node-writer"
	AccessSingleNodeReaderOnly   = "single-node-reader-only"
	AccessMultiNodeReaderOnly    = "multi-node-reader-only"
	AccessMultiNodeSingleWriter  = "multi-node-single-writer"
	AccessMultiNodeMultiWriter   = "multi-node-multi-writer"
	AttachmentFileSystem         = "file-system"
	AttachmentBlockDevice        = "block-device"
	defaultRPCTimeout            = time.Minute
	defaultPluginWait            = 30 * time.Second
	defaultRetryAttempts         = 5
	defaultRetryBase             = 500 * time.Millisecond
	defaultRetryMax              = 8 * time.Second
	defaultBackgroundRetryBase   = 2 * time.Second
	defaultBackgroundRetryMax    = 2 * time.Minute
	defaultRollbackTimeoutFactor = 4
	defaultRepairBackoffBase     = 20 * time.Second
	defaultRepairBackoffMax      = 5 * time.Minute
)

// VolumeRequest is one `volume "<name>" { ... }` block of a task, decoded by
// the driver. Sizes are in bytes.
type VolumeRequest struct {
	// Name is the block label. It names the target directory under the
	// publish root, so it must be 1-63 letters, digits, '.', '_' or '-'.
	Name string
	// PluginID is the CSI plugin serving the volume.
	PluginID string
	// VolumeID is the plugin's volume id, or with Create the name the
	// volume is created under (CreateVolume is idempotent by name).
	VolumeID string
	// Destination is the absolute path inside the task.
	Destination string
	// ReadOnly gives the task the volume read-only. A single-node-writer
	// volume is still published read/write, once for the tasks of the
	// allocation, and the task's bind of it is read-only (publishReadOnly).
	ReadOnly bool
	// AccessMode is one of the Access* constants; required.
	AccessMode string
	// AttachmentMode is AttachmentFileSystem (the default when empty) or
	// AttachmentBlockDevice.
	AttachmentMode string
	// FSType and MountFlags are the mount_options block; an empty FSType is
	// not sent. Neither may be set for a block device.
	FSType     string
	MountFlags []string
	// Context is merged under the plugin's own volume context (the
	// plugin's keys win) and sent to ControllerPublish, NodeStage and
	// NodePublish.
	Context map[string]string
	// Secrets are sent to the plugin and never logged nor put in errors
	// or events. They are kept in the journal (mode 0600) so that an
	// interrupted call can be re-issued after a restart.
	Secrets map[string]string
	// Create, when set, creates the volume (by name VolumeID) before use.
	Create *CreateRequest
	// Namespace is the Nomad namespace of the task's job. A volume belongs
	// to the namespace that created it on this node or first had it
	// published here, and is claimed meanwhile by a namespace setting it
	// up (a claim a failed setup gives up with the volume's record); other
	// namespaces are refused unless Config.AllowCrossNamespace is set. An
	// empty Namespace neither claims a volume nor is checked.
	Namespace string
	// MountGroup is the task's primary group id in decimal, set by the
	// driver for a task that does not run as root ("" for one that does).
	// A plugin with the node capability VOLUME_MOUNT_GROUP receives it in
	// the volume capability of NodeStageVolume and NodePublishVolume; to
	// others it is not sent (see ApplyMountGroup).
	MountGroup string
	// ApplyMountGroup is the volume block's mount_group = true: when the
	// plugin lacks VOLUME_MOUNT_GROUP, the driver itself gives the root
	// directory of a writable file-system volume the group MountGroup
	// after each publish (see applyVolumeGroup). A job can only name its
	// own task's group this way, never another gid.
	ApplyMountGroup bool
	// applyGroup is MountGroup once preflight found the plugin lacking
	// VOLUME_MOUNT_GROUP and the request asking for ApplyMountGroup.
	applyGroup string
}

// CreateRequest is the create block of a volume.
type CreateRequest struct {
	// CapacityMin and CapacityMax are bytes; 0 means unset.
	CapacityMin, CapacityMax int64
	Parameters               map[string]string
}

// PluginInfo is what the manager needs to know of a plugin from the
// driver's fingerprint.
type PluginInfo struct {
	ID string
	// Socket is the plugin's node (or monolith) socket.
	Socket string
	// ControllerSocket, when set, serves the Controller RPCs; otherwise
	// they go to Socket.
	ControllerSocket string
	// NodeID is the plugin's NodeGetInfo answer; when empty and a
	// ControllerPublish is needed, NodeGetInfo is asked.
	NodeID  string
	Healthy bool
	// HealthDescription says why the plugin is unhealthy.
	HealthDescription string
	// StageUnstage is the node capability STAGE_UNSTAGE_VOLUME.
	StageUnstage bool
	// ControllerPublish is the controller capability
	// PUBLISH_UNPUBLISH_VOLUME.
	ControllerPublish bool
	// PublishReadonly is the controller capability PUBLISH_READONLY:
	// without it ControllerPublishVolume's readonly must be false (CSI
	// spec), and a reader-only volume is made read-only by the node calls
	// alone.
	PublishReadonly bool
	// VolumeStats and VolumeCondition are the node capabilities
	// GET_VOLUME_STATS and VOLUME_CONDITION (the stats loop).
	VolumeStats     bool
	VolumeCondition bool
	// CreateDelete is the controller capability CREATE_DELETE_VOLUME.
	CreateDelete bool
	// Block is set when the plugin serves block-device volumes. CSI has no
	// capability for it, so the driver sets it from the plugin's
	// configuration; block-device requests to other plugins are refused.
	Block bool
	// Topology is the node's accessible topology from NodeGetInfo (nil:
	// none); MaxVolumes its max_volumes_per_node (0: no limit). See
	// topology.go.
	Topology   map[string]string
	MaxVolumes int64
	// AccessibilityConstraints is the plugin capability
	// VOLUME_ACCESSIBILITY_CONSTRAINTS: without it CreateVolume gets no
	// accessibility_requirements (CSI spec) and Topology is not used.
	AccessibilityConstraints bool
	// ControllerExpand is the controller capability EXPAND_VOLUME,
	// NodeExpand the node capability EXPAND_VOLUME (see expand.go).
	ControllerExpand bool
	NodeExpand       bool
	// OnlineExpansion and OfflineExpansion are the plugin capabilities
	// VolumeExpansion ONLINE and OFFLINE. With OFFLINE only,
	// ControllerExpandVolume is never called for a volume that is
	// attached, staged or published on this node (CSI spec: OFFLINE
	// expansion waits until the volume is released); a plugin with
	// neither is not held back, as the spec restricts only OFFLINE.
	OnlineExpansion  bool
	OfflineExpansion bool
	// VolumeMountGroup is the node capability VOLUME_MOUNT_GROUP: the
	// plugin applies VolumeRequest.MountGroup itself.
	VolumeMountGroup bool
	// ControllerOnly is set when the plugin does not run the CSI Node
	// service (a plugin of type controller): volumes are never staged or
	// published through it.
	ControllerOnly bool
	// Server says who serves the plugin id now, in words (such as `job
	// "x" in namespace "y"`). It is recorded with each volume set up
	// through the plugin, so that the driver can refuse to let another
	// server take the id over while those volumes are on the node
	// (Manager.PluginServers).
	Server string
}

// PluginLookup returns a plugin's current fingerprint. An error means the
// plugin is not known on this node.
type PluginLookup func(id string) (PluginInfo, error)

// Published is a volume ready for the driver to bind into the task.
type Published struct {
	Name string
	// HostPath is the NodePublishVolume target: a directory, or for a
	// block device a file with the device node bound on it.
	HostPath    string
	Destination string
	ReadOnly    bool
	Block       bool
}

// EventFunc receives a task event a person can follow.
type EventFunc func(taskID, msg string, annotations map[string]string)

// Config configures a Manager. Root, Lookup and Dial are required.
type Config struct {
	// Root holds staging paths (Root/staging/<plugin>/<volume-hash>) and
	// publish targets (Root/publish/<task-hash>/<name>). Plugins must see
	// it at the same path with mount propagation back to the host.
	Root string
	// JournalDir holds the journal; default Root/journal. It must survive
	// driver restarts.
	JournalDir string
	Lookup     PluginLookup
	// Dial returns a client for a plugin socket. DialUnix is the real one.
	Dial func(socket string) (Client, error)
	// Mounter is used to check mounts; default mounter.New().
	Mounter mounter.Interface
	Logger  hclog.Logger
	Events  EventFunc
	// Released, when set, is called once a teardown that Teardown left to
	// the background has finished: no event goes to the task after that.
	Released func(taskID string)
	// NodeName names this node in messages; default the hostname.
	NodeName string
	// AllowCrossNamespace lets a task use a volume that belongs to
	// another Nomad namespace (see VolumeRequest.Namespace). Ownership
	// is recorded either way.
	AllowCrossNamespace bool

	// PluginWait is how long Setup waits for a plugin that is not known
	// or not healthy yet before it fails: a plugin task started with the
	// workload, or taken back by a driver that just restarted, takes a
	// moment. Default 30s; negative: no wait.
	PluginWait time.Duration

	// RPCTimeout is the deadline of every single RPC; default 1m.
	RPCTimeout time.Duration
	// RetryAttempts, RetryBase and RetryMax bound the in-line retries of
	// one call on a retryable code; defaults 5, 500ms, 8s.
	RetryAttempts int
	RetryBase     time.Duration
	RetryMax      time.Duration
	// BackgroundRetryBase and BackgroundRetryMax pace the background
	// teardown retries; defaults 2s and 2m.
	BackgroundRetryBase time.Duration
	BackgroundRetryMax  time.Duration
	// RepairBackoffBase and RepairBackoffMax pace the repairs of a task
	// volume whose repaired mount died again before a check saw it alive
	// (see RepairStale): the first such relapse waits RepairBackoffBase
	// before its repair, each further one twice as long, up to
	// RepairBackoffMax; defaults 20s (less than the driver's 30s between
	// checks: the next check repairs it) and 5m. Repairs that the plugin
	// failed, one after another while it stayed healthy, are paced alike.
	RepairBackoffBase time.Duration
	RepairBackoffMax  time.Duration

	// StatsInterval is how often each published volume is sampled with
	// NodeGetVolumeStats once StartStats runs (stats.go); zero or less:
	// never.
	StatsInterval time.Duration
	// Observe, when set, hears of every attempt of every CSI call the
	// manager makes, with the plugin's id (metrics).
	Observe func(pluginID string, o csiclient.Observation)
}

// rollbackContext returns the context a rollback runs under: not
// cancelled with the caller's, but bounded.
func (m *Manager) rollbackContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), m.cfg.RPCTimeout*defaultRollbackTimeoutFactor)
}
