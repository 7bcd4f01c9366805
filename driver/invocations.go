package driver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/atomicfile"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// Files the driver keeps in a task's state directory, beside the
// executor's own.
const (
	// invocationFile names the Nomad task a state directory is for. It is
	// written before anything is started for the task, and synced, but
	// for a task with volumes: the first record of its volumes' journal,
	// committed before any call for them, names the task in its stead
	// (see writeInvocation).
	invocationFile = "invocation.json"
	// handedFile is written once StartTask hands the task's handle to
	// Nomad. Without it, Nomad has no handle for the task and will never
	// recover or destroy it.
	handedFile = "handed"
)

// invocation is the content of invocationFile. Nomad gives each start of a
// task (an invocation) its own task ID, made of the allocation ID, the task
// name and a random suffix.
type invocation struct {
	TaskID   string `json:"task_id"`
	AllocID  string `json:"alloc_id"`
	TaskName string `json:"task_name"`
	// PluginID is the id a CSI plugin task serves ("" for a workload):
	// a dangling plugin task is ended last, once nothing holds its
	// volumes (dangling.go).
	PluginID string `json:"plugin_id,omitempty"`
	// Agent is the Nomad agent process the task was last handed to, by
	// its start or its recovery (agentIdentity; "" when unknown, or
	// written before it was kept).
	Agent string `json:"agent,omitempty"`
}

func (iv invocation) slot() string { return iv.AllocID + "\x00" + iv.TaskName }

// invocations decides which task state directories are alive, by what
// Nomad and the supervisors tell:
//
//   - a task this driver process started or recovered is alive;
//   - a task ID a StartTask or a clean-up is working on is alive;
//   - a task an earlier driver process handed to Nomad is alive until Nomad
//     recovers it (it is then known), fails to (RecoverTask forgets it), or
//     starts the same task of the same allocation anew (Nomad runs one
//     invocation of a task at a time, so the earlier one is dead to it);
//   - a task whose start an earlier driver process never finished is dead:
//     Nomad got no handle for it. Its supervisor is killed and its volumes
//     are torn down.
type invocations struct {
	mu sync.Mutex
	// busy holds the task IDs a StartTask or a clean-up works on; the
	// channel is closed when it is done.
	busy map[string]chan struct{}
	// waiting holds the tasks an earlier driver process handed to Nomad
	// that Nomad has not taken back yet, by task ID.
	waiting map[string]invocation
	// cutShort holds the starts an earlier driver process never finished
	// and that are not ended yet, by task ID.
	cutShort map[string]invocation
	// dangling holds the handed-over tasks the dangling-task reconciler
	// ended because Nomad had not taken them back within its grace: a
	// RecoverTask that comes later fails, saying so.
	dangling map[string]bool
}

func newInvocations() *invocations {
	return &invocations{busy: map[string]chan struct{}{}, waiting: map[string]invocation{}, cutShort: map[string]invocation{}, dangling: map[string]bool{}}
}

// claim waits until no one else works on id, then holds it until release.
func (iv *invocations) claim(ctx context.Context, id string) (release func(), err error) {
	for {
		release, busy := iv.tryClaim(id)
		if release != nil {
			return release, nil
		}
		select {
		case <-busy:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// tryClaim holds id until release when no one else works on it; otherwise
// it returns a channel closed when the one who does is done.
func (iv *invocations) tryClaim(id string) (release func(), busy <-chan struct{}) {
	iv.mu.Lock()
	defer iv.mu.Unlock()
	if ch, ok := iv.busy[id]; ok {
		return nil, ch
	}
	done := make(chan struct{})
	iv.busy[id] = done
	return func() {
		iv.mu.Lock()
		delete(iv.busy, id)
		iv.mu.Unlock()
		close(done)
	}, nil
}

// alive reports whether id is worked on or waits for Nomad.
func (iv *invocations) alive(id string) bool {
	iv.mu.Lock()
	defer iv.mu.Unlock()
	_, busy := iv.busy[id]
	_, waiting := iv.waiting[id]
	return busy || waiting
}

// settled says Nomad took the task back, or gave it up.
func (iv *invocations) settled(id string) {
	iv.mu.Lock()
	defer iv.mu.Unlock()
	delete(iv.waiting, id)
}

// superseded returns the task IDs, other than cfg's, of earlier invocations
// of cfg's task that wait for Nomad or are not ended yet, and stops
// waiting for them: a new invocation means Nomad is done with them.
func (iv *invocations) superseded(cfg *drivers.TaskConfig) []string {
	slot := invocation{AllocID: cfg.AllocID, TaskName: cfg.Name}.slot()
	iv.mu.Lock()
	defer iv.mu.Unlock()
	var out []string
	for _, set := range []map[string]invocation{iv.waiting, iv.cutShort} {
		for id, inv := range set {
			if id != cfg.ID && inv.AllocID != "" && inv.slot() == slot {
				out = append(out, id)
				delete(iv.waiting, id)
			}
		}
	}
	sort.Strings(out)
	return out
}

// ended says a start cut short is ended.
func (iv *invocations) ended(id string) {
	iv.mu.Lock()
	defer iv.mu.Unlock()
	delete(iv.cutShort, id)
}

// scanTaskDirs reads the state directories an earlier driver process left:
// handed-over tasks wait for Nomad; the task IDs of starts that never
// finished are returned as orphans. A directory whose invocation file is
// missing or cut (a crash of the host lost it: a task with volumes does
// not sync it) is read as if the file named the task the volume journal in
// journalDir names it for. A directory from a driver version that wrote no
// invocation file, but started a supervisor, is taken as handed over, as
// that version did.
func (iv *invocations) scanTaskDirs(logger hclog.Logger, tasksDir, journalDir string) (orphans []string) {
	entries, err := os.ReadDir(tasksDir)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			logger.Warn("failed to read the task state directories", "path", tasksDir, "error", err)
		}
		return nil
	}
	// The journal is read once, and only when a directory needs it.
	var journaled map[string]string
	iv.mu.Lock()
	defer iv.mu.Unlock()
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		dir := filepath.Join(tasksDir, e.Name())
		var inv invocation
		b, err := os.ReadFile(filepath.Join(dir, invocationFile))
		if err == nil {
			err = json.Unmarshal(b, &inv)
		}
		if lostInvocation(err) {
			if journaled == nil {
				journaled = journalInvocations(logger, journalDir)
			}
			if id, ok := journaled[e.Name()]; ok {
				logger.Info("task state directory's invocation file was lost; its volumes' journal names the task", "path", dir, "task_id", id)
				inv, err = invocationOf(id), nil
			}
		}
		switch {
		case err == nil && inv.TaskID != "" && filepath.Base(dir) == csihook.ShortHash(inv.TaskID):
			if exists(filepath.Join(dir, handedFile)) {
				iv.waiting[inv.TaskID] = inv
			} else {
				iv.cutShort[inv.TaskID] = inv
				orphans = append(orphans, inv.TaskID)
			}
		case errors.Is(err, fs.ErrNotExist):
			// Written by a driver before invocation files: its task ID is
			// in the spec, if it started anything. Nomad decides, as it
			// did then.
			if id, serr := executor.StartedTaskID(dir); serr == nil && id != "" {
				iv.waiting[id] = invocation{TaskID: id}
				continue
			}
			logger.Warn("task state directory names no task; leaving it alone", "path", dir)
		default:
			// Nothing was started from it (the invocation file comes
			// first), or it is not ours to judge.
			logger.Warn("task state directory names no task; leaving it alone", "path", dir, "error", err)
		}
	}
	return orphans
}

// lostInvocation tells whether reading an invocation file failed as a
// crash of the host can leave one that was not synced: gone (its rename
// not on disk) or cut short (empty, part of it, or zeros). A whole file
// that names another task is not that.
func lostInvocation(err error) bool {
	var syntax *json.SyntaxError
	return errors.Is(err, fs.ErrNotExist) || errors.As(err, &syntax)
}

// journalInvocations maps the state directory names (csihook.ShortHash) of
// the tasks the volume journal in dir holds records of, written by a driver
// that lets those records name the task in place of its invocation file,
// to their task IDs. The journal is read without its lock: another driver
// process may hold it. What cannot be read names no task.
func journalInvocations(logger hclog.Logger, dir string) map[string]string {
	out := map[string]string{}
	st, err := csihook.ReadJournal(dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		logger.Warn("failed to read the volume journal for task state directories without an invocation file", "path", dir, "error", err)
	}
	for _, t := range st.Tasks {
		if t.Invocation {
			out[csihook.ShortHash(t.TaskID)] = t.TaskID
		}
	}
	return out
}

// invocationOf is the invocation a Nomad task ID names; one that names no
// allocation (csihook.SplitTaskID) names its task only, and is taken for
// no invocation of another task (superseded).
func invocationOf(id string) invocation {
	inv := invocation{TaskID: id}
	if alloc, task, _, ok := csihook.SplitTaskID(id); ok {
		inv.AllocID, inv.TaskName = alloc, task
	}
	return inv
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// writeInvocation makes the task's state directory and names the task in
// it, before anything is started. With sync unset the file is not synced:
// for a task with volumes, whose journal's first record (synced before any
// call for them, see csihook.taskRecord.Invocation) names the task should
// a crash of the host lose the file, so that a start flushes the disk once
// before its calls rather than twice. A start whose record never reached
// the disk called nothing.
func writeInvocation(dir string, cfg *drivers.TaskConfig, pluginID, agent string, sync bool) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("failed to create task state directory %q: %w", dir, err)
	}
	b, err := json.Marshal(invocation{TaskID: cfg.ID, AllocID: cfg.AllocID, TaskName: cfg.Name, PluginID: pluginID, Agent: agent})
	if err != nil {
		return err
	}
	if err := writeAtomic(filepath.Join(dir, invocationFile), b, 0o600, sync); err != nil {
		return fmt.Errorf("failed to write the task's invocation file: %w", err)
	}
	return nil
}

// restampInvocation records in the task's invocation file, when it has
// one, that agent recovered the task. Not synced: after a crash of the
// host no task runs, and the agent is a new one anyway. The handed mark,
// a hard link to the file as it was, stays a mark.
func restampInvocation(dir, agent string) error {
	path := filepath.Join(dir, invocationFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var inv invocation
	if err := json.Unmarshal(b, &inv); err != nil {
		return fmt.Errorf("failed to read %q: %w", path, err)
	}
	if inv.Agent == agent {
		return nil
	}
	inv.Agent = agent
	if b, err = json.Marshal(inv); err != nil {
		return err
	}
	return writeAtomic(path, b, 0o600, false)
}

// agentIdentity names the process that started this driver, the Nomad
// agent, by its PID and start time (a PID alone may be reused) and the
// boot (the start time counts from it, and an agent started by a host's
// boot may get the same PID and start time the next time); "" when it
// cannot be read.
func agentIdentity() string {
	ppid := os.Getppid()
	start, err := wire.ProcStartTime(ppid)
	if err != nil || ppid <= 1 {
		return ""
	}
	boot, err := bootID()
	if err != nil || boot == "" {
		return ""
	}
	return fmt.Sprintf("%d-%d-%s", ppid, start, boot)
}

// bootID reads the kernel's id of this boot; a variable for tests.
var bootID = func() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	return strings.TrimSpace(string(b)), err
}

// writeAtomic is atomicfile.Write; a variable for tests.
var writeAtomic = atomicfile.Write

// markHanded records that Nomad gets the task's handle: handedFile, a
// hard link to the task's invocation file. link(2) makes a name, nothing
// else (no inode, no data), where a file of its own was a create, a write
// and a rename, about 0.5 ms of every start on an ext4 root_dir. Not
// synced: it is written after the task runs, on the way to StartTask's
// answer, and the mark matters only while the host is up (it tells a
// later driver process whether Nomad may still recover the task; after a
// crash of the host no task is alive, and a start without the mark is
// ended just as Nomad's recovery of it would fail). The invocation file,
// written before anything starts, is synced (or, for a task with volumes,
// named by its journal's first record). A root_dir on a file system
// without hard links (EPERM, as vfat and some FUSE file systems answer)
// gets an empty file of its own instead. A mark already there stands.
func markHanded(dir string) error {
	mark := filepath.Join(dir, handedFile)
	err := linkFile(filepath.Join(dir, invocationFile), mark)
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EOPNOTSUPP) {
		var f *os.File
		if f, err = os.OpenFile(mark, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600); err == nil {
			err = f.Close()
		}
	}
	if err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("failed to record the task's start: %w", err)
	}
	return nil
}

// linkFile is os.Link; a variable for tests.
var linkFile = os.Link

// unmarkHanded takes the mark back from a start that fails after it.
func unmarkHanded(dir string) {
	_ = os.Remove(filepath.Join(dir, handedFile))
}

// discardInvocation ends a task Nomad will never recover or destroy: its
// supervisor and processes are killed and its state directory removed.
// With volumes, its volumes are torn down too (retried in the background
// when the plugin cannot answer now; the error says so): only for a task ID
// that is never used again, since that retry tears down whatever the ID
// holds then. The caller holds the task ID.
func (d *Driver) discardInvocation(conf *Config, taskID string, volumes bool) error {
	logger := d.logger.With("task_id", taskID)
	if err := d.discard(d.logger, conf.taskStateDir(taskID)); err != nil {
		return err
	}
	if volumes {
		if err := d.teardownVolumes(taskID); err != nil {
			return err
		}
	}
	logger.Info("ended a task Nomad has no handle for")
	return nil
}

// discardOrphans ends the starts an earlier driver process never finished,
// but those a StartTask of this process works on (Nomad retries a start
// with the same task ID when the driver died during it): that StartTask
// ends them itself. Their volumes are left to recoverVolumes, which tears
// down those of tasks that are not alive when it gets to them: Nomad may
// retry the start with the same ID meanwhile, and its volumes are then
// the new start's.
func (d *Driver) discardOrphans(conf *Config, orphans []string) {
	for _, id := range orphans {
		release, _ := d.invocations.tryClaim(id)
		if release == nil {
			continue
		}
		if _, known := d.tasks.Get(id); !known {
			if err := d.discardInvocation(conf, id, false); err != nil {
				d.logger.Warn("failed to end a task whose start was cut short", "task_id", id, "error", err)
			}
		}
		d.invocations.ended(id)
		release()
	}
}

// endEarlierInvocations ends what earlier starts of cfg's task left that
// Nomad will never recover: a start with this very task ID (Nomad retries a
// start with the same ID when the driver died during it, and that start's
// supervisor may run), and earlier invocations of the same task of the
// same allocation handed to an earlier driver process (Nomad starts a task
// anew only once it is done with the last one). Their processes are
// killed before this start runs anything, so two instances never share a
// volume; their volumes are torn down first too, or, when that cannot be
// done now, a task with volumes of its own is refused with the reason.
func (d *Driver) endEarlierInvocations(logger hclog.Logger, conf *Config, cfg *drivers.TaskConfig, hasVolumes bool) error {
	ids := d.invocations.superseded(cfg)
	ids = append(ids, d.earlierInJournal(cfg, ids)...)
	if exists(conf.taskStateDir(cfg.ID)) {
		d.invocations.settled(cfg.ID)
		ids = append(ids, cfg.ID)
	}
	for _, id := range ids {
		if id != cfg.ID {
			release, err := d.invocations.claim(d.ctx, id)
			if err != nil {
				return errors.New("the csi driver is shutting down")
			}
			defer release()
			if _, ok := d.tasks.Get(id); ok {
				continue
			}
		}
		logger.Info("ending an earlier start of the task that Nomad has no handle for", "earlier_task_id", id)
		// Volumes of the same task ID are this start's to take over
		// (setting a volume up again is idempotent); an older ID's go.
		err := d.discardInvocation(conf, id, id != cfg.ID)
		if err == nil {
			continue
		}
		if exists(conf.taskStateDir(id)) {
			return fmt.Errorf("failed to end an earlier start of this task (task ID %q), so it is not started twice: %w", id, err)
		}
		if hasVolumes {
			return fmt.Errorf("an earlier start of this task (task ID %q) still holds volumes: %w", id, err)
		}
		logger.Warn("volumes of an earlier start of the task not torn down yet", "earlier_task_id", id, "error", err)
	}
	return nil
}

// earlierInJournal lists the earlier invocations of cfg's task, but those
// in known, that the journal still holds volumes for: another driver
// process (Nomad's plugin loader ran one at agent start, before it only
// validated) may have ended such an invocation and removed its state
// directory, its volumes waiting for a background retry, and a
// single-node-writer volume would refuse this start until then. Ending
// them as the others are releases their volumes now (Discard of a state
// directory that is gone only returns).
func (d *Driver) earlierInJournal(cfg *drivers.TaskConfig, known []string) []string {
	m, err := d.volumes()
	if err != nil {
		// Without the journal nothing is set up either; the setup says so.
		return nil
	}
	var out []string
	for _, id := range m.TasksWithPrefix(cfg.AllocID + "/" + cfg.Name + "/") {
		if id != cfg.ID && sameTask(id, cfg) && !slices.Contains(known, id) {
			out = append(out, id)
		}
	}
	return out
}

// sameTask tells whether a Nomad task ID names an invocation of cfg's task
// of cfg's allocation (csihook.SplitTaskID).
func sameTask(id string, cfg *drivers.TaskConfig) bool {
	alloc, task, _, ok := csihook.SplitTaskID(id)
	return ok && alloc == cfg.AllocID && task == cfg.Name
}

// TaskDirs is what the task state directories under a root_dir say of the
// tasks a driver process left, read as a starting driver reads them
// (scanTaskDirs) and changing nothing.
type TaskDirs struct {
	// Handed are the task IDs handed to Nomad: alive until Nomad says
	// otherwise, which only the driver hears.
	Handed []string
	// Unfinished are the task IDs whose start never finished: the next
	// driver process kills their supervisors and tears down their volumes.
	Unfinished []string
}

// ReadTaskDirs reads the task state directories under rootDir. A task ID in
// neither list has no state directory: no driver process will take it back.
func ReadTaskDirs(rootDir string) TaskDirs {
	iv := newInvocations()
	var td TaskDirs
	td.Unfinished = iv.scanTaskDirs(hclog.NewNullLogger(), filepath.Join(rootDir, "tasks"), JournalDir(rootDir))
	for id := range iv.waiting {
		td.Handed = append(td.Handed, id)
	}
	sort.Strings(td.Handed)
	sort.Strings(td.Unfinished)
	return td
}
