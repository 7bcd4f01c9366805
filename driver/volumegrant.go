package driver

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/hashicorp/nomad/plugins/shared/hclspec"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

// VolumeGrant is one volume_grant block of the agent's plugin config: the
// operator's permission for the tasks of some namespaces (and jobs) to use
// the volumes of a plugin whose ids match a glob. Once the config holds
// one, a task's volume blocks are each matched against them, on every node
// that has the same config: which namespace reaches which volume is then
// the operator's, cluster-wide, where a volume's owner on a node is only
// the namespace that used it there first.
type VolumeGrant struct {
	// Namespace, Job, PluginID and VolumeID are globs (grantGlob) over the
	// task's Nomad namespace and job id and the volume block's plugin_id
	// and volume_id (the id the job writes: the plugin's own, or the
	// name a create block creates the volume under). Job "" is any job.
	Namespace string `codec:"namespace"`
	Job       string `codec:"job"`
	PluginID  string `codec:"plugin_id"`
	VolumeID  string `codec:"volume_id"`
}

// volumeGrantSpec is the repeatable volume_grant block.
var volumeGrantSpec = hclspec.NewBlockList("volume_grant", hclspec.NewObject(map[string]*hclspec.Spec{
	"namespace": hclspec.NewAttr("namespace", "string", true),
	"job":       hclspec.NewAttr("job", "string", false),
	"plugin_id": hclspec.NewAttr("plugin_id", "string", true),
	"volume_id": hclspec.NewAttr("volume_id", "string", true),
}))

// validate checks one grant; key names it ("volume_grant[0]").
func (g VolumeGrant) validate(key string) error {
	for _, f := range []struct{ name, value, example string }{
		{"namespace", g.Namespace, `"team-a"`},
		{"plugin_id", g.PluginID, `"nfs"`},
		{"volume_id", g.VolumeID, `"team-a-*"`},
	} {
		if strings.TrimSpace(f.value) == "" {
			return fmt.Errorf("%s.%s must not be empty: name what the grant is for, such as %s (a glob: \"*\" matches any run of characters, \"?\" one)",
				key, f.name, f.example)
		}
	}
	if g.Job != "" && strings.TrimSpace(g.Job) == "" {
		return fmt.Errorf("%s.job must be a job id or a glob, or left out for any job, got %q", key, g.Job)
	}
	return nil
}

// String is the grant as a one-line block of the agent's config (HCL1).
func (g VolumeGrant) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "volume_grant { namespace = %q", g.Namespace)
	if g.Job != "" {
		fmt.Fprintf(&b, ", job = %q", g.Job)
	}
	fmt.Fprintf(&b, ", plugin_id = %q, volume_id = %q }", g.PluginID, g.VolumeID)
	return b.String()
}

// forJob reports whether g is a grant to job's namespace and job.
func (g VolumeGrant) forJob(job jobRef) bool {
	return grantGlob(g.Namespace, job.namespace) && (g.Job == "" || grantGlob(g.Job, job.id))
}

// matches reports whether g lets job use volume volumeID of plugin.
func (g VolumeGrant) matches(job jobRef, plugin, volumeID string) bool {
	return g.forJob(job) && grantGlob(g.PluginID, plugin) && grantGlob(g.VolumeID, volumeID)
}

// checkVolumeGrants refuses a volume block of vols that no grant lets job
// use, when there are grants, in the order of the blocks' names. The
// refusal names the volume block, its ids and the grants of the task's
// own namespace and job (those of others are not named: a job's author
// learns nothing of what the operator lets other namespaces use).
func checkVolumeGrants(grants []VolumeGrant, job jobRef, vols map[string]VolumeConfig) error {
	if len(grants) == 0 {
		return nil
	}
	for _, name := range slices.Sorted(maps.Keys(vols)) {
		r := vols[name]
		// Ids longer than any the driver passes on (csihook.MaxIDBytes,
		// refused after this check) are not matched: matching them costs
		// in proportion to their size, for every grant.
		if len(r.VolumeID) > csihook.MaxIDBytes || len(r.PluginID) > csihook.MaxIDBytes {
			return fmt.Errorf("volume %s: volume_id %s or plugin_id %s is longer than %d bytes, which no grant matches",
				csihook.Quoted(name), csihook.Quoted(r.VolumeID), csihook.Quoted(r.PluginID), csihook.MaxIDBytes)
		}
		// A ".." path segment is never granted: a plugin that builds a
		// path from the id (a subdirectory of a share) would follow it out
		// of what the grant names ("b-*" matching "b-x/../a-data").
		if slices.Contains(strings.Split(r.VolumeID, "/"), "..") {
			return fmt.Errorf("volume %s: volume_id %s has a \"..\" path segment, which no volume_grant matches: a plugin that makes paths of ids would follow it out of what a grant names",
				csihook.Quoted(name), csihook.Quoted(r.VolumeID))
		}
		granted := false
		for _, g := range grants {
			if g.matches(job, r.PluginID, r.VolumeID) {
				granted = true
				break
			}
		}
		if granted {
			continue
		}
		var own []string
		for i, g := range grants {
			if g.forJob(job) {
				own = append(own, fmt.Sprintf("volume_grant[%d]: plugin_id %q, volume_id %q", i, g.PluginID, g.VolumeID))
			}
		}
		have := "no volume_grant names this namespace and job"
		if len(own) > 0 {
			have = "the grants for this namespace and job are " + strings.Join(own, "; ")
		}
		return fmt.Errorf("volume %s: volume_id %s of plugin %s is not granted to %s on this node (%s): use a volume a grant names, or have the operator add a volume_grant block for it in the driver's plugin config",
			csihook.Quoted(name), csihook.Quoted(r.VolumeID), csihook.Quoted(r.PluginID), job, have)
	}
	return nil
}
