package cli

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/wal"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// cleanupView is what cleanup found (and did).
type cleanupView struct {
	// DriverRunning is true when a driver holds the journal's lock.
	DriverRunning bool `json:"driver_running"`
	// OrphanMounts are volume mounts under the stage root that no journal
	// record names: nothing will ever unmount them.
	OrphanMounts []string `json:"orphan_mounts"`
	// OtherMounts are mounts under root_dir outside the volume layout;
	// cleanup never touches them.
	OtherMounts []string `json:"other_mounts,omitempty"`
	// StaleRecords are journal records of tasks no driver will take back;
	// the driver tears their volumes down when it next starts.
	StaleRecords []staleRecord `json:"stale_records"`
	// Unmounted are the orphan mounts -apply unmounted; Failed those it
	// could not, with why.
	Unmounted []string          `json:"unmounted,omitempty"`
	Failed    map[string]string `json:"failed,omitempty"`
	Applied   bool              `json:"applied"`

	// root is the real root_dir the mounts were looked for under, ids the
	// mount ID on top at each path, for -apply to unmount exactly that.
	root string
	ids  map[string]int
}

type staleRecord struct {
	TaskID   string `json:"task_id"`
	Name     string `json:"name"`
	PluginID string `json:"plugin_id"`
	VolumeID string `json:"volume_id"`
	// Names are the volume_id the volume was created under (volumeView).
	Names []string `json:"names,omitempty"`
	State string   `json:"state"`
	// Why is "start never finished" or "no task state directory".
	Why string `json:"why"`
}

// errDriverRunning is cleanup -apply refusing to act beside a driver.
var errDriverRunning = errors.New("the driver holds the volume journal's lock: it is running and owns these mounts; stop the Nomad agent (or the driver) first, or run cleanup without -apply to only look")

func runCleanup(e *env, args []string, apply bool) error {
	m := mounter.New()
	jdir := driver.JournalDir(e.rootDir)
	var v cleanupView
	if apply {
		// Hold the lock while acting, so that a driver starting meanwhile
		// waits for its journal rather than racing the unmounts.
		unlock, err := lockJournal(jdir)
		if err != nil {
			return err
		}
		defer unlock()
	} else {
		running, err := journalLocked(jdir)
		if err != nil {
			return err
		}
		v.DriverRunning = running
	}
	if err := findOrphans(e.rootDir, m, &v); err != nil {
		return err
	}
	if apply {
		applyOrphans(m, &v)
	}
	if e.json {
		if err := e.writeJSON(v); err != nil {
			return err
		}
	} else {
		printCleanup(e, v)
	}
	if len(v.Failed) > 0 {
		return fmt.Errorf("%d orphan mount(s) could not be unmounted", len(v.Failed))
	}
	return nil
}

// configuredRoot is the root_dir a journaled staging or publish path was
// made under: <root_dir>/mnt/staging/<plugin>/<volume hash> and
// <root_dir>/mnt/publish/<task hash>/<name> alike.
func configuredRoot(p string) string {
	return filepath.Dir(filepath.Dir(filepath.Dir(filepath.Dir(p))))
}

// sameRoot tells whether the journaled path p was made under another name
// of realRoot. Only root_dir itself is resolved, never a directory below
// it, where a plugin task could have put a symlink.
func sameRoot(p, realRoot string) bool {
	root := configuredRoot(p)
	if filepath.Base(filepath.Dir(filepath.Dir(filepath.Dir(p)))) != "mnt" {
		return false
	}
	resolved, err := filepath.EvalSymlinks(root)
	return err == nil && resolved == realRoot
}

// applyOrphans unmounts v's orphan mounts, deepest first, and records
// what it did in v.
func applyOrphans(m mounter.Interface, v *cleanupView) {
	v.Applied = true
	v.Failed = map[string]string{}
	// Deepest first: a volume's submounts before the volume.
	sort.Slice(v.OrphanMounts, func(i, j int) bool { return len(v.OrphanMounts[i]) > len(v.OrphanMounts[j]) })
	for _, p := range v.OrphanMounts {
		// Whoever can write a directory on the way (a plugin task has
		// the stage root) could swap it for a symlink after the table
		// was read: only the mount with the listed ID, reached without
		// following any symlink, is unmounted.
		if err := m.UnmountExact(v.root, p, v.ids[p]); err != nil {
			v.Failed[p] = err.Error()
			continue
		}
		v.Unmounted = append(v.Unmounted, p)
	}
	if len(v.Failed) == 0 {
		v.Failed = nil
	}
}

// findOrphans fills v from the journal, the task state directories and
// the mount table. A mount is an orphan only when it is under the stage
// root's volume layout and neither at nor below a path a journal record
// names; the journal must read whole, or nothing is called an orphan.
func findOrphans(rootDir string, m mounter.Interface, v *cleanupView) error {
	st, err := csihook.ReadJournal(driver.JournalDir(rootDir))
	switch {
	case err != nil && errors.Is(err, fs.ErrNotExist) && len(st.Files) == 0:
		st = csihook.JournalState{}
	case err != nil:
		return fmt.Errorf("the journal cannot be read whole, so no mount can be proven an orphan: %w", err)
	}
	for _, name := range st.Files {
		if csihook.IsRecordFile(name) {
			return fmt.Errorf("the journal holds records in the older one-file-per-record format (%s) that only the driver reads: start the driver once (it moves them into the log), then run cleanup", name)
		}
	}
	// The journal records paths under root_dir as the driver was
	// configured; the mount table has real paths. Both are compared
	// under the real root_dir, whichever of the two -root-dir names.
	root := filepath.Clean(rootDir)
	realRoot, err := filepath.EvalSymlinks(root)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		realRoot = root
	case err != nil:
		return fmt.Errorf("failed to resolve -root-dir %q: %w", root, err)
	}
	var backed []string
	rebase := func(p string) error {
		switch {
		case mounter.PathWithin(p, realRoot):
			backed = append(backed, p)
		case mounter.PathWithin(p, root):
			rel, _ := filepath.Rel(root, p)
			backed = append(backed, filepath.Join(realRoot, rel))
		case sameRoot(p, realRoot):
			// Named by its real path; the driver was configured with
			// another name of it.
			rel, _ := filepath.Rel(configuredRoot(p), p)
			backed = append(backed, filepath.Join(realRoot, rel))
		default:
			return fmt.Errorf("the journal names %q, which is under neither -root-dir %q nor its real path %q: it belongs to another root_dir, so no mount can be proven an orphan", p, root, realRoot)
		}
		return nil
	}
	for _, vol := range st.Volumes {
		if vol.StagingPath != "" {
			if err := rebase(vol.StagingPath); err != nil {
				return err
			}
		}
	}
	for _, t := range st.Tasks {
		if t.Target != "" {
			if err := rebase(t.Target); err != nil {
				return err
			}
		}
	}
	mounts, err := m.List()
	if err != nil {
		return fmt.Errorf("failed to read the mount table: %w", err)
	}
	v.root = realRoot
	v.ids = map[string]int{}
	stage := driver.StageRoot(realRoot)
	layout := []string{filepath.Join(stage, "staging"), filepath.Join(stage, "publish")}
	seen := map[string]bool{}
	for _, mp := range mounts {
		p := mp.Path
		if p == realRoot || !mounter.PathWithin(p, realRoot) {
			continue
		}
		// The last of several mounts at one path is the one on top, the
		// one its path leads to.
		v.ids[p] = mp.ID
		if seen[p] {
			continue
		}
		seen[p] = true
		inLayout := false
		for _, d := range layout {
			if p != d && mounter.PathWithin(p, d) {
				inLayout = true
			}
		}
		switch {
		case !inLayout:
			if p != stage {
				v.OtherMounts = append(v.OtherMounts, p)
			}
		case !mounter.WithinAny(p, backed):
			v.OrphanMounts = append(v.OrphanMounts, p)
		}
	}
	sort.Strings(v.OrphanMounts)
	sort.Strings(v.OtherMounts)

	td := driver.ReadTaskDirs(rootDir)
	handed := map[string]bool{}
	for _, id := range td.Handed {
		handed[id] = true
	}
	unfinished := map[string]bool{}
	for _, id := range td.Unfinished {
		unfinished[id] = true
	}
	for _, t := range st.Tasks {
		if handed[t.TaskID] {
			continue
		}
		why := "no task state directory"
		if unfinished[t.TaskID] {
			why = "start never finished"
		}
		v.StaleRecords = append(v.StaleRecords, staleRecord{TaskID: t.TaskID, Name: t.Name, PluginID: t.PluginID,
			VolumeID: t.VolumeID, Names: st.NamesOf(t.PluginID, t.VolumeID), State: t.State, Why: why})
	}
	if v.OrphanMounts == nil {
		v.OrphanMounts = []string{}
	}
	if v.StaleRecords == nil {
		v.StaleRecords = []staleRecord{}
	}
	return nil
}

// lockJournal takes the journal's lock without waiting, as the driver
// does, and fails with errDriverRunning when a driver has it. The lock file
// is made when missing (as the driver makes it), so that a driver starting
// meanwhile waits for it too; a root_dir that does not exist has no driver
// and no mounts.
func lockJournal(dir string) (func(), error) {
	if _, err := os.Stat(filepath.Dir(dir)); errors.Is(err, fs.ErrNotExist) {
		return func() {}, nil
	}
	f, err := wal.Lock(dir)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return nil, errDriverRunning
	}
	if err != nil {
		return nil, err
	}
	return func() { f.Close() }, nil
}

// journalLocked reports whether someone holds the journal's lock, from
// /proc/locks, without taking it: looking must not get in a starting
// driver's way.
func journalLocked(dir string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(dir, wal.LockName), &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, fmt.Errorf("failed to look at the journal lock in %q: %w", dir, err)
	}
	f, err := os.Open("/proc/locks")
	if err != nil {
		return false, fmt.Errorf("failed to read the lock table: %w", err)
	}
	defer f.Close()
	want := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; waiters
		// have "->" after the number.
		fields := strings.Fields(sc.Text())
		if len(fields) > 1 && fields[1] == "->" {
			continue
		}
		if len(fields) >= 6 && fields[1] == "FLOCK" && fields[5] == want {
			return true, nil
		}
	}
	return false, sc.Err()
}

func printCleanup(e *env, v cleanupView) {
	p := Printable
	if !v.Applied {
		if v.DriverRunning {
			fmt.Fprintln(e.out, "The driver is running (it holds the journal lock): -apply would refuse to act.")
		} else {
			fmt.Fprintln(e.out, "Dry run: nothing was changed; run with -apply to unmount the orphan mounts.")
		}
	}
	if len(v.OrphanMounts) == 0 {
		fmt.Fprintln(e.out, "Orphan volume mounts: none")
	} else {
		fmt.Fprintln(e.out, "Orphan volume mounts (no journal record names them):")
		for _, m := range v.OrphanMounts {
			switch {
			case !v.Applied:
				fmt.Fprintf(e.out, "  would unmount %s\n", p(m))
			case v.Failed[m] != "":
				fmt.Fprintf(e.out, "  FAILED to unmount %s: %s\n", p(m), p(v.Failed[m]))
			default:
				fmt.Fprintf(e.out, "  unmounted %s\n", p(m))
			}
		}
	}
	if len(v.StaleRecords) == 0 {
		fmt.Fprintln(e.out, "Journal records without a live task: none")
	} else {
		fmt.Fprintln(e.out, "Journal records without a live task (the driver tears these down when it next starts; cleanup leaves them):")
		for _, r := range v.StaleRecords {
			vol := p(r.VolumeID)
			if len(r.Names) > 0 {
				vol = p(strings.Join(r.Names, ", ")) + ", plugin's volume ID " + vol
			}
			fmt.Fprintf(e.out, "  task %s volume %s (%s of plugin %s), %s: %s\n", p(r.TaskID), p(r.Name), vol, p(r.PluginID), p(r.State), r.Why)
		}
	}
	if len(v.OtherMounts) > 0 {
		fmt.Fprintln(e.out, "Other mounts under root_dir (not volume mounts; left alone):")
		for _, m := range v.OtherMounts {
			fmt.Fprintf(e.out, "  %s\n", p(m))
		}
	}
}
