//go:build e2e

package e2e

// Native (Nomad-claimed) volumes in the cluster's drain cases: a volume
// every client's fixture instance can serve, registered with Nomad, so a
// drained workload can move to another client with it; and what the
// servers and the fixture say about its claims on one node.

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/hashicorp/nomad/api"
)

// ClusterNativeFixture is the e2e fixture as a system job with Nomad's own
// task-level csi_plugin block (jobs/cluster_plugin_native.hcl), each
// instance's state under StateBase/<node name>/state.
type ClusterNativeFixture struct {
	ID        string
	JobID     string
	StateBase string
}

// StartClusterNativeFixture seeds a "dir" volume record named vol into the
// state of every client's instance, each record's data directory a link to
// one directory they share, then runs the fixture as a system job with
// Nomad's csi_plugin block and plugin id id, waits until the servers count
// it healthy on every client, and registers vol with Nomad ("nomad volume
// register", no topology, access mode single-node-writer): any client can
// stage it, and what a workload writes on one client it reads on another.
// The fixture loads its records when it starts, so the seeding comes first.
func (c *Cluster) StartClusterNativeFixture(id, vol string) (*ClusterNativeFixture, error) {
	fx := &ClusterNativeFixture{ID: id, StateBase: filepath.Join(c.Server.Dir, "fx-"+id)}
	shared := filepath.Join(fx.StateBase, "shared", vol)
	if err := os.MkdirAll(shared, 0o777); err != nil {
		return nil, err
	}
	// Tasks may run as any user.
	if err := os.Chmod(shared, 0o777); err != nil {
		return nil, err
	}
	rec, err := json.Marshal(map[string]any{"id": vol, "name": vol, "type": "dir", "capacity_bytes": 1 << 20})
	if err != nil {
		return nil, err
	}
	for _, a := range c.Clients {
		state := filepath.Join(fx.StateBase, a.NodeName(), "state")
		for _, d := range []string{"meta", "volumes"} {
			if err := os.MkdirAll(filepath.Join(state, d), 0o755); err != nil {
				return nil, err
			}
		}
		if err := os.WriteFile(filepath.Join(state, "meta", vol+".json"), rec, 0o644); err != nil {
			return nil, err
		}
		if err := os.Symlink(shared, filepath.Join(state, "volumes", vol)); err != nil {
			return nil, err
		}
	}
	job, err := c.Server.RenderJob("cluster_plugin_native", map[string]string{
		"PluginID": id, "Command": filepath.Join(VolCSIBinDir(c.Server.Root), "csi-fixture"),
		"StateBase": fx.StateBase, "MountDir": filepath.Join(c.Server.Dir, "sock-"+id),
	})
	if err != nil {
		return nil, err
	}
	fx.JobID = job.ID
	if _, err := c.Server.SubmitRendered(job); err != nil {
		return nil, err
	}
	if _, err := c.Server.WaitNativePlugin(id, len(c.Clients), len(c.Clients), 2*time.Minute); err != nil {
		return nil, err
	}
	spec := filepath.Join(c.Server.Dir, "volume-"+vol+".hcl")
	text := fmt.Sprintf(`id          = %q
name        = %q
type        = "csi"
plugin_id   = %q
external_id = %q

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}
`, vol, vol, id, vol)
	if err := os.WriteFile(spec, []byte(text), 0o600); err != nil {
		return nil, err
	}
	if out, err := c.Server.Nomad("volume", "register", spec); err != nil {
		return nil, fmt.Errorf("nomad volume register %s failed: %w\n%s", spec, err, out)
	}
	return fx, nil
}

// Held lists the staging and publish paths the instance on client a still
// records for volume vol (its own view of what it set up there): empty once
// every unpublish and unstage on that client has reached it.
func (fx *ClusterNativeFixture) Held(a *Agent, vol string) ([]string, error) {
	return fixtureHeld(filepath.Join(fx.StateBase, a.NodeName(), "state"), vol)
}

// fixtureHeld reads the fixture's record of volume id under stateDir and
// lists its staged and published paths.
func fixtureHeld(stateDir, id string) ([]string, error) {
	b, err := os.ReadFile(filepath.Join(stateDir, "meta", id+".json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var v struct {
		Staged  map[string]json.RawMessage `json:"staged"`
		Targets map[string]json.RawMessage `json:"targets"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return nil, fmt.Errorf("failed to decode the record of volume %q: %w", id, err)
	}
	var out []string
	for p := range v.Staged {
		out = append(out, "staged "+p)
	}
	for p := range v.Targets {
		out = append(out, "published "+p)
	}
	sort.Strings(out)
	return out, nil
}

// Held is ClusterNativeFixture.Held for a driver-managed fixture instance
// (the volume by the fixture's own id, VolFixture.VolumeID).
func (p *VolFixture) Held(volID string) ([]string, error) { return fixtureHeld(p.StateDir, volID) }

// NativeClaimsOn lists the claims the servers hold on volume vol for
// allocations on node nodeID ("read <alloc>" or "write <alloc>"), from
// /v1/volume/csi/<vol>'s ReadAllocs and WriteAllocs (what "nomad volume
// status" lists). A claim whose allocation the servers no longer know is
// listed too ("write <alloc> (allocation gone)"): it cannot be shown to be
// elsewhere.
func (a *Agent) NativeClaimsOn(vol, nodeID string) ([]string, error) {
	v, err := a.NativeVolume(vol)
	if err != nil {
		return nil, err
	}
	var out []string
	for mode, allocs := range map[string]map[string]*api.Allocation{"read": v.ReadAllocs, "write": v.WriteAllocs} {
		for id := range allocs {
			var al struct{ NodeID string }
			if err := a.GetJSON("/v1/allocation/"+url.PathEscape(id), &al); err != nil {
				out = append(out, fmt.Sprintf("%s %s (allocation gone: %v)", mode, id, err))
				continue
			}
			if al.NodeID == nodeID {
				out = append(out, mode+" "+id)
			}
		}
	}
	sort.Strings(out)
	return out, nil
}

// WaitNativeClaimsOffNode waits until the servers hold no claim on volume
// vol for an allocation on node nodeID (NativeClaimsOn empty) and returns
// the claims left after timeout. Nothing hurries it: the servers' volume
// watcher releases the claim of an allocation once it is terminal and its
// node has unpublished the volume.
func (a *Agent) WaitNativeClaimsOffNode(vol, nodeID string, timeout time.Duration) ([]string, error) {
	deadline := time.Now().Add(Scaled(timeout))
	for {
		left, err := a.NativeClaimsOn(vol, nodeID)
		if err != nil || len(left) == 0 || time.Now().After(deadline) {
			return left, err
		}
		time.Sleep(200 * time.Millisecond)
	}
}
