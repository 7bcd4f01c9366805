package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"text/tabwriter"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
)

// volumeView is one volume of the node with the tasks using it.
type volumeView struct {
	PluginID string `json:"plugin_id"`
	// VolumeID is the plugin's id of the volume; Names the volume_id a
	// job created it under, when that is not the plugin's id.
	VolumeID    string     `json:"volume_id"`
	Names       []string   `json:"names,omitempty"`
	Namespace   string     `json:"namespace,omitempty"`
	Stage       string     `json:"stage"`
	Controller  string     `json:"controller,omitempty"`
	StagingPath string     `json:"staging_path,omitempty"`
	Tasks       []taskView `json:"tasks"`
}

// taskView is one task's use of a volume.
type taskView struct {
	TaskID      string `json:"task_id"`
	Name        string `json:"name"`
	State       string `json:"state"`
	Target      string `json:"target"`
	Destination string `json:"destination,omitempty"`
}

type volumesView struct {
	Volumes []volumeView `json:"volumes"`
	// Files are the journal directory's other files (damaged copies and
	// records not yet moved into the log).
	Files []string `json:"files,omitempty"`
	// Warning is set when the journal is damaged before its end: what is
	// shown is what the intact part holds.
	Warning string `json:"warning,omitempty"`
}

// readVolumes reads the journal under rootDir without its lock.
func readVolumes(rootDir string) (volumesView, csihook.JournalState, error) {
	st, err := csihook.ReadJournal(driver.JournalDir(rootDir))
	var v volumesView
	if err != nil {
		if len(st.Volumes) == 0 && len(st.Tasks) == 0 && len(st.Files) == 0 {
			if errors.Is(err, fs.ErrNotExist) {
				// No volume was ever set up under this root_dir.
				return volumesView{Volumes: []volumeView{}}, st, nil
			}
			return v, st, err
		}
		v.Warning = err.Error()
	}
	byKey := map[[2]string]int{}
	for _, jv := range st.Volumes {
		byKey[[2]string{jv.PluginID, jv.VolumeID}] = len(v.Volumes)
		v.Volumes = append(v.Volumes, volumeView{PluginID: jv.PluginID, VolumeID: jv.VolumeID, Names: st.NamesOf(jv.PluginID, jv.VolumeID),
			Namespace: jv.Namespace, Stage: jv.Stage, Controller: jv.Controller, StagingPath: jv.StagingPath, Tasks: []taskView{}})
	}
	for _, jt := range st.Tasks {
		k := [2]string{jt.PluginID, jt.VolumeID}
		i, ok := byKey[k]
		if !ok {
			// A task record whose volume record is not (yet) there.
			i = len(v.Volumes)
			byKey[k] = i
			v.Volumes = append(v.Volumes, volumeView{PluginID: jt.PluginID, VolumeID: jt.VolumeID, Names: st.NamesOf(jt.PluginID, jt.VolumeID),
				Tasks: []taskView{}})
		}
		v.Volumes[i].Tasks = append(v.Volumes[i].Tasks, taskView{TaskID: jt.TaskID, Name: jt.Name, State: jt.State,
			Target: jt.Target, Destination: jt.Destination})
	}
	// By plugin, then by the name an operator knows the volume by.
	sort.Slice(v.Volumes, func(i, j int) bool {
		a, b := v.Volumes[i], v.Volumes[j]
		if a.PluginID != b.PluginID {
			return a.PluginID < b.PluginID
		}
		if a.label() != b.label() {
			return a.label() < b.label()
		}
		return a.VolumeID < b.VolumeID
	})
	for _, vol := range v.Volumes {
		sort.Slice(vol.Tasks, func(i, j int) bool { return vol.Tasks[i].TaskID < vol.Tasks[j].TaskID })
	}
	v.Files = st.Files
	if v.Volumes == nil {
		v.Volumes = []volumeView{}
	}
	return v, st, nil
}

func runVolumes(e *env, args []string) error {
	v, _, err := readVolumes(e.rootDir)
	if err != nil {
		return err
	}
	if e.json {
		return e.writeJSON(v)
	}
	p := Printable
	if v.Warning != "" {
		fmt.Fprintf(e.out, "warning: %s\n\n", p(v.Warning))
	}
	if len(v.Volumes) == 0 {
		fmt.Fprintf(e.out, "No volumes in the journal under %s.\n", p(e.rootDir))
	}
	for i, vol := range v.Volumes {
		if i > 0 {
			fmt.Fprintln(e.out)
		}
		fmt.Fprintln(e.out, volumeTitle(vol.VolumeID, vol.PluginID, vol.Names))
		tw := tabwriter.NewWriter(e.out, 0, 4, 2, ' ', 0)
		if vol.Namespace != "" {
			fmt.Fprintf(tw, "  Namespace\t%s\n", p(vol.Namespace))
		}
		fmt.Fprintf(tw, "  Stage\t%s\n", orNone(p(vol.Stage)))
		if vol.Controller != "" {
			fmt.Fprintf(tw, "  Controller\t%s\n", p(vol.Controller))
		}
		if vol.StagingPath != "" {
			fmt.Fprintf(tw, "  Staging path\t%s\n", p(vol.StagingPath))
		}
		_ = tw.Flush()
		if len(vol.Tasks) == 0 {
			fmt.Fprintln(e.out, "  Tasks: none")
			continue
		}
		tw = tabwriter.NewWriter(e.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  TASK ID\tNAME\tSTATE\tDESTINATION\tMOUNT")
		for _, t := range vol.Tasks {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", p(t.TaskID), p(t.Name), p(t.State), orNone(p(t.Destination)), p(t.Target))
		}
		_ = tw.Flush()
	}
	if len(v.Files) > 0 {
		fmt.Fprintf(e.out, "\nOther files in the journal directory (damaged copies or records not yet in the log):\n")
		for _, f := range v.Files {
			fmt.Fprintf(e.out, "  %s\n", p(f))
		}
	}
	return nil
}

// label is the name an operator knows a volume by: the volume_id its job
// wrote.
func (v volumeView) label() string {
	if len(v.Names) > 0 {
		return v.Names[0]
	}
	return v.VolumeID
}

func orNone(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
