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
//
// They need root and build/nomad. TestMain builds the driver into
// build/plugins first. Environment knobs:
//
//	E2E_SKIP_BUILD=1     use the driver already in build/plugins
//	E2E_NOMAD_BIN=FILE   run this Nomad agent instead of build/nomad (make
//	                     e2e-matrix: one Nomad minor line at a time)
//	E2E_PLUGIN_DIR=DIR   load the driver from DIR instead of build/plugins
//	                     (with E2E_SKIP_BUILD: make e2e-cgroup2 puts a
//	                     test build of the driver there)
//	E2E_KEEP=1           keep each agent's /tmp/ncsi-* directory (mounts
//	                     are still removed)
//	E2E_DRIVER=raw_exec  run the driver-neutral cases on one of Nomad's
//	                     own drivers, to check the harness itself
//
// The cases share one -dev agent (see shared in main_test.go); the restart
// case starts its own Persistent agent (a server agent plus a client agent)
// because a -dev agent keeps no state across a restart and destroys its
// allocations when it stops.
package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"text/template"
	"time"

	"github.com/hashicorp/nomad/api"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
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

// NomadBinary is the pinned agent binary, built by "make nomad", or
// E2E_NOMAD_BIN: make e2e-matrix runs the core cases against each Nomad of
// its matrix this way.
func NomadBinary(root string) string {
	if bin := os.Getenv("E2E_NOMAD_BIN"); bin != "" {
		return bin
	}
	return filepath.Join(root, "build", "nomad")
}

// PluginDir is the directory the driver is built into, or E2E_PLUGIN_DIR.
func PluginDir(root string) string {
	if dir := os.Getenv("E2E_PLUGIN_DIR"); dir != "" {
		return dir
	}
	return filepath.Join(root, "build", "plugins")
}

// CSIBinDir is where e2e/tools/build.sh puts the CSI binaries.
func CSIBinDir(root string) string { return filepath.Join(root, "build", "csi") }

// TaskCSIBinDir is where a task that is not privileged finds the CSI
// binaries: the agents' chroot_env binds CSIBinDir there, as an operator
// names the directory its plugins are installed in. (A privileged task
// sees the host's paths.) A fixed path, since the checkout may be under
// /tmp, which is the task's own.
const TaskCSIBinDir = "/opt/nomad-driver-csi-e2e/csi"

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
	// make dev builds the supervisor shim the driver embeds, as users get it.
	cmd := exec.Command("make", "-s", "dev")
	cmd.Dir = root
	b, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("failed to build the driver into %s: %w\n%s", out, err, b)
	}
	return nil
}

// OperatorPluginJobs are the jobs that play the operator's own plugin jobs
// in the tests: the job templates of e2e/jobs (RenderJob names a job after
// its template: "<template>-<suffix>") and the example plugin jobs. An
// agent with AllowPrivileged grants them privilege (OperatorGrants), as an
// operator grants the plugin jobs they run; a job of an attack uses
// another template and is granted nothing.
var OperatorPluginJobs = []string{
	"plugin_task-*", "plugin_propagation-*", "plugin_native-*", "volume_plugin-*",
	"native_plugin-*", "native_managed_plugin-*", "cluster_plugin-*", "cluster_plugin_native-*",
	"escape-privileged-plugin-*", "csi-plugin", "csi-fixture-plugin",
}

// OperatorGrants renders a privileged_grant block (namespace "*") for each
// of OperatorPluginJobs.
func OperatorGrants() string {
	var b strings.Builder
	for _, job := range OperatorPluginJobs {
		fmt.Fprintf(&b, "    privileged_grant {\n      namespace = \"*\"\n      job       = %q\n    }\n", job)
	}
	return b.String()
}

// AgentOptions shape the agent's configuration.
type AgentOptions struct {
	// AllowPrivileged sets the csi plugin's allow_privileged and grants
	// the operator's plugin jobs privilege (OperatorGrants).
	AllowPrivileged bool
	// Grants are more privileged_grant blocks (HCL) for the csi plugin's
	// config, beyond OperatorGrants.
	Grants string
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
	// ClientConfig is added inside the client block (cni_path,
	// bridge_network_name, ...).
	ClientConfig string
	// DriverRoot replaces the csi driver's root_dir (default Dir/csi).
	DriverRoot string
	// DriverConfig is added inside the csi driver's config block
	// (plugin_socket_dirs, privileged_plugins_only, ...). Set driver
	// options here rather than with a second plugin block in ExtraConfig:
	// that block would replace the harness's, and with it the cgroup_parent
	// unique to this agent.
	DriverConfig string
	// Logf receives the harness's progress messages (may be nil).
	Logf func(format string, args ...any)
	// Env is added to the agents' environment (KEY=VALUE), which Nomad
	// passes on to the driver plugin.
	Env []string
	// Prepare runs once the agent's directories exist, before any agent
	// starts (the fault suite mounts a small file system on DriverRoot).
	Prepare func(a *Agent) error
	// PluginDir is the client's plugin_dir; empty means PluginDir(root).
	PluginDir string
	// Systemd runs the client agent of a Persistent agent as a systemd
	// unit made from examples/systemd/nomad-client.service: Restart is
	// "systemctl restart", Stop "systemctl stop" (see systemd.go).
	// E2E_SYSTEMD=1 sets it for every Persistent agent.
	Systemd bool
	// Join runs only a client agent, which registers with Join's server
	// (Join must be Persistent); its API address is that server's. A
	// cluster is a Persistent agent and clients joining it (cluster.go).
	Join *Agent
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
	http         *http.Client // GetJSON and PutJSON
	api          *api.Client  // Nomad's API client (Addr)
	stream       *api.Client  // the same without a request timeout, for the event stream
	serverRPC    string       // the server's RPC address (Persistent mode)

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
	// unit is the systemd unit the agent runs as (systemd mode), and
	// stopWatch stops the goroutine that closes exited when it stops.
	unit      string
	stopWatch chan struct{}
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
	// A port the harness found free may be taken before the agent binds
	// it (by another run's agent): start again on other ports then.
	for attempt := 1; ; attempt++ {
		a, err := newAgent(root, opts)
		if err == nil {
			return a, nil
		}
		if !errors.Is(err, errPortTaken) || attempt == agentStartAttempts {
			return nil, err
		}
		opts.Logf("the agent could not bind its ports (attempt %d of %d); starting again on other ports: %v", attempt, agentStartAttempts, err)
	}
}

// agentStartAttempts bounds the starts of an agent whose ports were taken.
const agentStartAttempts = 3

// errPortTaken marks an agent start that failed because one of its ports
// was taken between the harness's check and the agent's bind.
var errPortTaken = errors.New("a port of the agent was taken")

func newAgent(root string, opts AgentOptions) (*Agent, error) {
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
		cgroupParent: cgroupParentOf(dir),
		http:         &http.Client{Timeout: Scaled(15 * time.Second)},
		children:     map[int]string{},
	}
	if opts.DriverRoot != "" {
		a.DriverRoot = opts.DriverRoot
	}
	if err := a.setup(); err != nil {
		tail := a.LogTail(60)
		if portTaken(a.LogPath) || (a.server != nil && portTaken(a.server.logPath)) {
			err = fmt.Errorf("%w: %w", errPortTaken, err)
		}
		a.Close()
		return nil, fmt.Errorf("%w\nagent log tail:\n%s", err, tail)
	}
	return a, nil
}

// cgroupParentOf is the cgroup parent of the agent whose directory is dir:
// Nomad's client puts its tasks' cgroups under it, and the csi driver its
// tasks' under DriverCgroupParent, so that concurrent runs never share a
// group and Close can remove them.
func cgroupParentOf(dir string) string { return "ncsi-e2e-" + filepath.Base(dir)[len("ncsi-"):] }

// DriverCgroupParent is the csi driver's cgroup_parent for this agent.
func (a *Agent) DriverCgroupParent() string { return a.cgroupParent + "-drv" }

// NomadLaysOutCgroups tells whether Nomad manages its tasks' cgroups on
// cgroup v2 here (its share partition exists): the driver then puts each
// task in the group Nomad made for it (NomadTaskCgroup) instead of under
// the driver's own cgroup_parent.
func NomadLaysOutCgroups() bool {
	_, err := os.Stat(filepath.Join("/sys/fs/cgroup", NomadTaskCgroup("", "", false), "..", "cgroup.procs"))
	return err == nil
}

// NomadTaskCgroup is the cgroup v2 group Nomad lays out for a task, as in
// /proc/PID/cgroup: /nomad.slice/share.slice/ALLOC.TASK.scope, or under
// reserve.slice for a task with reserved cores. Nomad 1.11 puts it there
// whatever the client's cgroup_parent, so agents on one host share these
// partitions (and their tasks' groups are told apart by allocation).
func NomadTaskCgroup(allocID, task string, reserved bool) string {
	part := "share.slice"
	if reserved {
		part = "reserve.slice"
	}
	return "/nomad.slice/" + part + "/" + allocID + "." + task + ".scope"
}

// portTaken tells whether an agent's log says it could not bind a port.
func portTaken(logPath string) bool {
	b, err := os.ReadFile(logPath)
	return err == nil && bytes.Contains(b, []byte("address already in use"))
}

func (a *Agent) setup() error {
	for _, d := range []string{a.DataDir, a.DriverRoot, filepath.Join(a.Dir, "jobs")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return err
		}
	}
	if a.opts.Prepare != nil {
		if err := a.opts.Prepare(a); err != nil {
			return err
		}
	}
	ports, err := freePorts(6)
	if err != nil {
		return err
	}
	plugins := "-plugin-dir=" + PluginDir(a.Root)
	if a.opts.PluginDir != "" {
		plugins = "-plugin-dir=" + a.opts.PluginDir
	}
	cfg := agentConfig{
		Name:            filepath.Base(a.Dir),
		HTTP:            ports[0],
		RPC:             ports[1],
		Serf:            ports[2],
		Client:          true,
		CgroupParent:    a.cgroupParent,
		DriverCgroup:    a.DriverCgroupParent(),
		DriverConfig:    a.opts.DriverConfig,
		AllowPrivileged: a.opts.AllowPrivileged,
		Grants:          a.opts.Grants,
		DriverRoot:      a.DriverRoot,
		ChrootEnv:       chrootEnvHCL(map[string]string{CSIBinDir(a.Root): TaskCSIBinDir}),
		Extra:           a.opts.ExtraConfig,
		ClientExtra:     a.opts.ClientConfig,
	}
	if a.opts.AllowPrivileged {
		cfg.Grants = OperatorGrants() + cfg.Grants
	}
	if j := a.opts.Join; j != nil {
		if j.serverRPC == "" {
			return errors.New("AgentOptions.Join must be a Persistent agent, which runs a server")
		}
		if err := a.setAddr(j.Addr); err != nil {
			return err
		}
		cfg.Servers = j.serverRPC
		return a.startClient(cfg, plugins)
	}
	if !a.opts.Persistent {
		cfg.Server = true
		if err := a.setAddr(fmt.Sprintf("http://127.0.0.1:%d", cfg.HTTP)); err != nil {
			return err
		}
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
	if err := a.setAddr(fmt.Sprintf("http://127.0.0.1:%d", srv.HTTP)); err != nil {
		return err
	}
	if err := a.waitServer(60 * time.Second); err != nil {
		return err
	}
	cfg.Servers = fmt.Sprintf("127.0.0.1:%d", srv.RPC)
	a.serverRPC = cfg.Servers
	return a.startClient(cfg, plugins)
}

// startClient starts a client-only agent registering with cfg.Servers and
// waits until its node is ready.
func (a *Agent) startClient(cfg agentConfig, plugins string) error {
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

// NodeName is the name of the agent's client node (the agent's name).
func (a *Agent) NodeName() string { return "e2e-" + filepath.Base(a.Dir) }

// freePorts picks n distinct ports that are free for TCP and UDP (serf
// uses both) on 127.0.0.1. They come from below the kernel's ephemeral
// range, so that no connection the tests or agents make can be given one
// by the kernel between this check and the agent's bind; only another run
// can pick the same port then, and NewAgent starts again when it did.
func freePorts(n int) ([]int, error) {
	low := ephemeralLow()
	const first = 10000
	if low-first < 1000 {
		return nil, fmt.Errorf("no room for agent ports below the ephemeral range starting at %d", low)
	}
	seen := map[int]bool{}
	var ports []int
	for tries := 0; len(ports) < n; tries++ {
		if tries > 1000 {
			return nil, fmt.Errorf("failed to find %d free ports in %d-%d", n, first, low-1)
		}
		p := first + rand.IntN(low-first)
		if seen[p] {
			continue
		}
		seen[p] = true
		if portFree(p) {
			ports = append(ports, p)
		}
	}
	return ports, nil
}

// ephemeralLow is the first port of the kernel's ephemeral range.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 32768
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		return 32768
	}
	return n
}

// portFree tells whether 127.0.0.1:port can be bound for TCP and UDP.
func portFree(port int) bool {
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return false
	}
	defer l.Close()
	u, err := net.ListenPacket("udp", addr)
	if err != nil {
		return false
	}
	u.Close()
	return true
}

type agentConfig struct {
	Name            string
	HTTP, RPC, Serf int
	Server          bool
	Client          bool
	Servers         string // a client-only agent's server RPC address
	CgroupParent    string
	DriverCgroup    string // the csi driver's cgroup_parent
	DriverConfig    string // more of the csi driver's config block
	AllowPrivileged bool
	Grants          string // privileged_grant blocks
	DriverRoot      string
	// ChrootEnv is the driver's chroot_env as HCL: exec's list and the
	// directory of the CSI binaries the tests run as tasks, read-only, as
	// an operator names where the plugins they run are installed.
	ChrootEnv   string
	Extra       string
	ClientExtra string
	// HeartbeatGrace is the server's heartbeat_grace, set when waits are
	// scaled (TimeScale): a client restarting in a slow guest must not be
	// marked down, and its allocations lost, for want of time alone.
	HeartbeatGrace string
}

// chrootEnvHCL renders the driver's default chroot_env with the extra
// host path = task path entries added.
func chrootEnvHCL(extra map[string]string) string {
	env := map[string]string{}
	for k, v := range executor.DefaultChrootEnv {
		env[k] = v
	}
	for k, v := range extra {
		env[k] = v
	}
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	b.WriteString("{\n")
	for _, k := range keys {
		fmt.Fprintf(&b, "      %q = %q\n", k, env[k])
	}
	b.WriteString("    }")
	// (rendered as a block: chroot_env { ... })
	return b.String()
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
{{- if .HeartbeatGrace}}
  heartbeat_grace  = "{{.HeartbeatGrace}}"
{{- end}}
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
{{- if .ClientExtra}}
{{.ClientExtra}}
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

plugin "nomad-driver-csi" {
  config {
    enabled          = true
    allow_privileged = {{.AllowPrivileged}}
    root_dir         = "{{.DriverRoot}}"
    cgroup_parent    = "{{.DriverCgroup}}"
    chroot_env {{.ChrootEnv}}
{{- if .Grants}}
{{.Grants}}
{{- end}}
{{- if .DriverConfig}}
{{.DriverConfig}}
{{- end}}
  }
}
{{.Extra}}
{{end}}`

func writeAgentConfig(path string, cfg agentConfig) error {
	if cfg.Server && TimeScale > 1 {
		// A fast host restarts a client within Nomad's default TTL and
		// grace (10s each).
		cfg.HeartbeatGrace = Scaled(20 * time.Second).Round(time.Second).String()
	}
	var buf bytes.Buffer
	if err := template.Must(template.New("agent").Parse(agentConfigTemplate)).Execute(&buf, cfg); err != nil {
		return err
	}
	return os.WriteFile(path, buf.Bytes(), 0o600)
}

// startProc starts one agent process, its output appended to its log.
func (a *Agent) startProc(p *proc) error {
	if a.usesSystemd(p) {
		return a.startUnit(p)
	}
	logFile, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	fmt.Fprintf(logFile, "==== harness: starting %s %s at %s\n", NomadBinary(a.Root), strings.Join(p.args, " "), time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(NomadBinary(a.Root), p.args...)
	cmd.Dir = a.Dir
	cmd.Env = append(cleanEnv(), a.opts.Env...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	// Its own process group: a ^C to the test must not reach it before the
	// harness has stopped its jobs. SIGTERM when the test process dies
	// without cleaning up (a -test.timeout panic): a -dev agent then
	// destroys its allocations on the way out.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	exited, err := startTied(cmd)
	if err != nil {
		logFile.Close()
		return fmt.Errorf("failed to start %s: %w", NomadBinary(a.Root), err)
	}
	a.mu.Lock()
	p.cmd, p.exited, p.logFile = cmd, exited, logFile
	a.mu.Unlock()
	a.opts.Logf("started nomad %s pid=%d dir=%s", p.name, cmd.Process.Pid, a.Dir)
	return nil
}

// startTied starts cmd, whose SysProcAttr sets Pdeathsig, from a
// goroutine that keeps its OS thread until cmd has exited, and returns a
// channel closed once cmd.Wait has returned. Pdeathsig fires when the
// thread that forked exits, not the process, and the runtime ends a thread
// whenever a goroutine locked to it returns (this one does, once its
// process is gone): a process started from an ordinary goroutine died when
// a later locked goroutine took its thread and returned.
func startTied(cmd *exec.Cmd) (chan struct{}, error) {
	exited := make(chan struct{})
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		_ = cmd.Wait()
		close(exited)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return exited, nil
}

// stopProc sends SIGINT to an agent process by PID and waits up to grace
// for it to exit, then sends SIGKILL.
func (a *Agent) stopProc(p *proc, grace time.Duration) error {
	grace = Scaled(grace)
	if p.unit != "" {
		return a.stopUnit(p, grace)
	}
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
	if p != nil && p.unit != "" {
		select {
		case <-p.exited:
			return 0
		default:
		}
		return unitPID(p.unit)
	}
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
// AWS_CA_BUNDLE, which makes the agent fail at start. It holds the run's
// mark (runMark), which the agent passes on to its plugins.
func cleanEnv() []string {
	runMark()
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
	timeout = Scaled(timeout)
	deadline := time.Now().Add(timeout)
	last := "no answer from the server yet"
	for time.Now().Before(deadline) {
		if a.server.pid() == 0 {
			return fmt.Errorf("the server agent exited while starting (see %s)", a.server.logPath)
		}
		if leader, err := a.api.Status().Leader(); err != nil {
			last = err.Error()
		} else if leader == "" {
			last = "no leader yet"
		} else if keys, _, err := a.api.Keyring().List(nil); err != nil {
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
	timeout = Scaled(timeout)
	deadline := time.Now().Add(timeout)
	exited := a.clientExited()
	last := "no answer from the agent yet"
	var readySince time.Time
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return fmt.Errorf("the agent exited while starting (see %s)", a.LogPath)
		default:
		}
		if nodes, _, err := a.api.Nodes().List(nil); err != nil {
			last = err.Error()
		} else if len(nodes) == 0 {
			last = "no node registered yet"
		} else if n, ok := a.ownNode(nodes); !ok {
			last = fmt.Sprintf("node %s not registered yet", a.NodeName())
		} else {
			missing := a.missingDrivers(n.Drivers)
			switch {
			case n.Status != "ready":
				last = fmt.Sprintf("node %s is %q", n.ID, n.Status)
			case a.NodeID != "" && !a.registeredAgain():
				last = fmt.Sprintf("node %s has not registered again since the restart", n.ID)
			case len(missing) > 0:
				last = fmt.Sprintf("node %s is ready but drivers are not healthy: %s", n.ID, strings.Join(missing, "; "))
				if readySince.IsZero() {
					readySince = time.Now()
				}
				// Drivers fingerprint within seconds of the node's
				// registration; do not wait the full timeout for one
				// that is broken.
				if time.Since(readySince) > Scaled(30*time.Second) {
					return fmt.Errorf("%s after %v; the driver's log lines:\n%s", last, Scaled(30*time.Second), a.driverLogLines(20))
				}
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

// ownNode picks the agent's node from the server's list: the only one,
// or, when clients share a server (AgentOptions.Join), the one of its name.
func (a *Agent) ownNode(nodes []*NodeStub) (*NodeStub, bool) {
	if a.opts.Join == nil && a.serverRPC == "" {
		return nodes[0], true
	}
	for _, n := range nodes {
		if n.Name == a.NodeName() {
			return n, true
		}
	}
	return nil, false
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

// driverLogLines returns the last n lines of the agent log that come from
// or mention the csi driver plugin.
func (a *Agent) driverLogLines(n int) string {
	var out []string
	for _, line := range strings.Split(a.Log(), "\n") {
		if strings.Contains(line, "driver=csi") || strings.Contains(line, "nomad-driver-csi") {
			out = append(out, line)
		}
	}
	if len(out) > n {
		out = out[len(out)-n:]
	}
	return strings.Join(out, "\n")
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
	if a.client != nil && a.client.unit != "" {
		if err := a.restartUnit(a.client); err != nil {
			return err
		}
		return a.waitReady(90 * time.Second)
	}
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
	a.removeUnit(a.client)
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
		_, _, _ = a.api.Jobs().Deregister(id, false, nil)
	}
	deadline := time.Now().Add(Scaled(timeout))
	for _, id := range jobs {
		for time.Now().Before(deadline) {
			allocs, err := a.JobAllocations(id)
			if err != nil || allTerminal(allocs) {
				break
			}
			time.Sleep(250 * time.Millisecond)
		}
		_, _, _ = a.api.Jobs().Deregister(id, true, nil)
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

// tailFile returns the last n lines of a log, leaving out the HTTP request
// lines the harness's own polling floods it with.
func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	var lines []string
	for _, line := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		if !strings.Contains(line, "http: request complete") {
			lines = append(lines, line)
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Log returns the whole log of the agent that runs the tasks, or "" when
// it cannot be read: for messages. A check on what the log says uses
// ReadLog.
func (a *Agent) Log() string {
	s, _ := a.ReadLog()
	return s
}

// ReadLog returns the whole log of the agent that runs the tasks.
func (a *Agent) ReadLog() (string, error) {
	b, err := os.ReadFile(a.LogPath)
	if err != nil {
		return "", fmt.Errorf("failed to read the agent log: %w", err)
	}
	if len(b) == 0 {
		return "", fmt.Errorf("the agent log %s is empty", a.LogPath)
	}
	return string(b), nil
}
