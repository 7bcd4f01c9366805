// Package csihook speaks the CSI volume lifecycle for the csi task driver:
// it makes the volumes a task names appear at host paths the driver binds
// into the task, and takes them away again when the task ends, surviving
// driver restarts and plugin crashes without leaking a mount. It knows
// nothing of Nomad's RPCs; the driver decodes the task's volume blocks into
// VolumeRequests and calls a Manager.
//
// # API
//
//	m, err := csihook.New(csihook.Config{Root: ..., Lookup: ..., Dial: csihook.DialUnix, Events: ...})
//	m.Recover(func(taskID string) bool { ... })   // after RecoverTask; tears down orphans
//	err = m.Validate(reqs)                         // static checks, no plugin calls
//	pubs, err := m.Setup(ctx, taskID, reqs)        // all or nothing; bind pubs[i].HostPath at Destination
//	err = m.Teardown(ctx, taskID)                  // retried in the background on failure
//	m.Close()
//	st, err := csihook.ReadJournal(dir)            // read-only, no secrets; for tests and tools
//
// # Lifecycle
//
// Setup validates every request, looks every plugin up (missing or
// unhealthy: fail at once naming plugin and node) and checks capabilities
// (block-device needs PluginInfo.Block, create needs CREATE_DELETE_VOLUME)
// and sharing before it writes or calls anything, so bad input leaves
// nothing behind. Then per volume, in order:
//
//  1. CreateVolume named after volume_id when there is a create block;
//     from then on the plugin's volume id and context (merged over the
//     request's context, the plugin's keys winning) are used.
//  2. ControllerPublishVolume when the plugin has PUBLISH_UNPUBLISH_VOLUME,
//     to the node id from the fingerprint or NodeGetInfo; the publish
//     context is kept for the node calls.
//  3. NodeStageVolume when the plugin has STAGE_UNSTAGE_VOLUME, once per
//     volume on the node, at Root/staging/<plugin>/<hash(volume id)>.
//  4. NodePublishVolume per task at Root/publish/<hash(task id)>/<name>
//     (the CO makes the parent, the plugin the target: a directory, or a
//     file for block devices).
//
// If a volume fails, the volumes before it are torn down again. Teardown is
// the exact reverse: NodeUnpublishVolume, then NodeUnstageVolume and
// ControllerUnpublishVolume only when no other task on the node still uses
// the volume. NotFound on any of these is success, and after the plugin
// says a path is unpublished or unstaged it must no longer be a mount
// point, otherwise the step counts as failed. Hashes are the first 16 hex
// characters of SHA-256.
//
// Operations are serialised per volume (plugin id + volume id), never
// globally: a hung volume delays only the operations on that volume, and a
// waiter gives up when its context ends.
//
// # Access modes
//
// access_mode is one of single-node-writer, single-node-reader-only,
// multi-node-reader-only, multi-node-single-writer, multi-node-multi-writer
// (required); attachment_mode is file-system (default) or block-device.
// read_only = true makes the task's view read-only; with single-node-writer
// the one publish of the allocation stays read/write (publishReadOnly) and
// the task binds it read-only. A reader-only mode publishes read-only even
// without read_only. A volume staged on the node is shared only by requests with
// the same access mode, attachment mode and fs_type, a single-node-writer
// volume by the tasks of one allocation, and a multi-node-single-writer volume by
// readers (read_only = true) and the tasks of one writing allocation, as
// Nomad documents the mode: one allocation has read/write access.
//
// # Journal
//
// Every call is journalled before it is made ("-ing", durable before the
// call) and its result after it, with the next call's record, so a crash
// leaves either a finished step or one marked in progress ("uncertain"),
// which recovery settles by calling again: the CSI spec makes every call
// idempotent. A setup commits the task's intent to publish with the
// volume's first record, so that one fdatasync covers NodeStageVolume and
// NodePublishVolume (two after a ControllerPublishVolume); a setup that
// fails before its NodePublishVolume does not unpublish, but recovery
// after a crash there does. The results of the last calls of a setup or a
// release are committed lazily: written at once, so that a driver that
// dies loses nothing, and synced with the next commit or within 200 ms,
// since only a crash of the host can lose them, which leaves their calls
// uncertain. The
// journal directory (Config.JournalDir, default Root/journal, mode 0700)
// holds journal.log (mode 0600) and .lock, whose flock keeps a second
// manager out. The journal keeps the live records in memory too, once:
// they are the manager's (a commit applies them once its batch is
// written, whole, with the secrets a call of this process may still need;
// the log and a compaction get them without secrets no call needs). The
// log is only read when the manager starts, and by ReadJournal, which
// replays it read-only and without the lock while a manager runs.
//
// The log is append-only; its file side (frames, preallocation, syncs,
// compaction, the lock) is package wal, its records this package's
// journal.go. Each commit appends one frame holding a batch of operations
// and, unless lazy, is made durable with fdatasync before it returns:
//
//	"\xffCSJ" | payload length (uint32 LE) | CRC-32C of the three (uint32 LE) | payload
//	payload: {"ops": [{"op": "put_vol", "vol": {...}},
//	                  {"op": "drop_task", "task_id": ..., "name": ...}, ...]}
//
// put_vol, put_task, put_created and put_owner carry a whole record, drop_vol
// (plugin_id, volume_id), drop_task (task_id, name) and drop_created
// (plugin_id, name) its key. Replay applies the frames in order, later
// records winning and drops deleting; a batch is replayed whole or not at
// all. The file is zero-filled ahead of the log, so that a commit
// overwrites zeros instead of growing the file; the log ends where only
// zeros follow. Records:
//
//	volume on this node
//	  {"version":1, "plugin_id", "volume_id", "staging_path", "node_id",
//	   "access_mode", "attachment_mode", "fs_type", "mount_flags",
//	   "volume_context", "publish_context", "secrets",
//	   "controller": ""|"publishing"|"published"|"unpublishing",
//	   "stage": ""|"staging"|"staged"|"refused"|"unstaging",
//	   "server" (who served the plugin id, may be absent),
//	   "namespace" (the namespace claiming the volume, may be absent),
//	   "updated"}
//	volume of a task
//	  {"version":1, "task_id", "name", "seq", "plugin_id", "volume_id",
//	   "target", "destination", "read_only", "access_mode",
//	   "attachment_mode", "fs_type", "mount_flags", "volume_context",
//	   "secrets", "state": "pending"|"publishing"|"published"|"unpublishing",
//	   "updated"}
//	volume created by name
//	  {"version":1, "plugin_id", "name", "volume_id", "volume_context",
//	   "updated"}
//	Nomad namespace a volume belongs to (kept after its release)
//	  {"version":1, "plugin_id", "volume_id", "namespace", "updated"}
//
// "server", the owner records and "namespace" came later without a new
// version: journals without them replay as they are, and their volumes
// are adopted by the first namespace, and the first server, that use
// them.
//
// A volume nobody owns is claimed by the namespace setting it up with
// its record ("namespace"), in the first batch, and the claim becomes an
// owner record in the lazy batch of its first successful
// NodePublishVolume: ownership costs no commit of its own. A setup that
// fails gives the claim up with the volume's record, so a job cannot take
// another namespace's volumes with calls bound to fail; a record other
// tasks use outlives a failed setup, so it is not claimed, and the
// namespace publishing it owns it with that lazy batch. A teardown's
// first commit is synced and comes before any record of the volume is
// dropped, so a published volume has an owner record on disk before its
// claim goes; after a crash, a claim whose task record may have been
// published (any state but pending) is made an owner record at start,
// written with the first commit or compaction.
//
// A task record exists from before the first call made for it until its
// unpublish finished. The number of users of a volume is never stored: it
// is the number of task records naming it, so it cannot drift from what is
// really published. The records hold the volume's secrets only while a
// call that takes them may still be made from them, so that an
// interrupted ControllerPublish, NodeStage or NodePublish can be re-issued
// and ControllerUnpublishVolume sent after a restart; once none is left
// (published; staged and not attached) the record is written without them
// and a compaction soon removes them from the file. They never reach a
// log line.
//
// At start the log is replayed without writing anything that needs free
// space (a torn tail is cut off by truncating), so a full disk cannot keep
// the journal, and recovery, from opening. A compaction writes the live
// records to a temp file in frames of about 1 MiB, fsyncs it, renames it
// over the log, and fsyncs the directory; it runs once the log passes
// 1 MiB and twice the size of the live records, and soon after a commit
// or a start that leaves the log holding what only a compaction removes
// (secrets no record needs, damage, records moved in). One that fails
// leaves the old log in use and is tried again later. A frame cut short
// by a crash at the end of the log is dropped with a warning. A damaged frame followed by
// intact ones is skipped with an error and the frames after it are kept
// (they are newer and say what is mounted now); a copy of the log as it
// was is kept as journal.log.<time>.bad, mode 0600 (the newest three; a
// copy that cannot be made yet is made before the next compaction), and what the lost
// records described must be cleaned up by hand. Records of another version
// are skipped the same way, never guessed at.
//
// Journals of the earlier format, one JSON file per record
// (v-<hash(plugin id, volume id)>.json, t-<hash(task id)>-<hash(name)>.json,
// c-<hash(plugin id, name)>.json), are moved into the log at start: the
// files are read over what the log holds, written into it durably, and
// only then removed. Files that cannot be read are renamed *.bad and
// logged.
//
// # Recovery
//
// New loads the journal, so Teardown works for tasks set up before a
// restart and Setup again for such a task returns its paths without
// calling the plugin when the target is still mounted. Recover then checks
// published targets against the mount table and, in the background, one
// worker per volume: tears down the volumes of tasks that are not live
// (orphans), and tasks caught mid-teardown; unstages and detaches volumes
// nobody uses, including ones caught mid-stage; re-issues the idempotent
// ControllerPublish, NodeStage and NodePublish for live tasks whose step
// was uncertain or whose target lost its mount. Workers retry until the
// plugin answers; WaitIdle waits for them. The calls for live tasks wait
// until the plugin is healthy, since what they send depends on
// capabilities a plugin not probed yet does not show.
//
// # Retries
//
// Every RPC runs under Config.RPCTimeout. The codes the table
// fingerprint/csiclient.Rules retries for the method (for every volume
// call: Unavailable, ResourceExhausted, Aborted and DeadlineExceeded, but
// ResourceExhausted is final from CreateVolume and
// ControllerPublishVolume, whose cause the CSI spec says must be
// addressed before a retry) are
// retried in line with capped, jittered exponential backoff
// (RetryAttempts, RetryBase, RetryMax); other codes
// are final and become an *OpError whose message says what to do. A
// teardown that fails for any reason but InvalidArgument or Unimplemented
// is retried in the background (BackgroundRetryBase..BackgroundRetryMax)
// until it succeeds, each failure reported as an event such as
// `Unpublishing volume "data" failed (Unavailable: ...): retrying in 4s`.
// A teardown that cannot succeed stays in the journal for the next start.
//
// # Secrets
//
// Secrets reach the plugin and nothing else: requests are never logged
// (logs carry method, task, plugin and volume ids, paths and codes), and
// every secret value is replaced by "<redacted>" in a plugin's messages
// before they go into an error, an event or a log line. OpError does not
// wrap the plugin's error, so nothing unredacted is reachable from it.
// Mount flags are not logged either.
//
// # Events
//
// Config.Events gets what a person following the task should see:
// "Creating volume", "Attaching volume", "Staging volume", `Published
// volume "data" at /data`; one event per volume when its teardown is done,
// naming the calls it made (`Unpublished, unstaged and detached volume
// "data"`); failures with the CSI code and message and the step that
// failed, retries and their outcome. Recover's events go to the task that is gone; those about
// a volume no task record names have an empty task id.
package csihook
