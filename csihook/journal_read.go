package csihook

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/hashicorp/go-hclog"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/wal"
)

// JournalState is what a journal directory holds, for tests and tools
// that look at a node from outside: the live records of volumes and of
// task volumes, without secrets, contexts or mount flags. Records of
// volumes created by name are left out.
type JournalState struct {
	Volumes []JournalVolume
	Tasks   []JournalTask
	// Created are the volumes created on this node, by the name a job
	// gave them (its volume_id) and the id their plugin answered. They
	// are kept after the volumes are released.
	Created []JournalCreated
	// Files are the other files in the directory: copies of a damaged
	// log (journal.log.<time>.bad) and records of the file-per-record
	// format that were not moved into the log yet, or were set aside
	// (*.bad).
	Files []string
}

// JournalVolume is the record of a volume on the node.
type JournalVolume struct {
	PluginID    string
	VolumeID    string
	StagingPath string
	NodeID      string
	// Stage is "", "staging", "staged", "refused" (the plugin refused
	// the last NodeStageVolume; it is unstaged when the last task using
	// it stops) or "unstaging".
	Stage string
	// Controller is "", "publishing", "published" or "unpublishing".
	Controller string
	// Namespace is the Nomad namespace the volume belongs to, or that
	// claims it with the record while setting it up ("" when none is
	// recorded).
	Namespace string
	// Server is who served the plugin id when the volume was set up.
	Server string
}

// JournalTask is the record of one volume of a task.
type JournalTask struct {
	TaskID      string
	Name        string
	PluginID    string
	VolumeID    string
	Target      string
	Destination string
	// State is "pending", "publishing", "published" or "unpublishing".
	State string
	// Invocation says the driver that wrote the record names the task's
	// state directory with an invocation file whose flush the record's
	// commit is: a state directory of the task without a whole
	// invocation file is still this start's (see taskRecord.Invocation).
	Invocation bool
}

// JournalCreated is a volume created on this node: Name is the volume_id
// the job wrote, VolumeID the id the plugin gave the volume, which every
// other record and every later call use.
type JournalCreated struct {
	PluginID string
	Name     string
	VolumeID string
}

// NamesOf returns the names jobs created the plugin's volume under, when
// they differ from its id (sorted; none for a volume named by its id).
func (s JournalState) NamesOf(pluginID, volumeID string) []string {
	var out []string
	for _, c := range s.Created {
		if c.PluginID == pluginID && c.VolumeID == volumeID && c.Name != volumeID {
			out = append(out, c.Name)
		}
	}
	sort.Strings(out)
	return out
}

// ReadJournal replays the journal in dir without changing anything and
// without its lock, so it works while a driver has the journal open. A
// batch being written while it reads is not there yet (a torn tail is
// what the log ends in); a compaction replaces the log whole. Damage
// before the end of the log is an error, returned with what the intact
// batches hold. A directory without a log is an empty journal.
func ReadJournal(dir string) (JournalState, error) {
	var st JournalState
	entries, err := os.ReadDir(dir)
	if err != nil {
		return st, fmt.Errorf("failed to read journal directory %q: %w", dir, err)
	}
	for _, e := range entries {
		name := e.Name()
		if name != logName && name != wal.LockName && !strings.HasPrefix(name, ".tmp-") {
			st.Files = append(st.Files, name)
		}
	}
	path := filepath.Join(dir, logName)
	// A read can overlap a commit and see it only in part, which looks
	// like damage when a later commit shows whole: read again before
	// calling it damage.
	var scan logScan
	for range 3 {
		data, err := os.ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			return st, nil
		}
		if err != nil {
			return st, fmt.Errorf("failed to read journal %q: %w", path, err)
		}
		if scan = scanLog(data, hclog.NewNullLogger()); scan.damaged == 0 && scan.badOps == 0 {
			break
		}
	}
	for _, v := range scan.state.vols {
		ns, _ := scan.state.owner(v.key())
		st.Volumes = append(st.Volumes, JournalVolume{PluginID: v.PluginID, VolumeID: v.VolumeID,
			StagingPath: v.StagingPath, NodeID: v.NodeID, Stage: v.Stage, Controller: v.Controller,
			Namespace: ns, Server: v.Server})
	}
	for _, recs := range scan.state.tasks {
		for _, t := range recs {
			st.Tasks = append(st.Tasks, JournalTask{TaskID: t.TaskID, Name: t.Name, PluginID: t.PluginID,
				VolumeID: t.VolumeID, Target: t.Target, Destination: t.Destination, State: t.State, Invocation: t.Invocation})
		}
	}
	for _, c := range scan.state.created {
		st.Created = append(st.Created, JournalCreated{PluginID: c.PluginID, Name: c.Name, VolumeID: c.VolumeID})
	}
	sort.Slice(st.Created, func(i, j int) bool {
		a, b := st.Created[i], st.Created[j]
		return a.PluginID < b.PluginID || (a.PluginID == b.PluginID && a.Name < b.Name)
	})
	sort.Slice(st.Volumes, func(i, j int) bool {
		a, b := st.Volumes[i], st.Volumes[j]
		return a.PluginID < b.PluginID || (a.PluginID == b.PluginID && a.VolumeID < b.VolumeID)
	})
	sort.Slice(st.Tasks, func(i, j int) bool {
		a, b := st.Tasks[i], st.Tasks[j]
		return a.TaskID < b.TaskID || (a.TaskID == b.TaskID && a.Name < b.Name)
	})
	if scan.damaged > 0 || scan.badOps > 0 {
		return st, fmt.Errorf("journal %q is damaged: %d bytes between batches are not batches, %d records cannot be used",
			path, scan.damaged, scan.badOps)
	}
	return st, nil
}

// Empty reports whether no volume or task record is left: nothing is
// staged, attached or published as far as the journal knows.
func (s JournalState) Empty() bool { return len(s.Volumes) == 0 && len(s.Tasks) == 0 }
