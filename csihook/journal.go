package csihook

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
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
	// Controller is "", publishing, published or unpublishing.
	Controller string `json:"controller,omitempty"`
	// Stage is "", staging, staged or unstaging.
	Stage   string    `json:"stage,omitempty"`
	Updated time.Time `json:"updated"`
}

func (v volRecord) key() volKey { return volKey{v.PluginID, v.VolumeID} }

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
	// State is pending, publishing, published or unpublishing.
	State   string    `json:"state"`
	Updated time.Time `json:"updated"`
}

func (t taskRecord) key() volKey { return volKey{t.PluginID, t.VolumeID} }
func (t taskRecord) block() bool { return t.AttachmentMode == AttachmentBlockDevice }

// shortHash is 16 hex characters of the SHA-256 of parts joined by NUL.
func shortHash(parts ...string) string {
	sum := sha256.Sum256([]byte(strings.Join(parts, "\x00")))
	return hex.EncodeToString(sum[:8])
}

// journal keeps one JSON file per volume on this node (v-<hash>.json) and
// one per volume of a task (t-<task hash>-<name hash>.json), each replaced
// atomically. A lock file keeps a second driver off the same directory.
type journal struct {
	dir  string
	lock *os.File
}

func openJournal(dir string) (*journal, error) {
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
	return &journal{dir: dir, lock: f}, nil
}

func (j *journal) close() {
	if j.lock != nil {
		j.lock.Close()
		j.lock = nil
	}
}

func (j *journal) volPath(k volKey) string {
	return filepath.Join(j.dir, "v-"+shortHash(k.plugin, k.volume)+".json")
}

func (j *journal) taskPath(taskID, name string) string {
	return filepath.Join(j.dir, "t-"+shortHash(taskID)+"-"+shortHash(name)+".json")
}

func (j *journal) putVol(v volRecord) error {
	v.Version, v.Updated = journalVersion, time.Now().UTC()
	return j.write(j.volPath(v.key()), v)
}

func (j *journal) putTask(t taskRecord) error {
	t.Version, t.Updated = journalVersion, time.Now().UTC()
	return j.write(j.taskPath(t.TaskID, t.Name), t)
}

func (j *journal) dropVol(k volKey) error { return j.remove(j.volPath(k)) }

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
	Updated       time.Time         `json:"updated"`
}

func (j *journal) createdPath(plugin, name string) string {
	return filepath.Join(j.dir, "c-"+shortHash(plugin, name)+".json")
}

func (j *journal) putCreated(c createdRecord) error {
	c.Version, c.Updated = journalVersion, time.Now().UTC()
	return j.write(j.createdPath(c.PluginID, c.Name), c)
}

// created reads the record of a volume created under name, if any.
func (j *journal) created(plugin, name string) (createdRecord, bool) {
	data, err := os.ReadFile(j.createdPath(plugin, name))
	if err != nil {
		return createdRecord{}, false
	}
	var c createdRecord
	if json.Unmarshal(data, &c) != nil || c.Version != journalVersion || c.PluginID != plugin || c.Name != name || c.VolumeID == "" {
		return createdRecord{}, false
	}
	return c, true
}

func (j *journal) dropTask(taskID, name string) error { return j.remove(j.taskPath(taskID, name)) }

// write replaces path with v's JSON: temp file, fsync, rename, fsync of
// the directory. A crash leaves either the old or the new record.
func (j *journal) write(path string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("failed to encode journal record %q: %w", path, err)
	}
	f, err := os.CreateTemp(j.dir, ".tmp-")
	if err != nil {
		return fmt.Errorf("failed to write journal record %q: %w", path, err)
	}
	tmp := f.Name()
	ok := false
	defer func() {
		if !ok {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if err := f.Chmod(0o600); err != nil {
		return fmt.Errorf("failed to write journal record %q: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("failed to write journal record %q: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("failed to sync journal record %q: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("failed to write journal record %q: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("failed to write journal record %q: %w", path, err)
	}
	ok = true
	return j.syncDir()
}

func (j *journal) remove(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("failed to remove journal record %q: %w", path, err)
	}
	return j.syncDir()
}

func (j *journal) syncDir() error {
	d, err := os.Open(j.dir)
	if err != nil {
		return fmt.Errorf("failed to sync journal directory %q: %w", j.dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("failed to sync journal directory %q: %w", j.dir, err)
	}
	return nil
}

// load reads every record. Leftover temp files are removed; records that
// cannot be read are renamed to *.bad and reported, since what they
// describe can no longer be undone automatically.
func (j *journal) load(logger hclog.Logger) ([]volRecord, []taskRecord, error) {
	entries, err := os.ReadDir(j.dir)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to read journal directory %q: %w", j.dir, err)
	}
	var (
		vols  []volRecord
		tasks []taskRecord
	)
	for _, e := range entries {
		name := e.Name()
		path := filepath.Join(j.dir, name)
		switch {
		case strings.HasPrefix(name, ".tmp-"):
			os.Remove(path)
			continue
		case !strings.HasSuffix(name, ".json"):
			continue
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, nil, fmt.Errorf("failed to read journal record %q: %w", path, err)
		}
		var bad error
		switch {
		case strings.HasPrefix(name, "v-"):
			var v volRecord
			if bad = json.Unmarshal(data, &v); bad == nil {
				if bad = checkRecord(v.Version, v.PluginID, v.VolumeID); bad == nil && j.volPath(v.key()) != path {
					bad = errors.New("file name does not match its plugin and volume")
				}
			}
			if bad == nil {
				vols = append(vols, v)
			}
		case strings.HasPrefix(name, "t-"):
			var t taskRecord
			if bad = json.Unmarshal(data, &t); bad == nil {
				if bad = checkRecord(t.Version, t.PluginID, t.VolumeID); bad == nil && (t.TaskID == "" || t.Target == "") {
					bad = errors.New("task id or target missing")
				}
			}
			if bad == nil {
				tasks = append(tasks, t)
			}
		default:
			continue
		}
		if bad != nil {
			logger.Error("unreadable journal record set aside; what it describes must be cleaned up by hand",
				"path", path, "error", bad)
			os.Rename(path, path+".bad")
		}
	}
	return vols, tasks, nil
}

func checkRecord(version int, plugin, volume string) error {
	if version != journalVersion {
		return fmt.Errorf("record version %d, want %d", version, journalVersion)
	}
	if plugin == "" || volume == "" {
		return errors.New("plugin or volume id missing")
	}
	return nil
}
