package csihook

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/wal"
)

// journalVersion is written in every record; records of another version
// are set aside, never guessed at.
const journalVersion = 1

// Phases of a step. A record is written with the "-ing" phase before the
// call and with the result after it, so a record found in an "-ing" phase
// after a restart is an uncertain call that recovery settles.
const (
	phaseNone         = ""
	phasePending      = "pending" // task record: registered as a user, publish not begun
	phasePublishing   = "publishing"
	phasePublished    = "published"
	phaseUnpublishing = "unpublishing"
	phaseStaging      = "staging"
	phaseStaged       = "staged"
	phaseUnstaging    = "unstaging"
	// phaseStageRefused: the plugin refused the last NodeStageVolume with
	// a final code (see stageRefused), so it holds no stage it told the
	// driver of. Nothing is re-issued for it: recovery leaves it alone
	// while the volume's live tasks keep their mounts, the next setup of
	// the volume stages it with that request's secrets, and the last
	// teardown still sends NodeUnstageVolume (no secrets, idempotent for
	// the plugin) for whatever the plugin or a stage before it left at
	// the staging path. It needs no secrets (needsSecrets).
	phaseStageRefused = "refused"
)

// volKey identifies a volume on this node by value.
type volKey struct{ plugin, volume string }

func (k volKey) String() string { return k.plugin + "\x00" + k.volume }

// volRecord is the journal entry of one volume on this node: its
// controller-publish and stage state, shared by every task using it. It
// holds no count of users: that is the number of task records naming it.
type volRecord struct {
	Version        int               `json:"version"`
	PluginID       string            `json:"plugin_id"`
	VolumeID       string            `json:"volume_id"`
	StagingPath    string            `json:"staging_path"`
	NodeID         string            `json:"node_id,omitempty"`
	AccessMode     string            `json:"access_mode"`
	AttachmentMode string            `json:"attachment_mode"`
	FSType         string            `json:"fs_type,omitempty"`
	MountFlags     []string          `json:"mount_flags,omitempty"`
	VolumeContext  map[string]string `json:"volume_context,omitempty"`
	PublishContext map[string]string `json:"publish_context,omitempty"`
	Secrets        map[string]string `json:"secrets,omitempty"`
	// HadSecrets says the volume was set up with secrets: once they are
	// dropped (the log keeps them only while a call needs them, a new
	// process has none), a call that needs them again (a repair's stage
	// or publish) is refused rather than made without them.
	HadSecrets bool `json:"had_secrets,omitempty"`
	// Controller is "", publishing, published or unpublishing.
	Controller string `json:"controller,omitempty"`
	// Stage is "", staging, staged, refused or unstaging.
	Stage string `json:"stage,omitempty"`
	// Server is PluginInfo.Server when the volume was set up: who served
	// the plugin id. Records written before it was kept have none; the
	// next Setup of the volume fills it in.
	Server string `json:"server,omitempty"`
	// MountGroup is the volume_mount_group sent to NodeStageVolume (see
	// VolumeRequest.MountGroup); a restage sends it again.
	MountGroup string `json:"mount_group,omitempty"`
	// Namespace is the Nomad namespace that claimed the volume with this
	// record, when no namespace owned it yet: its claim until a publish
	// of the volume succeeds, when an ownerRecord makes it lasting. It
	// goes with the record: a setup that failed and released the volume
	// leaves no claim behind (see ownerRecord).
	Namespace string    `json:"namespace,omitempty"`
	Updated   time.Time `json:"updated"`
}

func (v volRecord) key() volKey { return volKey{v.PluginID, v.VolumeID} }

// needsSecrets reports whether a call that takes secrets may still be
// made from the record: a ControllerPublishVolume or NodeStageVolume that
// recovery re-issues, or the ControllerUnpublishVolume of an attached
// volume. NodeUnstageVolume takes none. A record that needs none is
// written without them (journalOp.forDisk), so that secrets stay on disk
// only as long as a call needs them.
//
// Which outcome of NodeStageVolume keeps them: one whose outcome is
// unknown leaves the record staging, with its secrets, as the call left
// it: an attempt that ran out of time, a plugin gone or busy until the
// retries ran out, a call given up when its context ended, an answer
// without a status. The plugin may have staged the volume, and recovery
// settles it by staging again, which needs them. A final answer
// (stageRefused) makes the record refused at once, without them: the
// plugin said it did not stage, and what is owed then is only the
// NodeUnstageVolume of the last teardown. A refusal the plugin did not
// mean (it staged and answered an error) is still unstaged then; only
// recovery does not stage it again for the live tasks, which keep their
// mounts.
//
// Controller keeps them in every phase but none: a ControllerPublishVolume
// refused leaves the record publishing, since the ControllerUnpublishVolume
// that undoes it (at once, in the failed setup's rollback) takes them, and
// a refusal such as ALREADY_EXISTS says that an attachment to this node
// exists.
func (v volRecord) needsSecrets() bool {
	return v.Controller != phaseNone || v.Stage == phaseStaging
}

// stagingTarget is the staging_target_path the node calls after
// NodeStageVolume send (NodePublishVolume, NodeExpandVolume,
// NodeGetVolumeStats): the staging path of a staged volume, and none
// otherwise. Not of a refused one: the plugin said it holds no stage
// there, and its tasks' mounts are from a stage before the refusal.
func (v volRecord) stagingTarget() string {
	if v.Stage == phaseStaged {
		return v.StagingPath
	}
	return ""
}

// diskSecrets are the secrets the log holds for the record.
func (v volRecord) diskSecrets() map[string]string {
	if v.needsSecrets() {
		return v.Secrets
	}
	return nil
}

// taskRecord is the journal entry of one volume of one task: its publish
// state at Target. ReadOnly is the task's view of the volume (its bind);
// the publish is read-only with it but for single-node-writer
// (publishReadOnly).
type taskRecord struct {
	Version        int               `json:"version"`
	TaskID         string            `json:"task_id"`
	Name           string            `json:"name"`
	Seq            int               `json:"seq"`
	PluginID       string            `json:"plugin_id"`
	VolumeID       string            `json:"volume_id"`
	Target         string            `json:"target"`
	Destination    string            `json:"destination"`
	ReadOnly       bool              `json:"read_only"`
	AccessMode     string            `json:"access_mode"`
	AttachmentMode string            `json:"attachment_mode"`
	FSType         string            `json:"fs_type,omitempty"`
	MountFlags     []string          `json:"mount_flags,omitempty"`
	VolumeContext  map[string]string `json:"volume_context,omitempty"`
	Secrets        map[string]string `json:"secrets,omitempty"`
	// HadSecrets says the volume was set up with secrets: once they are
	// dropped (the log keeps them only while a call needs them, a new
	// process has none), a call that needs them again (a repair's stage
	// or publish) is refused rather than made without them.
	HadSecrets bool `json:"had_secrets,omitempty"`
	// MountGroup is the volume_mount_group sent to NodePublishVolume;
	// ApplyGroup the group the driver gives the volume's root after
	// publishing (VolumeRequest.ApplyMountGroup, plugin without
	// VOLUME_MOUNT_GROUP). At most one is set.
	MountGroup string `json:"mount_group,omitempty"`
	ApplyGroup string `json:"apply_group,omitempty"`
	// Unmounted says NodePublishVolume left no mount at the target (a
	// plugin that publishes a block volume by mknod(2) of its device
	// there; the CSI spec asks for a publish at target_path, not a
	// mount): the target is then not found dead for being no mount
	// (RepairStale), only for being gone or a symbolic link.
	Unmounted bool `json:"unmounted,omitempty"`
	// State is pending, publishing, published or unpublishing.
	State   string    `json:"state"`
	Updated time.Time `json:"updated"`
	// Invocation says the record was written by a driver that names each
	// task's state directory with an invocation file and lets this
	// record's commit, made before any call for the task, be that file's
	// flush (driver/invocations.go): a state directory of the task whose
	// file a crash of the host lost or cut is still this start's.
	// Records of older drivers lack it: their state directories held no
	// invocation file.
	Invocation bool `json:"invocation,omitempty"`
	// notCalled marks, in memory only, a record committed as publishing
	// ahead of its NodePublishVolume, with the first record of the
	// volume's setup, so that no other commit is needed before that call.
	// Until the call is made the durable record covers a crash (recovery
	// unpublishes, which is harmless), while this process, which knows
	// better, does not unpublish what it never published.
	notCalled bool
	// mustMount marks, in memory only, a record a repair publishes again
	// that was published with a mount: the plugin's OK that leaves none
	// this time is a failed repair, not a verdict that it never mounts
	// (see ensurePublished).
	mustMount bool
}

func (t taskRecord) key() volKey { return volKey{t.PluginID, t.VolumeID} }

// needsSecrets reports whether the NodePublishVolume of the record may
// still be made (or re-issued by recovery): once it is published, only
// NodeUnpublishVolume is left, which takes no secrets.
func (t taskRecord) needsSecrets() bool {
	return t.State == phasePending || t.State == phasePublishing
}

// diskSecrets are the secrets the log holds for the record.
func (t taskRecord) diskSecrets() map[string]string {
	if t.needsSecrets() {
		return t.Secrets
	}
	return nil
}

// createdRecord remembers what a plugin answered to CreateVolume: the id
// and context it gave the volume created under a name (a request's
// volume_id). Later requests for that name without a create block use
// them, so a job can name the volume as it created it. It is kept until
// the volume is deleted, which this package never does.
type createdRecord struct {
	Version       int               `json:"version"`
	PluginID      string            `json:"plugin_id"`
	Name          string            `json:"name"`
	VolumeID      string            `json:"volume_id"`
	VolumeContext map[string]string `json:"volume_context,omitempty"`
	// Requested is the create.capacity_min the volume was created or last
	// expanded with, Capacity the size the plugin answered (0: it did
	// not say), NodeExpand set while a NodeExpandVolume is owed after a
	// ControllerExpandVolume (see expand.go). Records written before they
	// were kept have none: such a volume is never expanded or shrunk by
	// a job until it is created again.
	Requested  int64     `json:"requested,omitempty"`
	Capacity   int64     `json:"capacity,omitempty"`
	NodeExpand bool      `json:"node_expand,omitempty"`
	Updated    time.Time `json:"updated"`
}

// ownerRecord says which Nomad namespace a volume of this node belongs to:
// the namespace of the job that created it here or first had it
// published. It is kept after the volume is released, as long as the
// journal, so that another namespace cannot take the volume's data once
// its owner stops.
//
// A namespace claims a volume nobody owns with the volume's record
// (volRecord.Namespace), in the batch that setup writes anyway before its
// first call, and the claim becomes this record in the lazy batch of the
// first successful NodePublishVolume: no commit of its own, and none more
// on the way to the task's start. A setup that fails claims nothing once
// its volume record is dropped, or a job could name another namespace's
// volume ids with calls bound to fail and have that namespace refused its
// own volumes here. The claim is on disk from before the first call until
// the record is dropped, and the record is dropped only after a synced
// commit of the teardown (NodeUnpublishVolume's "unpublishing"), which
// syncs the owner record written before it: a volume that was published
// never lacks an owner, crash or not. After a crash a task record that
// may have been published (any state but pending) with a claim and no
// owner record makes the claim an owner record (journalState.inferOwners),
// written with the next commit.
//
// Journals written before owners were recorded have none: each of their
// volumes is adopted by the first namespace that uses it after the
// upgrade.
type ownerRecord struct {
	Version   int       `json:"version"`
	PluginID  string    `json:"plugin_id"`
	VolumeID  string    `json:"volume_id"`
	Namespace string    `json:"namespace"`
	Updated   time.Time `json:"updated"`
}

// The journal's records live in one append-only log, journal.log in the
// journal directory, whose file format (frames, checksums, preallocation,
// lazy sync, compaction) is package wal's. Each commit is one frame whose
// payload is JSON, {"ops": [...]}, each op one of put_vol, drop_vol,
// put_task, drop_task, put_created, drop_created or put_owner; puts carry
// the whole record, drops its key. New fields and ops were added without
// changing journalVersion: records without them still replay (see
// ownerRecord and volRecord.Server). JSON never holds the byte 0xff, the
// first byte of a frame, as wal requires of its payloads.
const logName = wal.Name

// Operations of a batch.
const (
	opPutVol      = "put_vol"
	opDropVol     = "drop_vol"
	opPutTask     = "put_task"
	opDropTask    = "drop_task"
	opPutCreated  = "put_created"
	opDropCreated = "drop_created"
	opPutOwner    = "put_owner"
)

// journalOp is one operation of a batch: a put carries the whole record,
// a drop the key of the record it removes.
type journalOp struct {
	Op       string         `json:"op"`
	Vol      *volRecord     `json:"vol,omitempty"`
	Task     *taskRecord    `json:"task,omitempty"`
	Created  *createdRecord `json:"created,omitempty"`
	Owner    *ownerRecord   `json:"owner,omitempty"`
	PluginID string         `json:"plugin_id,omitempty"`
	VolumeID string         `json:"volume_id,omitempty"`
	TaskID   string         `json:"task_id,omitempty"`
	Name     string         `json:"name,omitempty"`
}

func volPut(v volRecord) journalOp {
	v.Version, v.Updated = journalVersion, time.Now().UTC()
	return journalOp{Op: opPutVol, Vol: &v}
}

// forDisk is the op as the log holds it: without the secrets of a record
// that needs none any more (see volRecord.needsSecrets). The manager's
// records in memory keep them, to redact a plugin's messages and to stage
// again in this process.
func (o journalOp) forDisk() journalOp {
	switch {
	case o.Vol != nil && len(o.Vol.Secrets) > 0 && !o.Vol.needsSecrets():
		v := *o.Vol
		v.Secrets = nil
		o.Vol = &v
	case o.Task != nil && len(o.Task.Secrets) > 0 && !o.Task.needsSecrets():
		t := *o.Task
		t.Secrets = nil
		o.Task = &t
	}
	return o
}

func volDrop(k volKey) journalOp {
	return journalOp{Op: opDropVol, PluginID: k.plugin, VolumeID: k.volume}
}

func taskPut(t taskRecord) journalOp {
	t.Version, t.Updated = journalVersion, time.Now().UTC()
	return journalOp{Op: opPutTask, Task: &t}
}

func taskDrop(taskID, name string) journalOp {
	return journalOp{Op: opDropTask, TaskID: taskID, Name: name}
}

func createdPut(c createdRecord) journalOp {
	c.Version, c.Updated = journalVersion, time.Now().UTC()
	return journalOp{Op: opPutCreated, Created: &c}
}

func createdDrop(plugin, name string) journalOp {
	return journalOp{Op: opDropCreated, PluginID: plugin, Name: name}
}

func ownerPut(o ownerRecord) journalOp {
	o.Version, o.Updated = journalVersion, time.Now().UTC()
	return journalOp{Op: opPutOwner, Owner: &o}
}

// target names the record an op writes, for merging ops of one batch.
func (o journalOp) target() string {
	switch o.Op {
	case opPutVol:
		return "v\x00" + o.Vol.PluginID + "\x00" + o.Vol.VolumeID
	case opDropVol:
		return "v\x00" + o.PluginID + "\x00" + o.VolumeID
	case opPutTask:
		return "t\x00" + o.Task.TaskID + "\x00" + o.Task.Name
	case opDropTask:
		return "t\x00" + o.TaskID + "\x00" + o.Name
	case opPutCreated:
		return "c\x00" + o.Created.PluginID + "\x00" + o.Created.Name
	case opDropCreated:
		return "c\x00" + o.PluginID + "\x00" + o.Name
	case opPutOwner:
		return "o\x00" + o.Owner.PluginID + "\x00" + o.Owner.VolumeID
	}
	return ""
}

// check says what is wrong with an op read back from the log, if
// anything. Records of another version are not guessed at.
func (o journalOp) check() error {
	switch o.Op {
	case opPutVol:
		if o.Vol == nil {
			return errors.New("volume record missing")
		}
		return checkRecord(o.Vol.Version, o.Vol.PluginID, o.Vol.VolumeID)
	case opPutTask:
		if o.Task == nil {
			return errors.New("task record missing")
		}
		if err := checkRecord(o.Task.Version, o.Task.PluginID, o.Task.VolumeID); err != nil {
			return err
		}
		if o.Task.TaskID == "" || o.Task.Target == "" {
			return errors.New("task id or target missing")
		}
	case opPutCreated:
		if o.Created == nil {
			return errors.New("created record missing")
		}
		return checkCreated(*o.Created)
	case opPutOwner:
		if o.Owner == nil {
			return errors.New("owner record missing")
		}
		if err := checkRecord(o.Owner.Version, o.Owner.PluginID, o.Owner.VolumeID); err != nil {
			return err
		}
		if o.Owner.Namespace == "" {
			return errors.New("namespace missing")
		}
	case opDropVol:
		if o.PluginID == "" || o.VolumeID == "" {
			return errors.New("plugin or volume id missing")
		}
	case opDropTask:
		if o.TaskID == "" || o.Name == "" {
			return errors.New("task id or name missing")
		}
	case opDropCreated:
		if o.PluginID == "" || o.Name == "" {
			return errors.New("plugin id or name missing")
		}
	default:
		return fmt.Errorf("unknown operation %q", o.Op)
	}
	return nil
}

// logAttrs are an op's ids for a log line; never its record, which holds
// secrets.
func (o journalOp) logAttrs() []any {
	plugin, volume, task, name := o.PluginID, o.VolumeID, o.TaskID, o.Name
	switch {
	case o.Vol != nil:
		plugin, volume = o.Vol.PluginID, o.Vol.VolumeID
	case o.Task != nil:
		plugin, volume, task, name = o.Task.PluginID, o.Task.VolumeID, o.Task.TaskID, o.Task.Name
	case o.Created != nil:
		plugin, volume, name = o.Created.PluginID, o.Created.VolumeID, o.Created.Name
	case o.Owner != nil:
		plugin, volume = o.Owner.PluginID, o.Owner.VolumeID
	}
	return []any{"op", o.Op, "plugin_id", plugin, "volume_id", volume, "task_id", task, "name", name}
}

func (o journalOp) logPlugin() string { return o.logAttrs()[3].(string) }
func (o journalOp) logVolume() string { return o.logAttrs()[5].(string) }

func checkRecord(version int, plugin, volume string) error {
	if version != journalVersion {
		return fmt.Errorf("record version %d, want %d", version, journalVersion)
	}
	if plugin == "" || volume == "" {
		return errors.New("plugin or volume id missing")
	}
	return nil
}

func checkCreated(c createdRecord) error {
	if c.Version != journalVersion {
		return fmt.Errorf("record version %d, want %d", c.Version, journalVersion)
	}
	if c.PluginID == "" || c.Name == "" || c.VolumeID == "" {
		return errors.New("plugin id, name or volume id missing")
	}
	return nil
}

// merge keeps the last op of each record, in the order of those last
// ops: replaying the result gives the same records as replaying ops.
func merge(ops []journalOp) []journalOp {
	last := make(map[string]int, len(ops))
	for i, o := range ops {
		last[o.target()] = i
	}
	if len(last) == len(ops) {
		return ops
	}
	out := make([]journalOp, 0, len(last))
	for i, o := range ops {
		if last[o.target()] == i {
			out = append(out, o)
		}
	}
	return out
}

type createdKey struct{ plugin, name string }

// journalState is the live records: what replaying the log gives, and
// then what the commits since gave. It is the one copy of them: the
// Manager's vols and tasks are its maps. A record here is the whole
// record, with the secrets a call of this process may still need and the
// memory-only notCalled; the log holds its forDisk form (see snapshot).
type journalState struct {
	vols map[volKey]volRecord
	// tasks are by task id, then by volume name.
	tasks map[string]map[string]taskRecord
	// byVolume are the task records of each volume (taskRecord.key), by task
	// id and name: what a setup's sharing checks and a teardown's count
	// of a volume's users read, without a pass over every task record
	// (with hundreds of tasks, each start and stop paid one). putTask and
	// dropTask keep it; an edit of a record in place (markCalled,
	// dropUnneededSecrets) must not change its TaskID, Name, PluginID or
	// VolumeID. A slice, not a set: most volumes have one user, and a map
	// each cost 500 bytes a record.
	byVolume map[volKey][]taskRef
	created  map[createdKey]createdRecord
	owners   map[volKey]ownerRecord
	// owed are owner records made at start from claims a crash left
	// uncertain (inferOwners), in memory and not in the log yet: the next
	// commit writes them, before it can drop what they were made from,
	// and a compaction writes them with every other record.
	owed map[volKey]bool
	// dropped, when set, is told of each task record dropTask removes,
	// with the journal's lock held: what the manager keeps in memory
	// beside a record (its repair's state) leaves with it.
	dropped func(taskRef)
	// staleSecrets is set once a record whose disk form held secrets was
	// replaced by one whose disk form holds none (or other ones), or was
	// dropped: the log still holds secrets no live record does, until a
	// compaction rewrites it.
	staleSecrets bool
}

func newJournalState() *journalState {
	return &journalState{vols: map[volKey]volRecord{}, tasks: map[string]map[string]taskRecord{},
		byVolume: map[volKey][]taskRef{}, created: map[createdKey]createdRecord{}, owners: map[volKey]ownerRecord{},
		owed: map[volKey]bool{}}
}

// taskRef names a task record: its task id and volume name.
type taskRef struct{ taskID, name string }

func (t taskRecord) ref() taskRef { return taskRef{t.TaskID, t.Name} }

func (s *journalState) task(taskID, name string) taskRecord { return s.tasks[taskID][name] }

func (s *journalState) putTask(t taskRecord) {
	if s.tasks[t.TaskID] == nil {
		s.tasks[t.TaskID] = map[string]taskRecord{}
	}
	if old, ok := s.tasks[t.TaskID][t.Name]; ok {
		s.unindex(old)
	}
	s.tasks[t.TaskID][t.Name] = t
	s.byVolume[t.key()] = append(s.byVolume[t.key()], taskRef{t.TaskID, t.Name})
}

func (s *journalState) dropTask(taskID, name string) {
	old, ok := s.tasks[taskID][name]
	if !ok {
		return
	}
	s.unindex(old)
	if s.dropped != nil {
		s.dropped(taskRef{taskID, name})
	}
	delete(s.tasks[taskID], name)
	if len(s.tasks[taskID]) == 0 {
		delete(s.tasks, taskID)
	}
}

func (s *journalState) unindex(t taskRecord) {
	k := t.key()
	refs := slices.DeleteFunc(s.byVolume[k], func(r taskRef) bool { return r == taskRef{t.TaskID, t.Name} })
	if len(refs) == 0 {
		delete(s.byVolume, k)
	} else {
		s.byVolume[k] = refs
	}
}

// apply applies the ops of a commit: whole records, of which the log
// holds the forDisk form.
func (s *journalState) apply(ops ...journalOp) {
	for _, o := range ops {
		s.applyOp(o, false)
	}
}

// applyLogged applies an op read from the disk (a replay, a moved record
// file). Its records are as the disk holds them, with every secret it
// holds: a log written before records were kept without the secrets no
// call needs holds those too, until dropUnneededSecrets.
func (s *journalState) applyLogged(o journalOp) { s.applyOp(o, true) }

func (s *journalState) applyOp(o journalOp, logged bool) {
	volSecrets := func(v volRecord) map[string]string {
		if logged {
			return v.Secrets
		}
		return v.diskSecrets()
	}
	taskSecrets := func(t taskRecord) map[string]string {
		if logged {
			return t.Secrets
		}
		return t.diskSecrets()
	}
	switch o.Op {
	case opPutVol:
		s.replacesSecrets(volSecrets(s.vols[o.Vol.key()]), volSecrets(*o.Vol))
		s.vols[o.Vol.key()] = *o.Vol
	case opDropVol:
		s.replacesSecrets(volSecrets(s.vols[volKey{o.PluginID, o.VolumeID}]), nil)
		delete(s.vols, volKey{o.PluginID, o.VolumeID})
	case opPutTask:
		s.replacesSecrets(taskSecrets(s.task(o.Task.TaskID, o.Task.Name)), taskSecrets(*o.Task))
		s.putTask(*o.Task)
	case opDropTask:
		s.replacesSecrets(taskSecrets(s.task(o.TaskID, o.Name)), nil)
		s.dropTask(o.TaskID, o.Name)
	case opPutCreated:
		s.created[createdKey{o.Created.PluginID, o.Created.Name}] = *o.Created
	case opDropCreated:
		delete(s.created, createdKey{o.PluginID, o.Name})
	case opPutOwner:
		s.owners[volKey{o.Owner.PluginID, o.Owner.VolumeID}] = *o.Owner
		delete(s.owed, volKey{o.Owner.PluginID, o.Owner.VolumeID})
	}
}

// owner is the namespace a volume belongs to: its owner record's, or the
// claim of its volume record while no owner is recorded.
func (s *journalState) owner(k volKey) (string, bool) {
	if o, ok := s.owners[k]; ok {
		return o.Namespace, true
	}
	if v, ok := s.vols[k]; ok && v.Namespace != "" {
		return v.Namespace, true
	}
	return "", false
}

// confirmOwner returns the put of an owner record for the claim of a
// volume's record, once the volume was published, or for namespace (that
// of the publish) when the record has no claim: nothing when an owner is
// recorded or neither names a namespace.
func (s *journalState) confirmOwner(k volKey, namespace string) []journalOp {
	if _, owned := s.owners[k]; owned {
		return nil
	}
	if v, ok := s.vols[k]; ok && v.Namespace != "" {
		namespace = v.Namespace
	}
	if namespace == "" {
		return nil
	}
	return []journalOp{ownerPut(ownerRecord{PluginID: k.plugin, VolumeID: k.volume, Namespace: namespace})}
}

// inferOwners makes owner records, after a replay, of the claims of
// volumes whose publish a crash may have let through: a task record of
// the volume in any state but pending may have had NodePublishVolume
// succeed (and the task use the volume) while its "published", and the
// owner record with it, was not synced yet. It returns how many it made;
// they are owed to the log (see owed).
func (s *journalState) inferOwners() int {
	n := 0
	for k, refs := range s.byVolume {
		v, ok := s.vols[k]
		if _, owned := s.owners[k]; owned || !ok || v.Namespace == "" {
			continue
		}
		for _, r := range refs {
			if s.task(r.taskID, r.name).State != phasePending {
				s.owners[k] = ownerRecord{Version: journalVersion, PluginID: k.plugin, VolumeID: k.volume,
					Namespace: v.Namespace, Updated: time.Now().UTC()}
				s.owed[k] = true
				n++
				break
			}
		}
	}
	return n
}

// owedPuts returns the puts of the owner records owed to the log.
func (s *journalState) owedPuts() []journalOp {
	if len(s.owed) == 0 {
		return nil
	}
	ops := make([]journalOp, 0, len(s.owed))
	for k := range s.owed {
		ops = append(ops, ownerPut(s.owners[k]))
	}
	return ops
}

func (s *journalState) replacesSecrets(old, new map[string]string) {
	if len(old) > 0 && !maps.Equal(old, new) {
		s.staleSecrets = true
	}
}

// dropUnneededSecrets removes the secrets of records that need none any
// more (written before records were kept without them), and reports
// whether it removed any.
func (s *journalState) dropUnneededSecrets() bool {
	dropped := false
	for k, v := range s.vols {
		if len(v.Secrets) > 0 && !v.needsSecrets() {
			v.Secrets = nil
			s.vols[k] = v
			dropped = true
		}
	}
	for _, recs := range s.tasks {
		for name, t := range recs {
			if len(t.Secrets) > 0 && !t.needsSecrets() {
				t.Secrets = nil
				recs[name] = t
				dropped = true
			}
		}
	}
	if dropped {
		s.staleSecrets = true
	}
	return dropped
}

// snapshot returns a put of every live record as the log holds it
// (forDisk), in a stable order.
func (s *journalState) snapshot() []journalOp {
	ops := s.puts()
	sortPuts(ops)
	return ops
}

// puts returns a put of every live record as the log holds it (forDisk),
// each with a copy of its record, in no order.
func (s *journalState) puts() []journalOp {
	ops := make([]journalOp, 0, len(s.vols)+len(s.tasks)+len(s.created)+len(s.owners))
	for _, v := range s.vols {
		ops = append(ops, journalOp{Op: opPutVol, Vol: &v}.forDisk())
	}
	for _, recs := range s.tasks {
		for _, t := range recs {
			ops = append(ops, journalOp{Op: opPutTask, Task: &t}.forDisk())
		}
	}
	for _, c := range s.created {
		ops = append(ops, journalOp{Op: opPutCreated, Created: &c})
	}
	for _, o := range s.owners {
		ops = append(ops, journalOp{Op: opPutOwner, Owner: &o})
	}
	return ops
}

func sortPuts(ops []journalOp) {
	sort.Slice(ops, func(i, j int) bool { return ops[i].target() < ops[j].target() })
}

type frameBody struct {
	Ops []journalOp `json:"ops"`
}

// encodeBatch is the payload of a batch.
func encodeBatch(ops []journalOp) ([]byte, error) {
	payload, err := json.Marshal(frameBody{Ops: ops})
	if err != nil {
		return nil, fmt.Errorf("failed to encode journal batch: %w", err)
	}
	return payload, nil
}

// encodeFrame frames a batch.
func encodeFrame(ops []journalOp) ([]byte, error) {
	payload, err := encodeBatch(ops)
	if err != nil {
		return nil, err
	}
	return wal.EncodeFrame(payload)
}

// snapshotFrame is the size a frame of a snapshot grows to before the
// next record goes into a new frame.
const snapshotFrame = 1 << 20

// snapshotPayloads groups ops into batches of about snapshotFrame bytes,
// the payloads of a compaction's frames: a snapshot is never one frame
// too large to write or to read back, however many records there are. A
// record larger than snapshotFrame has a frame of its own; a record
// larger than wal.MaxFrame cannot be written.
func snapshotPayloads(ops []journalOp) ([][]byte, error) {
	var out [][]byte
	var payload []byte
	flush := func() {
		if len(payload) > 0 {
			out = append(out, append(payload, "]}"...))
			payload = nil
		}
	}
	for _, o := range ops {
		rec, err := json.Marshal(o)
		if err != nil {
			return nil, fmt.Errorf("failed to encode journal record: %w", err)
		}
		if len(rec)+len(`{"ops":[]}`) > wal.MaxFrame {
			return nil, fmt.Errorf("journal record of volume %q of CSI plugin %q is %d bytes, larger than the limit of %d",
				o.logVolume(), o.logPlugin(), len(rec), wal.MaxFrame)
		}
		if len(payload) > 0 && len(payload)+len(rec)+len("]}")+1 > snapshotFrame {
			flush()
		}
		if len(payload) == 0 {
			payload = append(payload, `{"ops":[`...)
		} else {
			payload = append(payload, ',')
		}
		payload = append(payload, rec...)
	}
	flush()
	return out, nil
}

// encodeSnapshot is the log a compaction of ops writes, without the zeros
// after it.
func encodeSnapshot(ops []journalOp) ([]byte, error) {
	payloads, err := snapshotPayloads(ops)
	if err != nil {
		return nil, err
	}
	var buf []byte
	for _, p := range payloads {
		buf = wal.AppendFrame(buf, p)
	}
	return buf, nil
}

// logScan is what reading a log gave.
type logScan struct {
	state *journalState
	// end is the offset after the last intact frame.
	end int
	// torn is how many bytes after end hold no intact frame: a batch a
	// crash interrupted (or damage at the very end, which cannot be told
	// apart from one).
	torn int
	// damaged counts bytes between intact frames that are not frames;
	// badOps counts ops of intact frames that could not be used.
	damaged, badOps int
}

// scanLog replays a log (see wal.ScanFrames): later records win, drops
// delete. Nothing is logged here but ops that cannot be used.
func scanLog(data []byte, logger hclog.Logger) logScan {
	s := logScan{state: newJournalState()}
	scan := wal.ScanFrames(data, func(payload []byte, off int) {
		s.badOps += s.state.replay(payload, off, logger)
	})
	s.end, s.torn, s.damaged = scan.End, scan.Torn, scan.Damaged
	return s
}

// replay applies the batch of one frame, at off in the log, and returns
// how many of its ops could not be used.
func (s *journalState) replay(payload []byte, off int, logger hclog.Logger) (bad int) {
	var body frameBody
	if err := json.Unmarshal(payload, &body); err != nil {
		logger.Error("journal batch cannot be decoded; its records are lost", "offset", off)
		return 1
	}
	for _, o := range body.Ops {
		if err := o.check(); err != nil {
			bad++
			logger.Error("journal record cannot be used; what it describes must be cleaned up by hand",
				append(o.logAttrs(), "error", err)...)
			continue
		}
		s.applyLogged(o)
	}
	return bad
}

// journal keeps the volume records of this node in memory and in the log,
// writing the log before memory. Its methods are safe for concurrent use;
// commits that arrive while one is being written go out together in the
// next write and fdatasync (see wal.Log).
type journal struct {
	dir    string
	logger hclog.Logger
	log    *wal.Log

	// mu guards state and migrated; the Manager shares it (Manager.mu),
	// as its records are state's. The log calls back into the journal
	// with its own lock held (wal.Options), which then takes mu: the
	// order is the log's lock, then mu, and nothing calls the log, or a
	// method of the journal, while holding mu.
	mu    *sync.Mutex
	state *journalState
	// migrated are the files of records moved in from the file-per-record
	// format, removed once the log holds them durably (after the first
	// compaction).
	migrated []string
}

// createTemp makes a compaction's new log; tests make it fail.
var createTemp = os.CreateTemp

// compactDelay is how long the log may keep what a compaction removes
// (above all secrets no record needs any more) after the commit that made
// it so; commits meanwhile share the one compaction.
var compactDelay = time.Second

// lazySyncDelay is how long a lazy commit may stay unsynced when no other
// commit syncs it first.
var lazySyncDelay = 200 * time.Millisecond

// openJournal opens the journal in dir: it replays the log and takes in
// records of the file-per-record format, without writing anything that
// needs free space (a full disk must not keep the journal from opening,
// and with it recovery). What the log holds that only a compaction
// removes (damage, moved records, secrets no record needs) is compacted
// away soon after; see wal.Open.
func openJournal(dir string, logger hclog.Logger) (*journal, error) {
	j := &journal{dir: dir, logger: logger, mu: new(sync.Mutex), state: newJournalState()}
	log, err := wal.Open(dir, wal.Options{
		Logger: logger,
		Replay: func(payload []byte, off int) int {
			j.mu.Lock()
			defer j.mu.Unlock()
			return j.state.replay(payload, off, logger)
		},
		Loaded:        j.loaded,
		Snapshot:      j.snapshot,
		Stale:         j.stale,
		Compacted:     j.compacted,
		CompactMin:    wal.DefaultCompactMin,
		CompactDelay:  compactDelay,
		LazySyncDelay: lazySyncDelay,
		CreateTemp:    func(dir, pattern string) (*os.File, error) { return createTemp(dir, pattern) },
	})
	if err != nil {
		return nil, err
	}
	j.log = log
	return j, nil
}

// loaded takes in the records of the file-per-record format, over what
// the log holds, and drops the secrets of records that need none any
// more. It asks for a compaction when the log holds what only one
// removes.
func (j *journal) loaded() (bool, error) {
	entries, err := os.ReadDir(j.dir)
	if err != nil {
		return false, fmt.Errorf("failed to read journal directory %q: %w", j.dir, err)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	migrated, err := j.migrate(entries)
	if err != nil {
		return false, err
	}
	j.migrated = migrated
	j.state.dropUnneededSecrets()
	inferred := j.state.inferOwners()
	if inferred > 0 {
		j.logger.Warn("volumes a crash left uncertain whether they were published keep the namespace that claimed them as owner",
			"volumes", inferred, "path", j.logPath())
	}
	return len(migrated) > 0 || j.state.staleSecrets || inferred > 0, nil
}

// snapshot is the payloads of a compaction: every live record. The
// records are copied under mu, which is the Manager's too, and sorted and
// encoded after it: the log's lock, held through a compaction, keeps commits out,
// and no record's maps are changed in place.
func (j *journal) snapshot() ([][]byte, error) {
	j.mu.Lock()
	ops := j.state.puts()
	j.mu.Unlock()
	sortPuts(ops)
	return snapshotPayloads(ops)
}

// stale reports whether the log holds secrets no record needs any more.
func (j *journal) stale() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.state.staleSecrets
}

// compacted is called once a compaction's log is durable: it no longer
// holds stale secrets, and the files of moved records can go.
func (j *journal) compacted() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.state.staleSecrets = false
	// The snapshot held them: every owed record came from the replay,
	// before the compaction began.
	clear(j.state.owed)
	if migrated := j.migrated; len(migrated) > 0 {
		path := j.logPath()
		j.migrated = nil
		for _, p := range migrated {
			if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				j.logger.Warn("cannot remove a journal record file after moving it into the log", "record", p, "path", path, "error", err)
			}
		}
		if err := wal.SyncDir(j.dir); err != nil {
			j.logger.Warn("cannot sync the journal directory after removing moved record files", "path", j.dir, "error", err)
		}
		j.logger.Info("moved journal records from one file each into the log", "records", len(migrated), "path", path)
	}
}

func (j *journal) close() { j.log.Close() }

func (j *journal) logPath() string { return filepath.Join(j.dir, logName) }

// commit appends ops as one batch and returns once it is durable: replayed
// after a crash, the batch is there entirely or not at all. Ops of the
// same record are merged, the last winning.
func (j *journal) commit(ops ...journalOp) error { return j.enqueue(false, ops) }

// commitLazy is commit without waiting for the disk: the batch is written
// (so it survives the driver, not a crash of the host) and synced with the
// next commit or within lazySyncDelay. It is for the result of a call whose
// "-ing" record was committed: if the host crashes before the result is
// synced, recovery finds the call uncertain and settles it by calling
// again, which the CSI spec makes safe.
func (j *journal) commitLazy(ops ...journalOp) error { return j.enqueue(true, ops) }

// The log gets the ops' forDisk form; the records take them whole, once
// the batch is written (synced unless lazy), before the commit returns.
//
// Owner records made at start and not in the log yet (journalState.owed)
// go out with the first commit, ahead of its ops: no commit drops the
// task or volume records they were made from before they are written.
func (j *journal) enqueue(lazy bool, ops []journalOp) error {
	if len(ops) == 0 {
		return nil
	}
	j.mu.Lock()
	owed := j.state.owedPuts()
	j.mu.Unlock()
	if len(owed) > 0 {
		ops = append(owed, ops...)
	}
	ops = merge(ops)
	disk := make([]journalOp, len(ops))
	for i, o := range ops {
		disk[i] = o.forDisk()
	}
	payload, err := encodeBatch(disk)
	if err != nil {
		return err
	}
	return j.log.Append(payload, lazy, func() {
		j.mu.Lock()
		defer j.mu.Unlock()
		j.state.apply(ops...)
	})
}

// created returns the record of a volume created under name, if any.
func (j *journal) created(plugin, name string) (createdRecord, bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	c, ok := j.state.created[createdKey{plugin, name}]
	return c, ok
}

// owner returns the namespace a volume belongs to, if one is recorded or
// has claimed the volume with its record.
func (j *journal) owner(plugin, volume string) (string, bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.state.owner(volKey{plugin, volume})
}

// confirmOwner returns the put that makes the claim of a volume's record,
// or else namespace, its owner record, if there is one to make
// (journalState.confirmOwner).
func (j *journal) confirmOwner(k volKey, namespace string) []journalOp {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.state.confirmOwner(k, namespace)
}

// records returns the live volume and task records.
func (j *journal) records() ([]volRecord, []taskRecord) {
	j.mu.Lock()
	defer j.mu.Unlock()
	vols := make([]volRecord, 0, len(j.state.vols))
	for _, v := range j.state.vols {
		vols = append(vols, v)
	}
	var tasks []taskRecord
	for _, recs := range j.state.tasks {
		for _, t := range recs {
			tasks = append(tasks, t)
		}
	}
	return vols, tasks
}
