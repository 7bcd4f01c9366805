// Package fingerprint turns the answers of the CSI plugins on this node
// (Identity, Node and, for controllers, ControllerGetCapabilities) into
// Nomad node attributes under "driver.csi." and into plugin health.
//
// Client talks to one plugin socket; Prober owns the set of plugin sockets,
// keeps one connection per plugin, probes each every second and keeps a
// PluginStatus record per plugin; Build turns those records into
// attributes. Build is pure, so what the node advertises can be tested
// without any plugin running.
//
// # Attributes
//
// <key> is SanitizeID(id): ASCII letters, digits, '_' and '-' are kept,
// every other byte becomes '_' ("hostpath.csi.k8s.io" → "hostpath_csi_k8s_io").
// Should two ids sanitize alike, the one that needed no sanitizing keeps the
// key and the other gets "_<8 hex digits of fnv32a(id)>" appended.
//
//	driver.csi.plugins                                   string  sorted, comma-separated plugin ids (as given)
//	driver.csi.conflicting_sockets                       string  sorted, comma-separated sockets whose id is taken
//	driver.csi.plugin.<key>.id                           string  the plugin id as given
//	driver.csi.plugin.<key>.healthy                      bool
//	driver.csi.plugin.<key>.health_description           string  only when unhealthy
//	driver.csi.plugin.<key>.socket                       string  socket path
//	driver.csi.plugin.<key>.source                       string  task | socket_dir
//	driver.csi.plugin.<key>.type                         string  node | controller | monolith (declared, or derived for socket_dir)
//
// Once the plugin answered (kept, last known, while it is unreachable):
//
//	driver.csi.plugin.<key>.vendor                       string  GetPluginInfo name
//	driver.csi.plugin.<key>.version                      string  GetPluginInfo vendor_version
//	driver.csi.plugin.<key>.controller_service           bool    plugin capability CONTROLLER_SERVICE
//	driver.csi.plugin.<key>.volume_accessibility_constraints bool
//	driver.csi.plugin.<key>.group_controller_service     bool
//	driver.csi.plugin.<key>.snapshot_metadata_service    bool
//	driver.csi.plugin.<key>.online_expansion             bool    plugin capability VolumeExpansion ONLINE
//	driver.csi.plugin.<key>.offline_expansion            bool    plugin capability VolumeExpansion OFFLINE
//	driver.csi.plugin.<key>.node_service                 bool    the plugin answered NodeGetCapabilities
//
// With a node service:
//
//	driver.csi.plugin.<key>.node_id                      string
//	driver.csi.plugin.<key>.max_volumes                  int     only when > 0
//	driver.csi.plugin.<key>.topology.<segment key>       string  one per accessible topology segment, key verbatim
//	driver.csi.plugin.<key>.stage_unstage                bool    STAGE_UNSTAGE_VOLUME
//	driver.csi.plugin.<key>.get_volume_stats             bool
//	driver.csi.plugin.<key>.expand                       bool    node EXPAND_VOLUME
//	driver.csi.plugin.<key>.volume_condition             bool
//	driver.csi.plugin.<key>.single_node_multi_writer     bool
//	driver.csi.plugin.<key>.volume_mount_group           bool
//
// With a controller service (ControllerGetCapabilities answered):
//
//	create_delete_volume, controller_publish, controller_publish_readonly,
//	list_volumes, list_volumes_published_nodes, get_capacity,
//	create_delete_snapshot, list_snapshots, get_snapshot, clone_volume,
//	controller_expand, controller_volume_condition, controller_get_volume,
//	controller_single_node_multi_writer, controller_modify_volume
//	(all bool, under driver.csi.plugin.<key>.)
//
// # Health
//
// A plugin is healthy when Probe succeeds and says ready (an absent ready
// field is ready), and the services its type needs answer: node and
// monolith need the Node service, controller and monolith the Controller
// service. Unimplemented for the Node calls of a controller is "no node
// service", not a failure. The Node service is NodeGetCapabilities, which
// every node plugin implements; NodeGetInfo may be Unimplemented (no
// node_id, limit or topology then) unless the plugin's own controller has
// PUBLISH_UNPUBLISH_VOLUME, as the CSI spec has it. The description says
// why otherwise, e.g.
// `socket "/csi/csi.sock" does not exist`, "plugin reports not ready",
// "probe failed: Unavailable: ..." or "probe failed: DeadlineExceeded: ...".
//
// A plugin's answers are held to the CSI spec's bounds before they become
// attributes: a name over 63 characters, a node_id over 256 bytes, a
// topology key over 127 bytes (or empty) or value over 63, or more than
// 64 topology segments makes the plugin unhealthy with that reason (and a
// socket in plugin_socket_dirs with such a name gets no id). The opaque
// vendor_version is cut to 256 characters and a health description to
// 1024, so that a plugin cannot put megabytes into every node update.
package fingerprint
