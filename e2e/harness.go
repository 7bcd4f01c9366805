//go:build e2e

// Package e2e runs nomad-driver-csi inside a real Nomad agent.
//
// The harness starts build/nomad on 127.0.0.1 with free ports, a short
// temporary directory under /tmp (data dir, driver root_dir, agent log,
// rendered job files) and build/plugins as its plugin dir. Jobs come from
// e2e/jobs/*.hcl, rendered with text/template ({{.JobID}}, {{.Vars.NAME}}).
// Everything the agent left behind is cleaned up on Close: jobs are stopped,
// the agent is stopped by PID, stray processes of the test are killed by PID,
// mounts under the temporary directory are unmounted, and only then is the
// directory removed.
//
// The tests are run with:
//
//	go test -tags e2e -count=1 -v ./e2e/ -timeout 20m
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"text/template"
	"time"

	"golang.org/x/sys/unix"
)

// ModulePath is the module whose root RepoRoot looks for.
const ModulePath = "github.com/nomad-driver-csi/nomad-driver-csi"

// DriverName is the name the driver registers under.
const DriverName = "csi"

// Client statuses of an allocation.
const (
	StatusPending  = "pending"
	StatusRunning  = "running"
	StatusComplete = "complete"
	StatusFailed   = "failed"
	StatusLost     = "lost"
)

// RepoRoot walks up from the working directory to the directory whose
// go.mod declares ModulePath.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.HasPrefix(bytes.TrimSpace(b), []byte("module "+ModulePath+"\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod for module %s above the working directory", ModulePath)
		}
		dir = parent
	}
}

// NomadBinary is the pinned agent binary, built by "make nomad".
func NomadBinary(root string) string { return filepath.Join(root, "build", "nomad") }

// PluginDir is the directory the driver is built into.
func PluginDir(root string) string { return filepath.Join(root, "build", "plugins") }

// CheckPrerequisites reports why the e2e tests cannot run here: not root,
// or no agent binary.
func CheckPrerequisites(root string) error {
	if os.Geteuid() != 0 {
		return errors.New("the e2e tests need root (the driver makes mount namespaces and cgroups)")
	}
	if _, err := os.Stat(NomadBinary(root)); err != nil {
		return fmt.Errorf("no Nomad agent at %s: run make nomad: %w", NomadBinary(root), err)
	}
	return nil
}

// BuildDriver builds the driver into PluginDir with "go build -o".
func BuildDriver(root string) error {
	out := filepath.Join(PluginDir(root), "nomad-driver-csi")
	cmd := exec.Command("go", "build", "-o", out, ".")
	cmd.Dir = root
	b, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("failed to build the driver into %s: %w\n%s", out, err, b)
	}
	return nil
}

// AgentOptions shape the agent's configuration.
type AgentOptions struct {
	// AllowPrivileged sets the csi plugin's allow_privileged.
	AllowPrivileged bool
	// Persistent runs a server agent and a separate client agent (with the
	// drivers), both without -dev, so that Restart restarts only the
	// client, the way an operator restarts a node: jobs stay with the
	// server and tasks keep running. A -dev agent keeps its server state in
	// memory and destroys every allocation when it stops.
	Persistent bool
	// Drivers must be detected and healthy before the agent counts as
	// ready. Nil means {"csi"}; an empty, non-nil slice waits for none.
	Drivers []string
	// ExtraConfig is appended to the generated client configuration.
	ExtraConfig string
	// Logf receives the harness's progress messages (may be nil).
	Logf func(format string, args ...any)
}

// Agent is a running Nomad agent: one -dev agent, or (Persistent) a server
// agent plus a client agent. Its HTTP API, CLI helpers and log belong to
// the agent that runs the tasks; in Persistent mode Addr is the server's,
// so that it answers while the client restarts.
type Agent struct {
	Root       string // repository root
	Dir        string // the agent's temporary directory, /tmp/ncsi-*
	DataDir    string // the client's (or -dev agent's) data dir
	DriverRoot string // the csi plugin's root_dir
	ConfigPath string // the client's (or -dev agent's) configuration
	LogPath    string // the client's (or -dev agent's) log
	Addr       string // http://127.0.0.1:PORT
	NodeID     string

	opts         AgentOptions
	cgroupParent string
	http         *http.Client

	mu       sync.Mutex
	client   *proc // runs the tasks (the -dev agent in dev mode)
	server   *proc // Persistent mode only
	jobs     []string
	children map[int]string // PIDs seen as children of the client -> comm
	closed   bool
}

// proc is one nomad agent process.
type proc struct {
	name    string
	args    []string
	logPath string
	cmd     *exec.Cmd
	exited  chan struct{}
	logFile *os.File
}

// StartAgent starts an agent for one test and closes it when the test ends,
// printing the tail of its log when the test failed.
func StartAgent(t testing.TB, opts AgentOptions) *Agent {
	t.Helper()
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	a, err := NewAgent(opts)
	if err != nil {
		t.Fatalf("failed to start the Nomad agent: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("agent log tail (%s):\n%s", a.LogPath, a.LogTail(80))
		}
		a.Close()
	})
	return a
}

// NewAgent starts an agent and waits until its node is ready with the
// wanted drivers healthy. The caller must Close it.
func NewAgent(opts AgentOptions) (*Agent, error) {
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	if err := CheckPrerequisites(root); err != nil {
		return nil, err
	}
	if opts.Drivers == nil {
		opts.Drivers = []string{DriverName}
	}
	if opts.Logf == nil {
		opts.Logf = func(string, ...any) {}
	}
	dir, err := os.MkdirTemp("/tmp", "ncsi-")
	if err != nil {
		return nil, err
	}
	a := &Agent{
		Root:         root,
		Dir:          dir,
		DataDir:      filepath.Join(dir, "data"),
		DriverRoot:   filepath.Join(dir, "csi"),
		ConfigPath:   filepath.Join(dir, "agent.hcl"),
		LogPath:      filepath.Join(dir, "agent.log"),
		opts:         opts,
		cgroupParent: "ncsi-e2e-" + filepath.Base(dir)[len("ncsi-"):],
		http:         &http.Client{Timeout: 15 * time.Second},
		children:     map[int]string{},
	}
	if err := a.setup(); err != nil {
		tail := a.LogTail(60)
		a.Close()
		return nil, fmt.Errorf("%w\nagent log tail:\n%s", err, tail)
	}
	return a, nil
}

func (a *Agent) setup() error {
	for _, d := range []string{a.DataDir, a.DriverRoot, filepath.Join(a.Dir, "jobs")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return err
		}
	}
	ports, err := freePorts(6)
	if err != nil {
		return err
	}
	plugins := "-plugin-dir=" + PluginDir(a.Root)
	cfg := agentConfig{
		Name:            filepath.Base(a.Dir),
		HTTP:            ports[0],
		RPC:             ports[1],
		Serf:            ports[2],
		Client:          true,
		CgroupParent:    a.cgroupParent,
		AllowPrivileged: a.opts.AllowPrivileged,
		DriverRoot:      a.DriverRoot,
		Extra:           a.opts.ExtraConfig,
	}
	if !a.opts.Persistent {
		cfg.Server = true
		a.Addr = fmt.Sprintf("http://127.0.0.1:%d", cfg.HTTP)
		if err := writeAgentConfig(a.ConfigPath, cfg); err != nil {
			return err
		}
		a.client = &proc{name: "agent", logPath: a.LogPath, args: []string{"agent", "-dev", "-bind=127.0.0.1",
			plugins, "-data-dir=" + a.DataDir, "-config=" + a.ConfigPath}}
		if err := a.startProc(a.client); err != nil {
			return err
		}
		return a.waitReady(90 * time.Second)
	}

	// Persistent: a server first, ready with a leader and a keyring, then a
	// client that registers with it at once.
	srv := agentConfig{Name: cfg.Name + "-server", HTTP: ports[3], RPC: ports[4], Serf: ports[5], Server: true}
	srvDir := filepath.Join(a.Dir, "server")
	srvConfig := filepath.Join(a.Dir, "server.hcl")
	if err := os.MkdirAll(srvDir, 0o700); err != nil {
		return err
	}
	if err := writeAgentConfig(srvConfig, srv); err != nil {
		return err
	}
	a.server = &proc{name: "server", logPath: filepath.Join(a.Dir, "server.log"), args: []string{"agent",
		"-bind=127.0.0.1", "-data-dir=" + srvDir, "-config=" + srvConfig}}
	if err := a.startProc(a.server); err != nil {
		return err
	}
	a.Addr = fmt.Sprintf("http://127.0.0.1:%d", srv.HTTP)
	if err := a.waitServer(60 * time.Second); err != nil {
		return err
	}
	cfg.Servers = fmt.Sprintf("127.0.0.1:%d", srv.RPC)
	if err := writeAgentConfig(a.ConfigPath, cfg); err != nil {
		return err
	}
	a.client = &proc{name: "client", logPath: a.LogPath, args: []string{"agent", "-bind=127.0.0.1",
		plugins, "-data-dir=" + a.DataDir, "-config=" + a.ConfigPath}}
	if err := a.startProc(a.client); err != nil {
		return err
	}
	return a.waitReady(90 * time.Second)
}

func freePorts(n int) ([]int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("failed to find a free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

type agentConfig struct {
	Name            string
	HTTP, RPC, Serf int
	Server          bool
	Client          bool
	Servers         string // a client-only agent's server RPC address
	CgroupParent    string
	AllowPrivileged bool
	DriverRoot      string
	Extra           string
}

const agentConfigTemplate = `# generated by the nomad-driver-csi e2e harness
name                 = "e2e-{{.Name}}"
bind_addr            = "127.0.0.1"
log_level            = "DEBUG"
disable_update_check = true

advertise {
  http = "127.0.0.1"
  rpc  = "127.0.0.1"
  serf = "127.0.0.1"
}

ports {
  http = {{.HTTP}}
  rpc  = {{.RPC}}
  serf = {{.Serf}}
}
{{if .Server}}
server {
  enabled          = true
  bootstrap_expect = 1
}
{{end}}
client {
  enabled = {{.Client}}
{{- if .Servers}}
  servers = ["{{.Servers}}"]
{{- end}}
{{- if .Client}}
  network_interface = "lo"
  cgroup_parent     = "{{.CgroupParent}}"
{{- end}}
  options {
    "fingerprint.denylist" = "env_aws,env_gce,env_azure,env_digitalocean"
  }
}
{{if .Client}}
plugin "raw_exec" {
  config {
    enabled = true
  }
}

plugin "csi" {
  config {
    enabled          = true
    allow_privileged = {{.AllowPrivileged}}
    root_dir         = "{{.DriverRoot}}"
  }
}
{{.Extra}}
{{end}}`

func writeAgentConfig(path string, cfg agentConfig) error {
	var buf bytes.Buffer
	if err := template.Must(template.New("agent").Parse(agentConfigTemplate)).Execute(&buf, cfg); err != nil {
		return err
	}
	return os.WriteFile(path, buf.Bytes(), 0o600)
}

// startProc starts one agent process, its output appended to its log.
func (a *Agent) startProc(p *proc) error {
	logFile, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	fmt.Fprintf(logFile, "==== harness: starting %s %s at %s\n", NomadBinary(a.Root), strings.Join(p.args, " "), time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(NomadBinary(a.Root), p.args...)
	cmd.Dir = a.Dir
	cmd.Env = cleanEnv()
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	// Its own process group: a ^C to the test must not reach it before the
	// harness has stopped its jobs.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return fmt.Errorf("failed to start %s: %w", NomadBinary(a.Root), err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	a.mu.Lock()
	p.cmd, p.exited, p.logFile = cmd, exited, logFile
	a.mu.Unlock()
	a.opts.Logf("started nomad %s pid=%d dir=%s", p.name, cmd.Process.Pid, a.Dir)
	return nil
}

// stopProc sends SIGINT to an agent process by PID and waits up to grace
// for it to exit, then sends SIGKILL.
func (a *Agent) stopProc(p *proc, grace time.Duration) error {
	a.mu.Lock()
	cmd, exited, logFile := p.cmd, p.exited, p.logFile
	p.cmd, p.logFile = nil, nil
	a.mu.Unlock()
	if cmd == nil {
		return nil
	}
	pid := cmd.Process.Pid
	a.opts.Logf("stopping nomad %s pid=%d", p.name, pid)
	_ = unix.Kill(pid, unix.SIGINT)
	var err error
	select {
	case <-exited:
	case <-time.After(grace):
		err = fmt.Errorf("nomad %s pid=%d did not stop within %v of SIGINT; killed it", p.name, pid, grace)
		_ = unix.Kill(pid, unix.SIGKILL)
		<-exited
	}
	if logFile != nil {
		fmt.Fprintf(logFile, "==== harness: %s pid=%d stopped at %s\n", p.name, pid, time.Now().Format(time.RFC3339Nano))
		logFile.Close()
	}
	return err
}

func (p *proc) pid() int {
	if p == nil || p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	select {
	case <-p.exited:
		return 0
	default:
	}
	return p.cmd.Process.Pid
}

// cleanEnv is the test's environment without NOMAD_* variables (a token or
// address from the caller's shell must not leak in) and without
// AWS_CA_BUNDLE, which makes the agent fail at start.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "NOMAD_") || strings.HasPrefix(kv, "AWS_CA_BUNDLE=") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

// PID is the process ID of the agent that runs the tasks (0 when it is not
// running).
func (a *Agent) PID() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.client.pid()
}

func (a *Agent) clientExited() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.client == nil || a.client.exited == nil {
		ch := make(chan struct{})
		close(ch)
		return ch
	}
	return a.client.exited
}

// waitServer waits for the server agent to lead and to have a keyring (a
// client that registers before the keyring exists retries only after 15s).
func (a *Agent) waitServer(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	last := "no answer from the server yet"
	for time.Now().Before(deadline) {
		if a.server.pid() == 0 {
			return fmt.Errorf("the server agent exited while starting (see %s)", a.server.logPath)
		}
		var leader string
		var keys []json.RawMessage
		if err := a.GetJSON("/v1/status/leader", &leader); err != nil {
			last = err.Error()
		} else if leader == "" {
			last = "no leader yet"
		} else if err := a.GetJSON("/v1/operator/keyring/keys", &keys); err != nil {
			last = err.Error()
		} else if len(keys) == 0 {
			last = "no keyring yet"
		} else {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("the server agent at %s was not ready within %v: %s", a.Addr, timeout, last)
}

// waitReady polls /v1/nodes until the client's node is ready, has
// registered since the client (re)started, and every wanted driver is
// detected and healthy.
func (a *Agent) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	exited := a.clientExited()
	last := "no answer from the agent yet"
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return fmt.Errorf("the agent exited while starting (see %s)", a.LogPath)
		default:
		}
		var nodes []NodeStub
		if err := a.GetJSON("/v1/nodes", &nodes); err != nil {
			last = err.Error()
		} else if len(nodes) == 0 {
			last = "no node registered yet"
		} else {
			n := nodes[0]
			missing := a.missingDrivers(n.Drivers)
			switch {
			case n.Status != "ready":
				last = fmt.Sprintf("node %s is %q", n.ID, n.Status)
			case a.NodeID != "" && !a.registeredAgain():
				last = fmt.Sprintf("node %s has not registered again since the restart", n.ID)
			case len(missing) > 0:
				last = fmt.Sprintf("node %s is ready but drivers are not healthy: %s", n.ID, strings.Join(missing, "; "))
			default:
				a.NodeID = n.ID
				a.recordChildren()
				return nil
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
	return fmt.Errorf("the agent at %s was not ready within %v: %s", a.Addr, timeout, last)
}

// registeredAgain tells whether the current client process has registered
// with the server, from its log (the server's view of a node stays "ready"
// for a while after the client stopped).
func (a *Agent) registeredAgain() bool {
	b, err := os.ReadFile(a.LogPath)
	if err != nil {
		return false
	}
	// Only the part written by the current process.
	s := string(b)
	if i := strings.LastIndex(s, "==== harness: starting"); i >= 0 {
		s = s[i:]
	}
	return strings.Contains(s, "client: node registration complete")
}

func (a *Agent) missingDrivers(drivers map[string]*DriverInfo) []string {
	var missing []string
	for _, name := range a.opts.Drivers {
		d := drivers[name]
		switch {
		case d == nil:
			missing = append(missing, name+": not fingerprinted")
		case !d.Detected:
			missing = append(missing, fmt.Sprintf("%s: not detected (%s)", name, d.HealthDescription))
		case !d.Healthy:
			missing = append(missing, fmt.Sprintf("%s: unhealthy (%s)", name, d.HealthDescription))
		}
	}
	return missing
}

// Restart stops the agent that runs the tasks with SIGINT, waits for it,
// and starts it again with the same data dir, configuration and ports,
// then waits until it has registered again. With Persistent, the server
// keeps running and the tasks must survive.
func (a *Agent) Restart() error {
	if err := a.Stop(30 * time.Second); err != nil {
		return err
	}
	if err := a.startProc(a.client); err != nil {
		return err
	}
	return a.waitReady(90 * time.Second)
}

// Stop stops the agent that runs the tasks (SIGINT by PID, SIGKILL after
// grace). Tasks of a Persistent agent keep running.
func (a *Agent) Stop(grace time.Duration) error {
	a.recordChildren()
	return a.stopProc(a.client, grace)
}

// recordChildren remembers the client's child processes (the plugin
// processes, executors, log monitors) so that Close can kill any that
// outlive it.
func (a *Agent) recordChildren() {
	pid := a.PID()
	if pid == 0 {
		return
	}
	for _, p := range listProcs() {
		if p.PPID == pid {
			a.mu.Lock()
			a.children[p.PID] = p.Comm
			a.mu.Unlock()
		}
	}
}

// Close stops every job, the agents, and every process, mount and cgroup
// the test left, then removes the temporary directory (kept when E2E_KEEP
// is set). It is safe to call more than once.
func (a *Agent) Close() {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return
	}
	a.closed = true
	jobs := append([]string(nil), a.jobs...)
	a.mu.Unlock()

	if a.PID() != 0 {
		a.stopJobs(jobs, 60*time.Second)
	}
	if a.client != nil {
		if err := a.Stop(30 * time.Second); err != nil {
			a.opts.Logf("%v", err)
		}
	}
	if a.server != nil {
		if err := a.stopProc(a.server, 30*time.Second); err != nil {
			a.opts.Logf("%v", err)
		}
	}
	a.killLeftovers()
	a.removeCgroups()
	if err := UnmountUnder(a.Dir); err != nil {
		a.opts.Logf("mounts left under %s, not removing it: %v", a.Dir, err)
		return
	}
	if os.Getenv("E2E_KEEP") != "" {
		a.opts.Logf("E2E_KEEP set: keeping %s", a.Dir)
		return
	}
	if err := os.RemoveAll(a.Dir); err != nil {
		a.opts.Logf("failed to remove %s: %v", a.Dir, err)
	}
}

// stopJobs stops the jobs, waits for their allocations to finish, and
// purges them.
func (a *Agent) stopJobs(jobs []string, timeout time.Duration) {
	for _, id := range jobs {
		_ = a.do(http.MethodDelete, "/v1/job/"+url.PathEscape(id), nil, nil)
	}
	deadline := time.Now().Add(timeout)
	for _, id := range jobs {
		for time.Now().Before(deadline) {
			allocs, err := a.JobAllocations(id)
			if err != nil || allTerminal(allocs) {
				break
			}
			time.Sleep(250 * time.Millisecond)
		}
		_ = a.do(http.MethodDelete, "/v1/job/"+url.PathEscape(id)+"?purge=true", nil, nil)
	}
}

func allTerminal(allocs []AllocStub) bool {
	for _, al := range allocs {
		if !IsTerminal(al.ClientStatus) {
			return false
		}
	}
	return true
}

// IsTerminal tells whether an allocation client status is final.
func IsTerminal(status string) bool {
	return status == StatusComplete || status == StatusFailed || status == StatusLost
}

// LogTail returns the last n lines of the log of the agent that runs the
// tasks (and of the server, in Persistent mode).
func (a *Agent) LogTail(n int) string {
	out := tailFile(a.LogPath, n)
	if a.server != nil {
		out += "\n---- server log tail (" + a.server.logPath + "):\n" + tailFile(a.server.logPath, n/4)
	}
	return out
}

func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Log returns the whole log of the agent that runs the tasks.
func (a *Agent) Log() string {
	b, _ := os.ReadFile(a.LogPath)
	return string(b)
}

// ---- HTTP API ----

// DriverInfo is a node's view of one driver.
type DriverInfo struct {
	Attributes        map[string]string
	Detected          bool
	Healthy           bool
	HealthDescription string
}

// NodeStub is an entry of /v1/nodes.
type NodeStub struct {
	ID              string
	Name            string
	Status          string
	StatusUpdatedAt int64
	Drivers         map[string]*DriverInfo
}

// Node is /v1/node/<id>.
type Node struct {
	ID         string
	Name       string
	Status     string
	Attributes map[string]string
	Drivers    map[string]*DriverInfo
}

// TaskEvent is one event of a task.
type TaskEvent struct {
	Type            string
	Time            int64
	DisplayMessage  string
	Details         map[string]string
	ExitCode        int
	Signal          int
	Message         string
	DriverError     string
	KillError       string
	SetupError      string
	ValidationError string
	DriverMessage   string
	RestartReason   string
}

// Text is everything an operator could read about the event.
func (e TaskEvent) Text() string {
	parts := []string{e.Type, e.DisplayMessage, e.Message, e.DriverError, e.KillError,
		e.SetupError, e.ValidationError, e.DriverMessage, e.RestartReason}
	keys := make([]string, 0, len(e.Details))
	for k := range e.Details {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		parts = append(parts, k+"="+e.Details[k])
	}
	var nonEmpty []string
	for _, p := range parts {
		if p != "" {
			nonEmpty = append(nonEmpty, p)
		}
	}
	return strings.Join(nonEmpty, " | ")
}

// TaskState is a task's state inside an allocation.
type TaskState struct {
	State      string
	Failed     bool
	Restarts   uint64
	StartedAt  time.Time
	FinishedAt time.Time
	Events     []TaskEvent
}

// AllocStub is an entry of /v1/job/<id>/allocations.
type AllocStub struct {
	ID            string
	Name          string
	JobID         string
	TaskGroup     string
	ClientStatus  string
	DesiredStatus string
	CreateIndex   uint64
	TaskStates    map[string]*TaskState
}

// Allocation is /v1/allocation/<id>.
type Allocation struct {
	ID                 string
	Name               string
	JobID              string
	NodeID             string
	ClientStatus       string
	ClientDescription  string
	DesiredStatus      string
	DesiredDescription string
	TaskStates         map[string]*TaskState
}

// Events returns the events of one task ("" for the only task).
func (al *Allocation) Events(task string) []TaskEvent {
	if ts := al.Task(task); ts != nil {
		return ts.Events
	}
	return nil
}

// Task returns one task's state ("" for the only task).
func (al *Allocation) Task(task string) *TaskState {
	if task == "" && len(al.TaskStates) == 1 {
		for _, ts := range al.TaskStates {
			return ts
		}
	}
	return al.TaskStates[task]
}

// Describe renders the allocation's status and events for failure messages.
func (al *Allocation) Describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "alloc %s (%s): client_status=%s %s desired=%s\n", al.ID, al.Name, al.ClientStatus, al.ClientDescription, al.DesiredStatus)
	names := make([]string, 0, len(al.TaskStates))
	for n := range al.TaskStates {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		ts := al.TaskStates[n]
		fmt.Fprintf(&b, "  task %s: state=%s failed=%v restarts=%d\n", n, ts.State, ts.Failed, ts.Restarts)
		for _, e := range ts.Events {
			fmt.Fprintf(&b, "    %s  %s\n", time.Unix(0, e.Time).Format("15:04:05.000"), e.Text())
		}
	}
	return b.String()
}

// GetJSON decodes the answer to GET path.
func (a *Agent) GetJSON(path string, out any) error {
	return a.do(http.MethodGet, path, nil, out)
}

// PutJSON sends body as JSON with PUT/POST and decodes the answer.
func (a *Agent) PutJSON(method, path string, body, out any) error {
	return a.do(method, path, body, out)
}

func (a *Agent) do(method, path string, body, out any) error {
	var r io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, a.Addr+path, r)
	if err != nil {
		return err
	}
	resp, err := a.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, strings.TrimSpace(string(b)))
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("%s %s: failed to decode the answer: %w", method, path, err)
	}
	return nil
}

// Node returns the agent's node.
func (a *Agent) Node(t testing.TB) *Node {
	t.Helper()
	var n Node
	if err := a.GetJSON("/v1/node/"+a.NodeID, &n); err != nil {
		t.Fatalf("failed to read node %s: %v", a.NodeID, err)
	}
	return &n
}

// JobAllocations lists a job's allocations, newest first.
func (a *Agent) JobAllocations(jobID string) ([]AllocStub, error) {
	var allocs []AllocStub
	if err := a.GetJSON("/v1/job/"+url.PathEscape(jobID)+"/allocations", &allocs); err != nil {
		return nil, err
	}
	sort.Slice(allocs, func(i, j int) bool { return allocs[i].CreateIndex > allocs[j].CreateIndex })
	return allocs, nil
}

// Allocation reads one allocation.
func (a *Agent) Allocation(t testing.TB, allocID string) *Allocation {
	t.Helper()
	al, err := a.allocation(allocID)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return al
}

func (a *Agent) allocation(allocID string) (*Allocation, error) {
	var al Allocation
	if err := a.GetJSON("/v1/allocation/"+allocID, &al); err != nil {
		return nil, fmt.Errorf("failed to read allocation %s: %w", allocID, err)
	}
	return &al, nil
}

// ---- jobs ----

// Job is a job the harness submitted.
type Job struct {
	ID   string
	File string // the rendered job file
}

// JobData is what a job template sees.
type JobData struct {
	JobID string
	Vars  map[string]string
}

// RenderJob renders e2e/jobs/<name>.hcl with a new unique job ID and
// returns the job and the path of the rendered file. Vars["Driver"]
// defaults to "csi".
func (a *Agent) RenderJob(name string, vars map[string]string) (Job, error) {
	src := filepath.Join(a.Root, "e2e", "jobs", name+".hcl")
	text, err := os.ReadFile(src)
	if err != nil {
		return Job{}, err
	}
	tmpl, err := template.New(name).Option("missingkey=error").Parse(string(text))
	if err != nil {
		return Job{}, fmt.Errorf("failed to parse job template %s: %w", src, err)
	}
	id := fmt.Sprintf("%s-%s", name, strconv.FormatInt(time.Now().UnixNano()%1e12, 36))
	data := JobData{JobID: id, Vars: map[string]string{"Driver": DriverName}}
	for k, v := range vars {
		data.Vars[k] = v
	}
	var buf bytes.Buffer
	if err := tmpl.Execute(&buf, data); err != nil {
		return Job{}, fmt.Errorf("failed to render job template %s: %w", src, err)
	}
	file := filepath.Join(a.Dir, "jobs", id+".hcl")
	if err := os.WriteFile(file, buf.Bytes(), 0o600); err != nil {
		return Job{}, err
	}
	return Job{ID: id, File: file}, nil
}

// SubmitJob renders and runs a job with "nomad job run -detach" and
// returns the CLI's output and error without failing the test; the job is
// stopped and purged on Close.
func (a *Agent) SubmitJob(t testing.TB, name string, vars map[string]string) (Job, string, error) {
	t.Helper()
	job, err := a.RenderJob(name, vars)
	if err != nil {
		t.Fatalf("%v", err)
	}
	a.mu.Lock()
	a.jobs = append(a.jobs, job.ID)
	a.mu.Unlock()
	out, err := a.Nomad("job", "run", "-detach", job.File)
	return job, out, err
}

// RunJob is SubmitJob that fails the test when the submission fails.
func (a *Agent) RunJob(t testing.TB, name string, vars map[string]string) Job {
	t.Helper()
	job, out, err := a.SubmitJob(t, name, vars)
	if err != nil {
		t.Fatalf("nomad job run %s failed: %v\n%s", job.File, err, out)
	}
	return job
}

// StopJob stops a job with "nomad job stop" (without purging it, so its
// allocations stay readable).
func (a *Agent) StopJob(t testing.TB, jobID string) {
	t.Helper()
	if out, err := a.Nomad("job", "stop", "-detach", jobID); err != nil {
		t.Fatalf("nomad job stop %s failed: %v\n%s", jobID, err, out)
	}
}

// Nomad runs the nomad CLI against the agent and returns its combined
// output.
func (a *Agent) Nomad(args ...string) (string, error) {
	return a.NomadContext(context.Background(), args...)
}

// NomadContext is Nomad with a context; a call never runs longer than two
// minutes.
func (a *Agent) NomadContext(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, NomadBinary(a.Root), args...)
	cmd.Env = append(cleanEnv(), "NOMAD_ADDR="+a.Addr, "NOMAD_CLI_NO_COLOR=1")
	cmd.Stdin = nil
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// WaitAlloc waits for the job's newest allocation to reach one of the
// wanted client statuses and returns it. It fails the test at once when
// the allocation reaches a terminal status it did not want.
func (a *Agent) WaitAlloc(t testing.TB, jobID string, timeout time.Duration, want ...string) *Allocation {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last *Allocation
	for time.Now().Before(deadline) {
		allocs, err := a.JobAllocations(jobID)
		if err == nil && len(allocs) > 0 {
			al, err := a.allocation(allocs[0].ID)
			if err == nil {
				last = al
				if wanted(al.ClientStatus, want) {
					return al
				}
				if IsTerminal(al.ClientStatus) {
					t.Fatalf("allocation of job %s is %s, wanted %v:\n%s", jobID, al.ClientStatus, want, al.Describe())
				}
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	if last == nil {
		t.Fatalf("job %s has no allocation after %v", jobID, timeout)
	}
	t.Fatalf("allocation of job %s did not become %v within %v:\n%s", jobID, want, timeout, last.Describe())
	return nil
}

// WaitAllocID waits for one allocation to reach a wanted client status.
func (a *Agent) WaitAllocID(t testing.TB, allocID string, timeout time.Duration, want ...string) *Allocation {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last *Allocation
	for time.Now().Before(deadline) {
		al, err := a.allocation(allocID)
		if err == nil {
			last = al
			if wanted(al.ClientStatus, want) {
				return al
			}
			if IsTerminal(al.ClientStatus) {
				t.Fatalf("allocation %s is %s, wanted %v:\n%s", allocID, al.ClientStatus, want, al.Describe())
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	if last == nil {
		t.Fatalf("allocation %s could not be read within %v", allocID, timeout)
	}
	t.Fatalf("allocation %s did not become %v within %v:\n%s", allocID, want, timeout, last.Describe())
	return nil
}

func wanted(s string, want []string) bool {
	for _, w := range want {
		if s == w {
			return true
		}
	}
	return false
}

// WaitEvent waits for a task event of the given type and returns it.
func (a *Agent) WaitEvent(t testing.TB, allocID, task, eventType string, timeout time.Duration) TaskEvent {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last *Allocation
	for time.Now().Before(deadline) {
		al, err := a.allocation(allocID)
		if err == nil {
			last = al
			for _, e := range al.Events(task) {
				if e.Type == eventType {
					return e
				}
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	desc := "(allocation unreadable)"
	if last != nil {
		desc = last.Describe()
	}
	t.Fatalf("no %q event for task %q of allocation %s within %v:\n%s", eventType, task, allocID, timeout, desc)
	return TaskEvent{}
}

// AllocLogs reads a task's stdout (or stderr) with "nomad alloc logs".
func (a *Agent) AllocLogs(t testing.TB, allocID, task string, stderr bool) string {
	t.Helper()
	args := []string{"alloc", "logs"}
	if stderr {
		args = append(args, "-stderr")
	}
	args = append(args, allocID, task)
	out, err := a.Nomad(args...)
	if err != nil {
		t.Fatalf("nomad alloc logs %s %s failed: %v\n%s", allocID, task, err, out)
	}
	return out
}

// WaitLogs waits until a task's stdout contains substr and returns it.
func (a *Agent) WaitLogs(t testing.TB, allocID, task, substr string, timeout time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var out string
	for time.Now().Before(deadline) {
		o, err := a.Nomad("alloc", "logs", allocID, task)
		if err == nil {
			out = o
			if strings.Contains(out, substr) {
				return out
			}
		} else {
			out = o + err.Error()
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Fatalf("stdout of task %s in allocation %s did not contain %q within %v; it was:\n%s", task, allocID, substr, timeout, out)
	return ""
}

// AllocExec runs a command in a running task with "nomad alloc exec"
// (no TTY, no stdin) and returns its output.
func (a *Agent) AllocExec(allocID, task string, command ...string) (string, error) {
	args := append([]string{"alloc", "exec", "-i=false", "-t=false", "-task", task, allocID}, command...)
	return a.Nomad(args...)
}

// ---- processes ----

// Proc is one process from /proc.
type Proc struct {
	PID  int
	PPID int
	Comm string
}

func listProcs() []Proc {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var procs []Proc
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		p, err := ReadProc(pid)
		if err == nil {
			procs = append(procs, p)
		}
	}
	return procs
}

// ReadProc reads a process's name and parent from /proc/PID/status.
func ReadProc(pid int) (Proc, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Proc{}, err
	}
	defer f.Close()
	p := Proc{PID: pid}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Name":
			p.Comm = v
		case "PPid":
			p.PPID, _ = strconv.Atoi(v)
		}
	}
	return p, sc.Err()
}

// StatusField reads one field of /proc/PID/status ("VmRSS" -> "1234 kB").
func StatusField(pid int, field string) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && k == field {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

// Children lists the agent's current child processes.
func (a *Agent) Children() []Proc {
	pid := a.PID()
	if pid == 0 {
		return nil
	}
	var out []Proc
	for _, p := range listProcs() {
		if p.PPID == pid {
			out = append(out, p)
		}
	}
	return out
}

// DriverPluginPID is the PID of the agent's nomad-driver-csi plugin
// process (0 when there is none).
func (a *Agent) DriverPluginPID() int {
	for _, p := range a.Children() {
		// comm is cut at 15 bytes: "nomad-driver-cs".
		if strings.HasPrefix("nomad-driver-csi", p.Comm) && len(p.Comm) >= 12 {
			return p.PID
		}
	}
	return 0
}

// TaskPIDs finds the host PIDs of the processes of one allocation's task:
// those whose environment holds NOMAD_ALLOC_ID=<alloc> and
// NOMAD_TASK_NAME=<task>, excluding "nomad alloc exec" sessions' parents.
func TaskPIDs(allocID, task string) []int {
	var pids []int
	self := os.Getpid()
	for _, p := range listProcs() {
		if p.PID == self {
			continue
		}
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", p.PID))
		if err != nil {
			continue
		}
		vars := strings.Split(string(env), "\x00")
		if contains(vars, "NOMAD_ALLOC_ID="+allocID) && contains(vars, "NOMAD_TASK_NAME="+task) {
			pids = append(pids, p.PID)
		}
	}
	sort.Ints(pids)
	return pids
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// allocIDs lists the allocations this agent ever placed (the directories
// of its alloc dir).
func (a *Agent) allocIDs() []string {
	var ids []string
	for _, dir := range []string{filepath.Join(a.DataDir, "alloc")} {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if e.IsDir() && len(e.Name()) == 36 {
				ids = append(ids, e.Name())
			}
		}
	}
	return ids
}

// killLeftovers SIGKILLs, by PID, every process that belongs to this
// agent's test: a remembered child of the agent, or a process whose
// command line, working directory, environment or cgroup names the
// temporary directory or one of the agent's allocations.
func (a *Agent) killLeftovers() {
	self := os.Getpid()
	ancestors := map[int]bool{}
	for pid := self; pid > 1; {
		ancestors[pid] = true
		p, err := ReadProc(pid)
		if err != nil {
			break
		}
		pid = p.PPID
	}
	ids := a.allocIDs()
	a.mu.Lock()
	children := map[int]string{}
	for k, v := range a.children {
		children[k] = v
	}
	a.mu.Unlock()

	for round := 0; round < 3; round++ {
		var victims []int
		for _, p := range listProcs() {
			if ancestors[p.PID] || p.PID == 1 {
				continue
			}
			if comm, ok := children[p.PID]; ok && comm == p.Comm {
				victims = append(victims, p.PID)
				continue
			}
			if a.belongs(p.PID, ids) {
				victims = append(victims, p.PID)
			}
		}
		if len(victims) == 0 {
			return
		}
		for _, pid := range victims {
			a.opts.Logf("killing leftover process pid=%d", pid)
			_ = unix.Kill(pid, unix.SIGKILL)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func (a *Agent) belongs(pid int, allocIDs []string) bool {
	marks := append([]string{a.Dir + "/"}, allocIDs...)
	var texts []string
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil {
		texts = append(texts, string(b))
	}
	if cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid)); err == nil {
		texts = append(texts, cwd+"/")
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid)); err == nil {
		texts = append(texts, string(b))
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err == nil {
		texts = append(texts, string(b))
	}
	for _, s := range texts {
		for _, m := range marks {
			if strings.Contains(s, m) {
				return true
			}
		}
	}
	return false
}

// removeCgroups removes (rmdir, deepest first) the agent's own cgroup
// parent and any empty cgroup named after one of its allocations. rmdir
// only removes empty groups, so a live group is never touched.
func (a *Agent) removeCgroups() {
	ids := a.allocIDs()
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	var dirs []string
	for _, root := range roots {
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return nil
			}
			rel, _ := filepath.Rel(root, p)
			if strings.Count(rel, "/") > 4 {
				return filepath.SkipDir
			}
			base := filepath.Base(p)
			if strings.Contains(p, "/"+a.cgroupParent) {
				dirs = append(dirs, p)
				return nil
			}
			for _, id := range ids {
				if strings.Contains(base, id) {
					dirs = append(dirs, p)
					break
				}
			}
			return nil
		})
	}
	sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
	for _, d := range dirs {
		_ = unix.Rmdir(d)
	}
}

// ---- mounts ----

// MountsUnder lists the mount points at or below dir, from
// /proc/self/mountinfo, deepest first.
func MountsUnder(dir string) ([]string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	dir = filepath.Clean(dir)
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMountPath(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, nil
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// UnmountUnder unmounts everything at or below dir, deepest first,
// lazily when a mount is busy, and reports what is still mounted.
func UnmountUnder(dir string) error {
	for round := 0; round < 5; round++ {
		mounts, err := MountsUnder(dir)
		if err != nil {
			return err
		}
		if len(mounts) == 0 {
			return nil
		}
		for _, mp := range mounts {
			if err := unix.Unmount(mp, 0); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				_ = unix.Unmount(mp, unix.MNT_DETACH)
			}
		}
	}
	mounts, err := MountsUnder(dir)
	if err != nil {
		return err
	}
	if len(mounts) > 0 {
		return fmt.Errorf("still mounted: %s", strings.Join(mounts, ", "))
	}
	return nil
}
