package csihook

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"
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
	// Stage is "", staging, staged or unstaging.
	Stage string `json:"stage,omitempty"`
	// Server is PluginInfo.Server when the volume was set up: who served
	// the plugin id. Records written before it was kept have none; the
	// next Setup of the volume fills it in.
	Server string `json:"server,omitempty"`
	// MountGroup is the volume_mount_group sent to NodeStageVolume (see
	// VolumeRequest.MountGroup); a restage sends it again.
	MountGroup string    `json:"mount_group,omitempty"`
	Updated    time.Time `json:"updated"`
}

func (v volRecord) key() volKey { return volKey{v.PluginID, v.VolumeID} }

// needsSecrets reports whether a call that takes secrets may still be
// made from the record: a ControllerPublishVolume or NodeStageVolume that
// recovery re-issues, or the ControllerUnpublishVolume of an attached
// volume. NodeUnstageVolume takes none. A record that needs none is
// written without them (journalOp.forDisk), so that secrets stay on disk
// only as long as a call needs them.
func (v volRecord) needsSecrets() bool {
	return v.Controller != phaseNone || v.Stage == phaseStaging
}

// taskRecord is the journal entry of one volume of one task: its publish
// state at Target.
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
	// State is pending, publishing, published or unpublishing.
	State   string    `json:"state"`
	Updated time.Time `json:"updated"`
	// notCalled marks, in memory only, a record committed as publishing
	// ahead of its NodePublishVolume, with the first record of the
	// volume's setup, so that no other commit is needed before that call.
	// Until the call is made the durable record covers a crash (recovery
	// unpublishes, which is harmless), while this process, which knows
	// better, does not unpublish what it never published.
	notCalled bool
}

func (t taskRecord) key() volKey { return volKey{t.PluginID, t.VolumeID} }

// needsSecrets reports whether the NodePublishVolume of the record may
// still be made (or re-issued by recovery): once it is published, only
// NodeUnpublishVolume is left, which takes no secrets.
func (t taskRecord) needsSecrets() bool {
	return t.State == phasePending || t.State == phasePublishing
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
// the namespace of the job that created it here or first used it. It is
// kept after the volume is released, as long as the journal, so that
// another namespace cannot take the volume's data once its owner stops.
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

// The journal is one append-only log, journal.log in the journal
// directory. Each commit appends one frame holding a batch of operations
// and is made durable with fdatasync before it returns:
//
//	magic "\xffCSJ" | length uint32 LE | CRC-32C uint32 LE | payload
//
// The CRC covers the magic, the length and the payload, so a frame is
// whole or it is not a frame: a batch is replayed entirely or not at all.
// The payload is JSON, {"ops": [...]}, each op one of put_vol, drop_vol,
// put_task, drop_task, put_created, drop_created or put_owner; puts carry
// the whole record, drops its key. New fields and ops were added without
// changing journalVersion: records without them still replay (see
// ownerRecord and volRecord.Server). JSON never holds the byte 0xff, so the magic
// cannot occur inside a payload and a scan for it finds frame starts only.
//
// The file is kept longer than the log, zero-filled: a commit then
// overwrites zeros, and its fdatasync has no file size to write, which
// on ext4 saves a journal commit. Zeros are where the log ends; a frame
// never starts with one.
const (
	logName     = "journal.log"
	frameMagic  = "\xffCSJ"
	frameHeader = 12
	// maxFrame bounds a frame's length, so a damaged length field is
	// recognised as damage rather than read as a huge frame.
	maxFrame = 64 << 20
	// defaultCompactMin is the log size below which the log is never
	// compacted; above it, it is compacted once it is twice the size of
	// the live records.
	defaultCompactMin = 1 << 20
	// preallocate is the step in which the file grows ahead of the log.
	preallocate = 256 << 10
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

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

type taskKey struct{ taskID, name string }

type createdKey struct{ plugin, name string }

// journalState is the live records: what replaying the log gives.
type journalState struct {
	vols    map[volKey]volRecord
	tasks   map[taskKey]taskRecord
	created map[createdKey]createdRecord
	owners  map[volKey]ownerRecord
	// staleSecrets is set once a record holding secrets was replaced by
	// one without them (or other ones) or dropped: the log still holds
	// secrets no live record does, until a compaction rewrites it.
	staleSecrets bool
}

func newJournalState() *journalState {
	return &journalState{vols: map[volKey]volRecord{}, tasks: map[taskKey]taskRecord{}, created: map[createdKey]createdRecord{},
		owners: map[volKey]ownerRecord{}}
}

func (s *journalState) apply(ops ...journalOp) {
	for _, o := range ops {
		switch o.Op {
		case opPutVol:
			s.replacesSecrets(s.vols[o.Vol.key()].Secrets, o.Vol.Secrets)
			s.vols[o.Vol.key()] = *o.Vol
		case opDropVol:
			s.replacesSecrets(s.vols[volKey{o.PluginID, o.VolumeID}].Secrets, nil)
			delete(s.vols, volKey{o.PluginID, o.VolumeID})
		case opPutTask:
			s.replacesSecrets(s.tasks[taskKey{o.Task.TaskID, o.Task.Name}].Secrets, o.Task.Secrets)
			s.tasks[taskKey{o.Task.TaskID, o.Task.Name}] = *o.Task
		case opDropTask:
			s.replacesSecrets(s.tasks[taskKey{o.TaskID, o.Name}].Secrets, nil)
			delete(s.tasks, taskKey{o.TaskID, o.Name})
		case opPutCreated:
			s.created[createdKey{o.Created.PluginID, o.Created.Name}] = *o.Created
		case opDropCreated:
			delete(s.created, createdKey{o.PluginID, o.Name})
		case opPutOwner:
			s.owners[volKey{o.Owner.PluginID, o.Owner.VolumeID}] = *o.Owner
		}
	}
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
	for k, t := range s.tasks {
		if len(t.Secrets) > 0 && !t.needsSecrets() {
			t.Secrets = nil
			s.tasks[k] = t
			dropped = true
		}
	}
	if dropped {
		s.staleSecrets = true
	}
	return dropped
}

// snapshot returns a put of every live record, in a stable order.
func (s *journalState) snapshot() []journalOp {
	ops := make([]journalOp, 0, len(s.vols)+len(s.tasks)+len(s.created)+len(s.owners))
	for _, v := range s.vols {
		ops = append(ops, journalOp{Op: opPutVol, Vol: &v})
	}
	for _, t := range s.tasks {
		ops = append(ops, journalOp{Op: opPutTask, Task: &t})
	}
	for _, c := range s.created {
		ops = append(ops, journalOp{Op: opPutCreated, Created: &c})
	}
	for _, o := range s.owners {
		ops = append(ops, journalOp{Op: opPutOwner, Owner: &o})
	}
	sort.Slice(ops, func(i, j int) bool { return ops[i].target() < ops[j].target() })
	return ops
}

type frameBody struct {
	Ops []journalOp `json:"ops"`
}

// encodeFrame frames a batch.
func encodeFrame(ops []journalOp) ([]byte, error) {
	payload, err := json.Marshal(frameBody{Ops: ops})
	if err != nil {
		return nil, fmt.Errorf("failed to encode journal batch: %w", err)
	}
	if len(payload) > maxFrame {
		return nil, fmt.Errorf("journal batch of %d bytes is larger than the limit of %d", len(payload), maxFrame)
	}
	return appendFrame(make([]byte, 0, frameHeader+len(payload)), payload), nil
}

// appendFrame appends the frame of payload, at most maxFrame bytes, to
// buf.
func appendFrame(buf, payload []byte) []byte {
	start := len(buf)
	buf = append(buf, frameMagic...)
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(payload)))
	sum := crc32.Update(crc32.Checksum(buf[start:start+8], castagnoli), castagnoli, payload)
	buf = binary.LittleEndian.AppendUint32(buf, sum)
	return append(buf, payload...)
}

// snapshotFrame is the size a frame of a snapshot grows to before the
// next record goes into a new frame.
const snapshotFrame = 1 << 20

// encodeSnapshot frames ops as batches of about snapshotFrame bytes: a
// snapshot is never one frame too large to write or to read back, however
// many records there are. A record larger than snapshotFrame has a frame
// of its own; a record larger than maxFrame cannot be written.
func encodeSnapshot(ops []journalOp) ([]byte, error) {
	var buf, payload []byte
	flush := func() {
		if len(payload) > 0 {
			buf = appendFrame(buf, append(payload, "]}"...))
			payload = payload[:0]
		}
	}
	for _, o := range ops {
		rec, err := json.Marshal(o)
		if err != nil {
			return nil, fmt.Errorf("failed to encode journal record: %w", err)
		}
		if len(rec)+len(`{"ops":[]}`) > maxFrame {
			return nil, fmt.Errorf("journal record of volume %q of CSI plugin %q is %d bytes, larger than the limit of %d",
				o.logVolume(), o.logPlugin(), len(rec), maxFrame)
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
	return buf, nil
}

// readFrame returns the payload of the frame at off and the offset after
// it, or ok false when no whole, intact frame starts at off.
func readFrame(data []byte, off int) (payload []byte, next int, ok bool) {
	if len(data)-off < frameHeader || string(data[off:off+4]) != frameMagic {
		return nil, 0, false
	}
	n := binary.LittleEndian.Uint32(data[off+4:])
	if n > maxFrame || uint64(n) > uint64(len(data)-off-frameHeader) {
		return nil, 0, false
	}
	next = off + frameHeader + int(n)
	payload = data[off+frameHeader : next]
	sum := crc32.Update(crc32.Checksum(data[off:off+8], castagnoli), castagnoli, payload)
	if sum != binary.LittleEndian.Uint32(data[off+8:]) {
		return nil, 0, false
	}
	return payload, next, true
}

// nextFrame returns the offset of the first intact frame at or after
// off, or -1.
func nextFrame(data []byte, off int) int {
	for off < len(data) {
		i := bytes.Index(data[off:], []byte(frameMagic))
		if i < 0 {
			return -1
		}
		if _, _, ok := readFrame(data, off+i); ok {
			return off + i
		}
		off += i + 1
	}
	return -1
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

// scanLog replays a log: later records win, drops delete. The log ends
// where only zeros follow. A damaged frame followed by intact ones is
// skipped and counted, not taken for the end of the log: the frames after
// it are newer and describe what is mounted now. (A crash during one
// write of several batches can leave that too; those batches were never
// acknowledged and are of different volumes, so keeping the intact ones
// is safe.) Nothing is logged here but ops that cannot be used.
func scanLog(data []byte, logger hclog.Logger) logScan {
	s := logScan{state: newJournalState()}
	off := 0
	for off < len(data) {
		payload, next, ok := readFrame(data, off)
		if !ok {
			if allZero(data[off:]) {
				break
			}
			resume := nextFrame(data, off+1)
			if resume < 0 {
				s.torn = len(data) - off
				for s.torn > 0 && data[off+s.torn-1] == 0 {
					s.torn--
				}
				break
			}
			s.damaged += resume - off
			off = resume
			continue
		}
		off, s.end = next, next
		var body frameBody
		if err := json.Unmarshal(payload, &body); err != nil {
			s.badOps++
			logger.Error("journal batch cannot be decoded; its records are lost", "offset", off-len(payload)-frameHeader)
			continue
		}
		for _, o := range body.Ops {
			if err := o.check(); err != nil {
				s.badOps++
				logger.Error("journal record cannot be used; what it describes must be cleaned up by hand",
					append(o.logAttrs(), "error", err)...)
				continue
			}
			s.state.apply(o)
		}
	}
	return s
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// journal keeps the volume records of this node in memory and in the log,
// writing the log before memory. A lock file keeps a second driver off
// the same directory. Its methods are safe for concurrent use; commits
// that arrive while one is being written go out together in the next
// write and fdatasync.
type journal struct {
	dir    string
	logger hclog.Logger
	lock   *os.File

	mu    sync.Mutex
	state *journalState
	// f is the log, nil once closed; size is the log's length (durable
	// but for lazy commits, see unsynced), and alloc the file's, zeros
	// after size. The log is compacted once it grows past limit.
	f          *os.File
	size       int64
	alloc      int64
	limit      int64
	compactMin int64
	// queue holds the commits waiting for the one being written, while
	// writing is set.
	queue   []*pendingCommit
	writing bool
	// broken is set when a write may have reached the disk in part and
	// could not be cut off again: nothing more is written.
	broken error
	// unsynced is set while lazy commits are written but not yet synced;
	// flushing is set while a sync of them is scheduled.
	unsynced, flushing bool
	// batches and syncs count committed batches and fdatasyncs, for tests.
	batches, syncs int

	// cleanup is set while the log holds what only a compaction removes:
	// secrets no live record holds (state.staleSecrets), damaged bytes,
	// records moved in from the file-per-record format (migrated, whose
	// files are removed once the log holds them) or the rest of a torn
	// batch that could not be cut off. A compaction is then scheduled
	// (compactArmed) within compactDelay; one that fails leaves the log as
	// it is, in use, and is tried again after compactBackoff.
	cleanup        bool
	migrated       []string
	compactArmed   bool
	compactBackoff time.Duration
	// badCopy is set while a damaged log waits for its copy (*.bad): no
	// compaction drops the damaged bytes before it is made.
	badCopy bool
	// compactions counts compactions, for tests.
	compactions int
}

// createTemp makes a compaction's new log; tests make it fail.
var createTemp = os.CreateTemp

// compactDelay is how long the log may keep what a compaction removes
// (above all secrets no record needs any more) after the commit that made
// it so; commits meanwhile share the one compaction.
var compactDelay = time.Second

// maxCompactBackoff caps the wait before a failed cleanup compaction is
// tried again (on a full disk, say).
const maxCompactBackoff = time.Minute

// keepBadCopies is how many copies of a damaged log (*.bad) are kept, the
// newest; they hold secrets, so older ones are removed.
const keepBadCopies = 3

// lazySyncDelay is how long a lazy commit may stay unsynced when no other
// commit syncs it first.
var lazySyncDelay = 200 * time.Millisecond

type pendingCommit struct {
	frame []byte
	ops   []journalOp
	// lazy commits need not be durable before they return (see
	// commitLazy).
	lazy bool
	done chan error
}

func openJournal(dir string, logger hclog.Logger) (*journal, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create journal directory %q: %w", dir, err)
	}
	f, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("failed to open journal lock in %q: %w", dir, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("journal directory %q is in use by another volume manager: %w", dir, err)
	}
	j := &journal{dir: dir, logger: logger, lock: f, compactMin: defaultCompactMin}
	if err := j.load(); err != nil {
		j.close()
		return nil, err
	}
	return j, nil
}

func (j *journal) close() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.syncLazyLocked()
	if j.f != nil {
		j.f.Close()
		j.f = nil
	}
	if j.lock != nil {
		j.lock.Close()
		j.lock = nil
	}
}

func (j *journal) logPath() string { return filepath.Join(j.dir, logName) }

// load replays the log and takes in records of the file-per-record
// format, without writing anything that needs free space: a full disk
// must not keep the journal from opening, and with it recovery. Leftover
// temp files are removed. A torn tail is dropped with a warning and cut
// off (truncating needs no space). Damage before the tail is skipped with
// an error, and a copy of the log as it was is kept beside it (*.bad,
// mode 0600, the newest keepBadCopies), since what the lost records
// describe can no longer be undone automatically; when the copy cannot be
// made, the log is left as it is until it can. What the log holds that
// only a compaction removes (damage, moved records, secrets no record
// needs) is compacted away soon after, and a compaction that fails leaves
// the log in use as it is.
func (j *journal) load() error {
	entries, err := os.ReadDir(j.dir)
	if err != nil {
		return fmt.Errorf("failed to read journal directory %q: %w", j.dir, err)
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".tmp-") {
			os.Remove(filepath.Join(j.dir, e.Name()))
		}
	}
	path := j.logPath()
	data, err := os.ReadFile(path)
	created := errors.Is(err, fs.ErrNotExist)
	if err != nil && !created {
		return fmt.Errorf("failed to read journal %q: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("failed to open journal %q: %w", path, err)
	}
	j.f = f
	if created {
		// The first commit's fdatasync does not make the new name durable.
		if err := syncDir(j.dir); err != nil {
			return err
		}
	}
	scan := scanLog(data, j.logger)
	j.state = scan.state
	j.size, j.alloc = int64(scan.end), int64(len(data))
	if scan.torn > 0 {
		j.logger.Warn("journal ends in a partly written batch, as after a crash during a write; dropped it",
			"path", path, "offset", scan.end, "bytes", scan.torn)
		if err := f.Truncate(j.size); err != nil {
			// Commits overwrite it; until then the next start drops it again.
			j.logger.Warn("cannot cut the partly written batch off the journal; later commits overwrite it",
				"path", path, "error", err)
			j.cleanup = true
		} else {
			j.alloc = j.size
		}
	}
	if scan.damaged > 0 || scan.badOps > 0 {
		j.cleanup, j.badCopy = true, true
		copyPath, err := j.keepBadCopy(data)
		if err != nil {
			j.logger.Error("journal is damaged: records in the damaged parts are lost, what they describe must be cleaned up by hand; no copy of it could be kept yet, so it is left as it is",
				"path", path, "damaged_bytes", scan.damaged, "unusable_records", scan.badOps, "error", err)
		} else {
			j.logger.Error("journal is damaged: records in the damaged parts are lost, what they describe must be cleaned up by hand; a copy of it as it was is kept (mode 0600, it holds secrets)",
				"path", path, "copy", copyPath, "damaged_bytes", scan.damaged, "unusable_records", scan.badOps)
		}
	}
	migrated, err := j.migrate(entries)
	if err != nil {
		return err
	}
	j.migrated = migrated
	j.state.dropUnneededSecrets()
	j.cleanup = j.cleanup || len(migrated) > 0 || j.state.staleSecrets
	// Compacted once it grows past compactMin; the first compaction sets
	// the limit from the live records.
	j.limit = j.compactMin
	if j.cleanup {
		j.mu.Lock()
		j.scheduleCompactLocked(0)
		j.mu.Unlock()
	}
	return nil
}

// keepBadCopy keeps a copy of a damaged log, data, beside it
// (journal.log.<time>.bad, mode 0600), removes all but the newest
// keepBadCopies copies, and returns the copy's path.
func (j *journal) keepBadCopy(data []byte) (string, error) {
	path := j.logPath()
	bad := path + "." + time.Now().UTC().Format("20060102T150405.000000000Z") + ".bad"
	if err := writeFileSync(bad, bytes.TrimRight(data, "\x00")); err != nil {
		os.Remove(bad)
		return "", fmt.Errorf("failed to keep a copy of damaged journal %q: %w", path, err)
	}
	j.badCopy = false
	copies, err := filepath.Glob(path + ".*.bad")
	if err != nil || len(copies) <= keepBadCopies {
		return bad, nil
	}
	// The time in the name sorts as it reads.
	sort.Strings(copies)
	old := copies[:len(copies)-keepBadCopies]
	for _, c := range old {
		if err := os.Remove(c); err != nil && !errors.Is(err, fs.ErrNotExist) {
			j.logger.Warn("cannot remove an old copy of a damaged journal", "copy", c, "error", err)
		}
	}
	j.logger.Info("removed old copies of a damaged journal; the newest are kept", "removed", old,
		"kept", copies[len(copies)-keepBadCopies:])
	return bad, nil
}

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

func (j *journal) enqueue(lazy bool, ops []journalOp) error {
	if len(ops) == 0 {
		return nil
	}
	ops = merge(ops)
	disk := make([]journalOp, len(ops))
	for i, o := range ops {
		disk[i] = o.forDisk()
	}
	ops = disk
	frame, err := encodeFrame(ops)
	if err != nil {
		return err
	}
	c := &pendingCommit{frame: frame, ops: ops, lazy: lazy, done: make(chan error, 1)}
	j.mu.Lock()
	if err := j.usableLocked(); err != nil {
		j.mu.Unlock()
		return err
	}
	j.queue = append(j.queue, c)
	if !j.writing {
		j.writing = true
		j.writeQueueLocked()
		j.writing = false
	}
	j.mu.Unlock()
	return <-c.done
}

func (j *journal) usableLocked() error {
	switch {
	case j.f == nil:
		return fmt.Errorf("journal %q is closed", j.logPath())
	case j.broken != nil:
		return j.broken
	}
	return nil
}

// writeQueueLocked writes the queued commits, each round in one write and
// one fdatasync, until no commit is waiting. j.mu is held on entry and
// exit and released while writing, so commits arriving meanwhile queue up
// for the next round.
func (j *journal) writeQueueLocked() {
	for len(j.queue) > 0 {
		q := j.queue
		j.queue = nil
		err := j.usableLocked()
		if err == nil {
			var buf []byte
			sync := false
			for _, c := range q {
				buf = append(buf, c.frame...)
				sync = sync || !c.lazy
			}
			n, f, off := int64(len(buf)), j.f, j.size
			if grow := off + n - j.alloc; grow > 0 {
				// Past the zeros: grow the file by whole steps of
				// zeros in the same write.
				buf = append(buf, make([]byte, roundUp(grow, preallocate)-grow)...)
			}
			j.mu.Unlock()
			err = writeLog(f, off, buf, sync)
			j.mu.Lock()
			if err == nil {
				j.size += n
				j.alloc = max(j.alloc, off+int64(len(buf)))
				j.batches += len(q)
				for _, c := range q {
					j.state.apply(c.ops...)
				}
				if sync {
					// fdatasync covers the lazy writes before it too.
					j.syncs++
					j.unsynced = false
				} else {
					j.unsynced = true
					j.scheduleSyncLocked()
				}
			} else {
				j.failedLocked(f, off, err)
			}
		}
		for _, c := range q {
			c.done <- err
		}
		if err == nil && j.size > j.limit {
			if err := j.compactLocked(); err != nil {
				j.limit = 2 * j.size
				j.logger.Warn("failed to compact the journal; it goes on growing", "path", j.logPath(), "error", err)
			}
		}
		if err == nil && j.state.staleSecrets {
			// The log holds secrets no record needs any more.
			j.cleanup = true
			j.scheduleCompactLocked(compactDelay)
		}
	}
}

type syncError struct{ err error }

func (e *syncError) Error() string { return e.err.Error() }
func (e *syncError) Unwrap() error { return e.err }

func roundUp(n, step int64) int64 { return (n + step - 1) / step * step }

// writeLog writes buf at off, and with sync makes it (and every write
// before it) durable.
func writeLog(f *os.File, off int64, buf []byte, sync bool) error {
	if _, err := f.WriteAt(buf, off); err != nil {
		return fmt.Errorf("failed to write journal %q: %w", f.Name(), err)
	}
	if !sync {
		return nil
	}
	if err := fdatasync(f); err != nil {
		return &syncError{fmt.Errorf("failed to sync journal %q: %w", f.Name(), err)}
	}
	return nil
}

// scheduleSyncLocked makes sure unsynced lazy commits are synced within
// lazySyncDelay, if no commit syncs them first.
func (j *journal) scheduleSyncLocked() {
	if j.flushing {
		return
	}
	j.flushing = true
	time.AfterFunc(lazySyncDelay, func() {
		j.mu.Lock()
		defer j.mu.Unlock()
		j.flushing = false
		j.syncLazyLocked()
	})
}

// syncLazyLocked syncs the lazy commits written so far, unless a write is
// under way (whose writer then syncs or schedules again). A failed sync
// leaves nothing known of what reached the disk: the journal refuses
// writes from then on.
func (j *journal) syncLazyLocked() {
	if !j.unsynced || j.writing || j.usableLocked() != nil {
		return
	}
	f := j.f
	j.writing = true
	j.mu.Unlock()
	err := fdatasync(f)
	j.mu.Lock()
	j.writing = false
	if err != nil {
		j.failedLocked(f, j.size, &syncError{fmt.Errorf("failed to sync journal %q: %w", f.Name(), err)})
	} else {
		j.syncs++
		j.unsynced = false
	}
	// Commits that came meanwhile waited for this sync to end.
	if len(j.queue) > 0 {
		j.writing = true
		j.writeQueueLocked()
		j.writing = false
	}
}

func fdatasync(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.Fdatasync(int(fd)) }); err != nil {
		return err
	}
	return serr
}

// failedLocked deals with a failed write. The file is cut at the end of the
// log, so that no part of the batch is left for a later batch to follow
// (the zeros come back with the next write). After a failed fdatasync
// nothing is known of what reached the disk, nor after a cut that failed:
// the journal then refuses every further write, and a restart replays
// what the disk holds.
func (j *journal) failedLocked(f *os.File, off int64, err error) {
	var se *syncError
	if !errors.As(err, &se) {
		if terr := f.Truncate(off); terr == nil {
			j.alloc = off
			return
		}
	}
	j.broken = fmt.Errorf("journal %q refuses writes after a failed write (restart the driver to replay it): %w", j.logPath(), err)
	j.logger.Error("journal refuses writes after a failed write; restart the driver", "path", j.logPath(), "error", err)
}

// compactLocked writes the live records to a new log and renames it over
// the old one: temp file, fsync, rename, fsync of the directory. A crash
// leaves the old log or the new one, and so does a failure before the
// rename (a full disk, say): the old log stays in use as it was. A
// damaged log is copied first (see load). The caller holds j.mu and has
// set j.writing, or has the journal to itself.
func (j *journal) compactLocked() error {
	path := j.logPath()
	if j.badCopy {
		data, err := os.ReadFile(path)
		bad := ""
		if err == nil {
			bad, err = j.keepBadCopy(data)
		}
		if err != nil {
			return fmt.Errorf("failed to compact journal %q: %w", path, err)
		}
		j.logger.Error("kept a copy of the damaged journal before compacting it", "path", path, "copy", bad)
	}
	buf, err := encodeSnapshot(j.state.snapshot())
	if err != nil {
		return fmt.Errorf("failed to compact journal %q: %w", path, err)
	}
	size := int64(len(buf))
	buf = append(buf, make([]byte, roundUp(size+1, preallocate)-size)...)
	f, err := createTemp(j.dir, ".tmp-")
	if err != nil {
		return fmt.Errorf("failed to compact journal %q: %w", path, err)
	}
	tmp := f.Name()
	err = f.Chmod(0o600)
	if err == nil {
		_, err = f.Write(buf)
	}
	if err == nil {
		err = f.Sync()
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("failed to compact journal %q: %w", path, err)
	}
	// From the rename on, the new file is the log, whatever happens next.
	if j.f != nil {
		j.f.Close()
	}
	j.f, j.size, j.alloc = f, size, int64(len(buf))
	j.limit = max(j.compactMin, 2*j.size)
	// The new file is synced: lazy commits before it are durable.
	j.unsynced = false
	j.compactions++
	if err := syncDir(j.dir); err != nil {
		j.broken = fmt.Errorf("journal %q refuses writes after a failed compaction (restart the driver to replay it): %w", path, err)
		return err
	}
	j.state.staleSecrets, j.cleanup = false, false
	// Only once the log holds them durably do the old files go.
	if migrated := j.migrated; len(migrated) > 0 {
		j.migrated = nil
		for _, p := range migrated {
			if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				j.logger.Warn("cannot remove a journal record file after moving it into the log", "record", p, "path", path, "error", err)
			}
		}
		if err := syncDir(j.dir); err != nil {
			j.logger.Warn("cannot sync the journal directory after removing moved record files", "path", j.dir, "error", err)
		}
		j.logger.Info("moved journal records from one file each into the log", "records", len(migrated), "path", path)
	}
	return nil
}

// scheduleCompactLocked runs a cleanup compaction (see journal.cleanup)
// after delay, unless one is scheduled already.
func (j *journal) scheduleCompactLocked(delay time.Duration) {
	if j.compactArmed {
		return
	}
	j.compactArmed = true
	time.AfterFunc(delay, j.compactForCleanup)
}

func (j *journal) compactForCleanup() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.compactArmed = false
	if !j.cleanup || j.usableLocked() != nil {
		return
	}
	if j.writing {
		j.scheduleCompactLocked(max(compactDelay, 10*time.Millisecond))
		return
	}
	j.writing = true
	err := j.compactLocked()
	j.writing = false
	if err != nil {
		j.compactBackoff = min(max(2*j.compactBackoff, time.Second), maxCompactBackoff)
		j.logger.Warn("failed to compact the journal; the log stays in use as it is, compacting is tried again later",
			"path", j.logPath(), "retry_in", j.compactBackoff, "error", err)
		if j.usableLocked() == nil {
			j.scheduleCompactLocked(j.compactBackoff)
		}
	} else {
		j.compactBackoff = 0
	}
	// Commits that came meanwhile waited for the compaction to end.
	if len(j.queue) > 0 {
		j.writing = true
		j.writeQueueLocked()
		j.writing = false
	}
}

// created returns the record of a volume created under name, if any.
func (j *journal) created(plugin, name string) (createdRecord, bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	c, ok := j.state.created[createdKey{plugin, name}]
	return c, ok
}

// owner returns the namespace a volume belongs to, if it was recorded.
func (j *journal) owner(plugin, volume string) (string, bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	o, ok := j.state.owners[volKey{plugin, volume}]
	return o.Namespace, ok
}

// records returns the live volume and task records.
func (j *journal) records() ([]volRecord, []taskRecord) {
	j.mu.Lock()
	defer j.mu.Unlock()
	vols := make([]volRecord, 0, len(j.state.vols))
	for _, v := range j.state.vols {
		vols = append(vols, v)
	}
	tasks := make([]taskRecord, 0, len(j.state.tasks))
	for _, t := range j.state.tasks {
		tasks = append(tasks, t)
	}
	return vols, tasks
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("failed to sync journal directory %q: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("failed to sync journal directory %q: %w", dir, err)
	}
	return nil
}

// writeFileSync creates path (mode 0600) holding data, durably.
func writeFileSync(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = syncDir(filepath.Dir(path))
	}
	return err
}
