//go:build e2e

package e2e

// Helpers for the CSI plugin cases (plugin_test.go) and the plugin health
// benchmark (bench/plugin_health_test.go): an agent whose driver allows
// privileged tasks and scans a plugin socket directory, reading the
// driver's plugin attributes, and locating the CSI test binaries.

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/nomad/api"
)

// PluginAgent is a -dev agent whose csi driver allows privileged tasks and
// scans SocketDir (plugin_socket_dirs). Its root_dir and socket directory
// are in a directory of this helper's own, Base (the harness cannot know
// its own temporary directory before it writes the configuration), which
// is cleaned up after the agent: processes, mounts, files.
type PluginAgent struct {
	*Agent
	// Base is an OwnedTempDir /tmp/ncsp-*: SweepStale takes it only once
	// the test process is gone.
	Base string
	// RootDir is the driver's root_dir (Agent.DriverRoot too).
	RootDir string
	// SocketDir is the driver's plugin_socket_dirs entry.
	SocketDir string
}

// StageRoot is where the driver stages volumes and where node plugins see
// bidirectional mounts: <root_dir>/mnt.
func (p *PluginAgent) StageRoot() string { return filepath.Join(p.RootDir, "mnt") }

// PluginSocket is the host path of the socket of a plugin task with id.
func (p *PluginAgent) PluginSocket(id string) string {
	return filepath.Join(p.RootDir, "plugins", id, "csi.sock")
}

// StartPluginAgent starts a PluginAgent for one test (and its subtests).
func StartPluginAgent(t testing.TB) *PluginAgent {
	t.Helper()
	base := OwnedTempDir(t, "ncsp-")
	// Registered before StartAgent, so it runs after the agent's Close.
	t.Cleanup(func() { cleanupPluginBase(t, base) })
	p := &PluginAgent{Base: base, RootDir: filepath.Join(base, "root"), SocketDir: filepath.Join(base, "sockets")}
	for _, d := range []string{p.RootDir, p.SocketDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatalf("%v", err)
		}
	}
	p.Agent = StartAgent(t, AgentOptions{AllowPrivileged: true, DriverRoot: p.RootDir,
		DriverConfig: fmt.Sprintf("    plugin_socket_dirs = [%q]", p.SocketDir)})
	return p
}

// cleanupPluginBase kills what is left of the processes that name base
// (a plugin the test started itself, a task whose agent died), unmounts
// everything under it and removes it.
func cleanupPluginBase(t testing.TB, base string) {
	if err := sweepOwned(base, t.Logf); err != nil {
		t.Error(err)
	}
}

// TrackJob makes Close stop and purge a job the test submitted without
// SubmitJob (an example file run with the CLI).
func (a *Agent) TrackJob(id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.jobs = append(a.jobs, id)
}

// NodeAttributes reads the node's attributes, the csi driver's merged in
// (Nomad keeps them in both places; the driver's win).
func (a *Agent) NodeAttributes() (map[string]string, error) {
	n, err := a.node()
	if err != nil {
		return nil, err
	}
	attrs := map[string]string{}
	for k, v := range n.Attributes {
		attrs[k] = v
	}
	if d := n.Drivers[DriverName]; d != nil {
		for k, v := range d.Attributes {
			attrs[k] = v
		}
	}
	return attrs, nil
}

// PluginAttributes returns the driver.csi.plugin.<key>.* attributes of one
// plugin, without the prefix ("healthy", "vendor", "topology.zone").
func PluginAttributes(attrs map[string]string, key string) map[string]string {
	prefix := "driver.csi.plugin." + key + "."
	out := map[string]string{}
	for k, v := range attrs {
		if strings.HasPrefix(k, prefix) {
			out[strings.TrimPrefix(k, prefix)] = v
		}
	}
	return out
}

// WaitPluginAttr polls the node every interval until the plugin's attribute
// has the wanted value, and returns when it was first seen and the
// plugin's attributes then.
func (a *Agent) WaitPluginAttr(key, attr, want string, interval, timeout time.Duration) (time.Time, map[string]string, error) {
	deadline := time.Now().Add(Scaled(timeout))
	var last map[string]string
	lastErr := error(nil)
	for {
		attrs, err := a.NodeAttributes()
		now := time.Now()
		if err == nil {
			last = PluginAttributes(attrs, key)
			if last[attr] == want {
				return now, last, nil
			}
		} else {
			lastErr = err
		}
		if now.After(deadline) {
			return now, last, fmt.Errorf("driver.csi.plugin.%s.%s did not become %q within %v (last error: %v); the plugin's attributes: %v",
				key, attr, want, timeout, lastErr, last)
		}
		time.Sleep(interval)
	}
}

// CSIPluginStatus is /v1/plugin/csi/<id>.
type CSIPluginStatus = api.CSIPlugin

// NativeCSIPlugin reads Nomad's own record of a CSI plugin (what "nomad
// plugin status" shows); found is false when Nomad has none yet.
func (a *Agent) NativeCSIPlugin(id string) (st CSIPluginStatus, found bool, err error) {
	p, _, err := a.api.CSIPlugins().Info(id, nil)
	var re api.UnexpectedResponseError
	if errors.As(err, &re) && re.StatusCode() == http.StatusNotFound {
		return st, false, nil
	}
	if err != nil {
		return st, false, err
	}
	return *p, true, nil
}

var (
	csiToolsOnce sync.Once
	csiToolsErr  error
)

// CSIToolPath returns build/csi/<name>, running e2e/tools/build.sh once
// first unless E2E_SKIP_BUILD is set (it rebuilds only what is stale).
func CSIToolPath(root, name string) (string, error) {
	csiToolsOnce.Do(func() {
		if os.Getenv("E2E_SKIP_BUILD") != "" {
			return
		}
		cmd := exec.Command(filepath.Join(root, "e2e", "tools", "build.sh"))
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			csiToolsErr = fmt.Errorf("e2e/tools/build.sh failed: %w\n%s", err, out)
		}
	})
	if csiToolsErr != nil {
		return "", csiToolsErr
	}
	bin := filepath.Join(root, "build", "csi", name)
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("no %s: run make csi-tools (e2e/tools/build.sh): %w", bin, err)
	}
	return bin, nil
}

// HCLList renders strings as an HCL list literal for a job template.
func HCLList(items ...string) string {
	quoted := make([]string, len(items))
	for i, s := range items {
		quoted[i] = strconv.Quote(s)
	}
	return "[" + strings.Join(quoted, ", ") + "]"
}

// CapEff reads a process's effective capability set from /proc/PID/status.
func CapEff(pid int) (uint64, error) {
	v, err := StatusField(pid, "CapEff")
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(v, 16, 64)
}

// TaskPIDByComm finds the host PID of the process named comm in a task.
func TaskPIDByComm(allocID, task, comm string) (int, error) {
	var found []int
	all := TaskPIDs(allocID, task)
	for _, pid := range all {
		if p, err := ReadProc(pid); err == nil && p.Comm == comm {
			found = append(found, pid)
		}
	}
	if len(found) != 1 {
		return 0, fmt.Errorf("want one %q process in task %s of allocation %s, found %v (task processes: %v)", comm, task, allocID, found, all)
	}
	return found[0], nil
}
