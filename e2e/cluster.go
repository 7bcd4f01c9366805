//go:build e2e

package e2e

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// Cluster is one Nomad server and several clients on this host. Each
// client is an Agent of its own: its own data dir, ports, node name,
// cgroup_parent, and the csi driver's own root_dir and cgroup parent. The
// first client runs beside the server (a Persistent agent); the others
// join it (AgentOptions.Join). Every agent's API address is the server's.
type Cluster struct {
	// Server is the agent that runs the server, with Clients[0].
	Server  *Agent
	Clients []*Agent
}

// StartCluster starts a server and n clients with opts (Persistent and
// Join are set here) and stops everything when the test ends: first every
// job, newest first, while all clients still run (a workload's volumes are
// torn down before the plugin that serves them stops), then the clients
// that joined, then the server with its client.
func StartCluster(t testing.TB, n int, opts AgentOptions) *Cluster {
	t.Helper()
	if n < 1 {
		t.Fatalf("a cluster needs at least one client, not %d", n)
	}
	first := opts
	first.Persistent = true
	first.Join = nil
	c := &Cluster{}
	c.Server = StartAgent(t, first)
	c.Clients = append(c.Clients, c.Server)
	for i := 1; i < n; i++ {
		o := opts
		o.Persistent = false
		o.Join = c.Server
		c.Clients = append(c.Clients, StartAgent(t, o))
	}
	// Registered last, so it runs before the agents' Close.
	t.Cleanup(c.stopJobs)
	return c
}

// stopJobs stops the jobs submitted through any agent of the cluster,
// newest first within each agent, the joined clients' first, and waits for
// each to finish before the next.
func (c *Cluster) stopJobs() {
	for i := len(c.Clients) - 1; i >= 0; i-- {
		a := c.Clients[i]
		a.mu.Lock()
		jobs := append([]string(nil), a.jobs...)
		a.mu.Unlock()
		for j := len(jobs) - 1; j >= 0; j-- {
			a.stopJobs([]string{jobs[j]}, 60*time.Second)
		}
	}
}

// Client returns the client whose node has id nodeID, or nil.
func (c *Cluster) Client(nodeID string) *Agent {
	for _, a := range c.Clients {
		if a.NodeID == nodeID {
			return a
		}
	}
	return nil
}

// ClusterFixture is the e2e CSI fixture run as a system job on every
// client (jobs/cluster_plugin.hcl), each instance with its state and call
// log under StateBase/<node name>.
type ClusterFixture struct {
	ID        string
	JobID     string
	StateBase string
	// File is the rendered job, for running the same job again.
	File string
}

// StartClusterFixture runs the fixture as a system job with plugin id id
// and waits until every client says it is healthy; it returns how long that
// took from the submission.
func (c *Cluster) StartClusterFixture(t testing.TB, id string) (*ClusterFixture, time.Duration) {
	t.Helper()
	return c.StartClusterFixtureWith(t, id, nil)
}

// StartClusterFixtureWith is StartClusterFixture with template variables of
// jobs/cluster_plugin.hcl set: StopWait (csi_plugin stop_wait, default
// "1m") and Version (the task's FIXTURE_VERSION, default "1").
func (c *Cluster) StartClusterFixtureWith(t testing.TB, id string, vars map[string]string) (*ClusterFixture, time.Duration) {
	t.Helper()
	fx := &ClusterFixture{ID: id, StateBase: c.FixtureStateBase(id)}
	for _, a := range c.Clients {
		// The call log is opened before the fixture makes its state dir.
		if err := os.MkdirAll(filepath.Join(fx.StateBase, a.NodeName()), 0o755); err != nil {
			t.Fatalf("%v", err)
		}
	}
	start := time.Now()
	v := map[string]string{
		"PluginID":  id,
		"Command":   filepath.Join(VolCSIBinDir(c.Server.Root), "csi-fixture"),
		"StateBase": fx.StateBase,
		"StopWait":  "1m",
		"Version":   "1",
	}
	for k, val := range vars {
		v[k] = val
	}
	job := c.Server.RunJob(t, "cluster_plugin", v)
	fx.JobID, fx.File = job.ID, job.File
	for _, a := range c.Clients {
		a.WaitVolPluginHealthy(t, id, 2*time.Minute)
	}
	return fx, time.Since(start)
}

// FixtureStateBase is where the fixture of plugin id id keeps each
// client's state and call log (<base>/<node name>/state, calls.log): a
// test may put volume records there before the fixture starts, as a
// storage system both nodes reach would have them.
func (c *Cluster) FixtureStateBase(id string) string { return filepath.Join(c.Server.Dir, "fx-"+id) }

// On is the fixture instance on client a, for its call counts and volume
// records (VolFixture's Count, VolumeCalls, VolumeID).
func (fx *ClusterFixture) On(t testing.TB, a *Agent) *VolFixture {
	dir := filepath.Join(fx.StateBase, a.NodeName())
	return &VolFixture{
		ID:       fx.ID,
		JobID:    fx.JobID,
		StateDir: filepath.Join(dir, "state"),
		CallLog:  filepath.Join(dir, "calls.log"),
		agent:    a,
		t:        t,
	}
}

// String names the fixture for messages.
func (fx *ClusterFixture) String() string { return fmt.Sprintf("plugin %s (job %s)", fx.ID, fx.JobID) }

// SetEligible marks client a eligible or ineligible for new placements.
func (c *Cluster) SetEligible(a *Agent, eligible bool) error {
	e := "ineligible"
	if eligible {
		e = "eligible"
	}
	return c.Server.PutJSON("PUT", "/v1/node/"+url.PathEscape(a.NodeID)+"/eligibility",
		map[string]any{"NodeID": a.NodeID, "Eligibility": e}, nil)
}

// Drain starts draining client a (as "nomad node drain -enable
// -deadline" does, with -ignore-system when ignoreSystem).
func (c *Cluster) Drain(a *Agent, deadline time.Duration, ignoreSystem bool) error {
	return c.Server.PutJSON("PUT", "/v1/node/"+url.PathEscape(a.NodeID)+"/drain", map[string]any{
		"NodeID": a.NodeID,
		"DrainSpec": map[string]any{
			"Deadline":         deadline.Nanoseconds(),
			"IgnoreSystemJobs": ignoreSystem,
		},
	}, nil)
}

// drainState is what /v1/node/<id> says of a drain.
type drainState struct {
	DrainStrategy         *struct{ Deadline int64 }
	SchedulingEligibility string
	LastDrain             *struct{ Status string }
}

// WaitDrained waits until client a's drain is over (Nomad cleared its
// drain strategy) and returns the status of the last drain.
func (c *Cluster) WaitDrained(a *Agent, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(Scaled(timeout))
	var last drainState
	for time.Now().Before(deadline) {
		var st drainState
		if err := c.Server.GetJSON("/v1/node/"+url.PathEscape(a.NodeID), &st); err == nil {
			last = st
			if st.DrainStrategy == nil && st.LastDrain != nil {
				return st.LastDrain.Status, nil
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return "", fmt.Errorf("node %s still draining after %v (%+v)", a.NodeName(), timeout, last)
}

// RerunClusterFixture runs the fixture's job again (the same job id, so
// the driver lets it serve the volumes its earlier run set up) and waits
// until every client says the plugin is healthy.
func (c *Cluster) RerunClusterFixture(t testing.TB, fx *ClusterFixture) {
	t.Helper()
	if out, err := c.Server.Nomad("job", "run", "-detach", fx.File); err != nil {
		t.Fatalf("failed to run %s again: %v: %s", fx, err, out)
	}
	for _, a := range c.Clients {
		a.WaitVolPluginHealthy(t, fx.ID, 2*time.Minute)
	}
}

// UpdateClusterFixture runs a new version of the fixture's job (same job
// and plugin id, FIXTURE_VERSION set to version) and returns the file run.
func (c *Cluster) UpdateClusterFixture(t testing.TB, fx *ClusterFixture, version string) string {
	t.Helper()
	b, err := os.ReadFile(fx.File)
	if err != nil {
		t.Fatalf("%v", err)
	}
	text := regexp.MustCompile(`FIXTURE_VERSION = "[^"]*"`).ReplaceAllString(string(b), fmt.Sprintf("FIXTURE_VERSION = %q", version))
	file := strings.TrimSuffix(fx.File, ".hcl") + "-v" + version + ".hcl"
	if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
		t.Fatalf("%v", err)
	}
	if out, err := c.Server.Nomad("job", "run", "-detach", file); err != nil {
		t.Fatalf("failed to update %s: %v: %s", fx, err, out)
	}
	return file
}
