//go:build e2e

package e2e

// Privilege is the operator's grant (issue 20). Each case is an attack a
// hostile job author made on a node set up as the README recommended for
// plugins, checked on the host:
//
//   - hole 1: any job that adds a csi_plugin block and privileged = true
//     was root on the host (a root-owned file in /etc, /etc/shadow read);
//   - the API path: a nobody task on host networking reached the agent's
//     loopback API and submitted such a job: refused without a grant for
//     that job, run with one;
//   - hole 8: while the operator's plugin task restarted, another job took
//     its plugin id, and the operator's plugin was then refused; a job
//     under the operator's job name cannot run another binary than the
//     granted one, nor make it load the job's code;
//   - hole 2: the same block with user = "nobody" ran outside every
//     isolation layer as the uid every ordinary task has, and read another
//     namespace's task's environment, wrote into its /alloc/data and
//     killed it;
//   - hole 3: denied_host_uids = "0" refused the operator's own plugin;
//   - hole 4: user = "nobody:shadow" (or "65534:42") read /etc/shadow
//     through chroot_env's /etc with denied_host_gids = "0" set.
//
// Two agents: a plugin node (allow_privileged, privileged_plugins_only at
// its default) and a hardened one (denied_host_uids and denied_host_gids
// "0" besides). Their grants are the operator's: the suite's plugin jobs,
// and the jobs each case names.

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/user"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/nomad/api"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// grantJob is a job rendered from e2e/jobs/escape-grant.hcl.
type grantJob struct {
	// ID replaces the template's "escape-grant-<suffix>" id: the name an
	// operator's grant (or an attacker's guess) gives the job.
	ID         string
	Namespace  string // "" is "default"
	Type       string // "" is "batch"
	User       string
	Privileged bool
	// Command runs with Args; with Script, /bin/sh -c Script "escape"
	// Args... runs instead.
	Command    string
	Args       []string
	Script     string
	PluginID   string
	PluginType string // "" is "controller"
	Env        map[string]string
	Data       string
	// DataDest is where Data is rendered ("" is local/data), DataPerms
	// its mode ("" is 0644).
	DataDest, DataPerms string
	// DataEnv renders Data with env = true: its lines join the task's
	// environment, as the env block's do.
	DataEnv  bool
	Volume   *VolSpec // a volume block of the driver's
	Attempts int
	Delay    string // "" is "1s"
}

func (j grantJob) vars() map[string]string {
	v := map[string]string{
		"Namespace": j.Namespace, "Type": j.Type, "User": j.User, "Privileged": fmt.Sprint(j.Privileged),
		"PluginID": j.PluginID, "PluginType": j.PluginType, "Attempts": fmt.Sprint(j.Attempts), "Delay": j.Delay,
		"Command": volHCLString(j.Command), "Args": volHCLList(j.Args), "Env": "", "Data": "", "Volumes": "",
		"DataDest": j.DataDest, "DataPerms": j.DataPerms, "DataEnv": fmt.Sprint(j.DataEnv),
	}
	if v["DataDest"] == "" {
		v["DataDest"] = "local/data"
	}
	if v["DataPerms"] == "" {
		v["DataPerms"] = "0644"
	}
	if j.Volume != nil {
		v["Volumes"] = j.Volume.HCL()
	}
	if v["Namespace"] == "" {
		v["Namespace"] = "default"
	}
	if v["Type"] == "" {
		v["Type"] = "batch"
	}
	if v["PluginType"] == "" {
		v["PluginType"] = "controller"
	}
	if v["Delay"] == "" {
		v["Delay"] = "1s"
	}
	if j.Script != "" {
		v["Command"] = volHCLString("/bin/sh")
		v["Args"] = volHCLList(append([]string{"-c", j.Script, "escape"}, j.Args...))
	}
	if len(j.Env) > 0 {
		keys := make([]string, 0, len(j.Env))
		for k := range j.Env {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var b strings.Builder
		for _, k := range keys {
			fmt.Fprintf(&b, "        %s = %s\n", k, volHCLString(j.Env[k]))
		}
		v["Env"] = strings.TrimRight(b.String(), "\n")
	}
	if j.Data != "" {
		v["Data"] = volHCLString(j.Data)
	}
	return v
}

// grantParse renders j and parses it with the agent, as "nomad job run"
// would, with j.ID as its id.
func grantParse(t *testing.T, a *Agent, j grantJob) *api.Job {
	t.Helper()
	rendered, err := a.RenderJob("escape-grant", j.vars())
	must.NoError(t, err)
	b, err := os.ReadFile(rendered.File)
	must.NoError(t, err)
	job, err := a.api.Jobs().ParseHCLOpts(&api.JobsParseRequest{JobHCL: string(b), Canonicalize: true})
	must.NoError(t, err, must.Sprintf("parse %s", rendered.File))
	if j.ID == "" {
		j.ID = rendered.ID
	}
	job.ID, job.Name = &j.ID, &j.ID
	return job
}

// grantTrack stops (and purges) a job of a namespace when the test ends.
func grantTrack(t *testing.T, a *Agent, ns, id string) {
	if ns == "" || ns == "default" {
		a.TrackJob(id)
		return
	}
	t.Cleanup(func() { stopNamespaced(t, a, ns, id) })
}

// grantRun registers j, as its author would, and returns its id.
func grantRun(t *testing.T, a *Agent, j grantJob) string {
	t.Helper()
	job := grantParse(t, a, j)
	grantTrack(t, a, *job.Namespace, *job.ID)
	_, _, err := a.api.Jobs().Register(job, &api.WriteOptions{Namespace: *job.Namespace})
	must.NoError(t, err, must.Sprintf("register job %s", *job.ID))
	return *job.ID
}

// grantLogs reads a task's stdout ("" when it never started).
func grantLogs(t *testing.T, a *Agent, ns, allocID string) string {
	t.Helper()
	out, err := a.Nomad("alloc", "logs", "-namespace", ns, allocID, "t")
	if err != nil {
		if strings.Contains(out, "not started yet") {
			return ""
		}
		t.Fatalf("nomad alloc logs -namespace %s %s t: %v\n%s", ns, allocID, err, out)
	}
	t.Logf("task t of allocation %s said:\n%s", allocID, strings.TrimRight(out, "\n"))
	return out
}

// grantRefused checks that a job's task was refused before it ran: the
// allocation failed, its events say each of want, and no process of it
// is left. On the code before the grants the attack ran instead: the
// results it printed are reported as escapes.
func grantRefused(t *testing.T, a *Agent, ns, jobID string, want ...string) {
	t.Helper()
	al := waitNamespacedAlloc(t, a, ns, jobID, escTimeout, StatusComplete, StatusFailed)
	text := eventsText(al, "t")
	t.Logf("events of job %s/%s:\n%s", ns, jobID, text)
	if al.ClientStatus == StatusComplete {
		for name, r := range escParse(grantLogs(t, a, ns, al.ID)) {
			if r.OK {
				t.Errorf("ESCAPED: %s: %s", name, r.Why)
			}
		}
		t.Fatalf("job %s/%s ran: it was not refused", ns, jobID)
	}
	for _, w := range want {
		must.StrContains(t, text, w)
	}
	must.SliceEmpty(t, TaskPIDs(al.ID, "t"), must.Sprint("a refused task has processes"))
}

// grantAgent starts an agent for the grant cases: allow_privileged, the
// suite's plugin jobs granted, grants and driver config of the case's.
func grantAgent(t *testing.T, grants, driverConfig string, prepare func(*Agent) error) *Agent {
	t.Helper()
	return StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}, Grants: grants,
		DriverConfig: driverConfig, Prepare: prepare})
}

// grantNamespace makes a Nomad namespace.
func grantNamespace(t *testing.T, a *Agent, ns string) {
	t.Helper()
	out, err := a.Nomad("namespace", "apply", "-description", "grant e2e", ns)
	must.NoError(t, err, must.Sprint(out))
}

// sha256File is the hex digest of a host file.
func sha256File(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	must.NoError(t, err)
	defer f.Close()
	h := sha256.New()
	_, err = io.Copy(h, f)
	must.NoError(t, err)
	return hex.EncodeToString(h.Sum(nil))
}

// installFixture copies the fixture plugin to dir/csi-fixture as an
// operator installs a plugin binary: root's, mode 0755, in a directory
// root's alone.
func installFixture(t testing.TB, fixture, dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	b, err := os.ReadFile(fixture)
	if err != nil {
		return "", err
	}
	dst := filepath.Join(dir, "csi-fixture")
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		return "", err
	}
	return dst, os.Chmod(dst, 0o755)
}

// grantBlock is a privileged_grant block for a namespace and job.
func grantBlock(ns, job string) string {
	return fmt.Sprintf("\n    privileged_grant {\n      namespace = %q\n      job       = %q\n    }\n", ns, job)
}

// grantPinnedAgent starts a plugin node whose operator installed the
// fixture plugin (installFixture, in the agent's directory) and granted
// it, pinned by command, to job with plugin id plugin; and the grants of
// more. It returns the agent and the plugin binary's path.
func grantPinnedAgent(t *testing.T, job, plugin, more string) (*Agent, string) {
	t.Helper()
	return grantPinnedAgentWith(t, job, plugin, func(string) string { return more })
}

// grantPinnedAgentWith is grantPinnedAgent with more grants made from the
// installed binary's path.
func grantPinnedAgentWith(t *testing.T, job, plugin string, more func(command string) string) (*Agent, string) {
	t.Helper()
	fixture := csiBin(t, "csi-fixture")
	var command string
	a := grantAgent(t, "", "", func(a *Agent) error {
		var err error
		if command, err = installFixture(t, fixture, filepath.Join(a.Dir, "bin")); err != nil {
			return err
		}
		a.opts.Grants += fmt.Sprintf(`
    privileged_grant {
      namespace = "default"
      job       = %q
      command   = %q
      plugin_id = %q
    }
`, job, command, plugin) + more(command)
		return nil
	})
	return a, command
}

// grantRunNative registers, as job id, the fixture as a privileged plugin
// of Nomad's own csi_plugin block with plugin id plugin
// (e2e/jobs/native_plugin.hcl), after change (nil: none) shaped it.
func grantRunNative(t *testing.T, a *Agent, id, plugin string, change func(*api.Job)) {
	t.Helper()
	rendered, err := a.RenderJob("native_plugin", a.NativePluginVars(plugin, true, ""))
	must.NoError(t, err)
	b, err := os.ReadFile(rendered.File)
	must.NoError(t, err)
	job, err := a.api.Jobs().ParseHCLOpts(&api.JobsParseRequest{JobHCL: string(b), Canonicalize: true})
	must.NoError(t, err)
	job.ID, job.Name = &id, &id
	if change != nil {
		change(job)
	}
	a.TrackJob(id)
	_, _, err = a.api.Jobs().Register(job, nil)
	must.NoError(t, err)
}

func TestEscapeGrantPluginNode(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	u := escUniq()
	opPlugin, opJob := "granted-"+u, "grant-operator-"+u
	apiGranted, apiUngranted := "api-granted-"+u, "api-ungranted-"+u
	// The operator's plugin: its job, its binary, its plugin id; and the
	// one job of the API case the operator trusts.
	a, opCommand := grantPinnedAgent(t, opJob, opPlugin, grantBlock("default", apiGranted))

	// Hole 1: a job adds csi_plugin and privileged = true.
	t.Run("any_job_becomes_root", func(t *testing.T) {
		t.Parallel()
		etcFile := "/etc/ncsi-grant-" + u
		t.Cleanup(func() { escRemove(t, etcFile) })
		id := grantRun(t, a, grantJob{Privileged: true, PluginID: "attack-" + u, Script: escTry + escWho + fmt.Sprintf(`
try write_etc sh -c 'echo "written by a job" > %[1]s && stat -c "%%U %%a %%n" %[1]s'
try read_shadow sha256sum /etc/shadow
echo DONE
`, etcFile)})
		// The block to add names the job (and pins what it ran).
		grantRefused(t, a, "default", id, "privileged = true needs the operator's grant on this node",
			fmt.Sprintf(`privileged_grant { namespace = "default", job = %q, `, id), fmt.Sprintf(`plugin_id = "attack-%s" }`, u))
		escMustNotExist(t, etcFile, "a root-owned file in /etc")
	})

	// Hole 1 with Nomad's own task-level csi_plugin block: the driver's
	// privileged Nomad plugin task needs the grant too.
	t.Run("nomad_plugin_block", func(t *testing.T) {
		t.Parallel()
		id := "native-attack-" + u
		grantRunNative(t, a, id, id, nil)
		al := waitNamespacedAlloc(t, a, "default", id, escTimeout, StatusRunning, StatusFailed)
		text := eventsText(al, "plugin")
		t.Logf("events of job %s:\n%s", id, text)
		if al.ClientStatus == StatusRunning {
			for _, pid := range TaskPIDs(al.ID, "plugin") {
				capEff, _ := CapEff(pid)
				uid, _ := StatusField(pid, "Uid")
				t.Errorf("ESCAPED: the job's Nomad plugin task runs privileged: pid %d, Uid %s, CapEff %016x", pid, uid, capEff)
			}
			t.Fatalf("job %s runs: it was not refused", id)
		}
		must.StrContains(t, text, "privileged = true needs the operator's grant on this node")
		must.StrContains(t, text, fmt.Sprintf(`privileged_grant { namespace = "default", job = %q, `, id))
		must.StrContains(t, text, fmt.Sprintf(`plugin_id = %q }`, id))
		must.SliceEmpty(t, TaskPIDs(al.ID, "plugin"), must.Sprint("a refused task has processes"))
	})

	// The API path: an ordinary task reaches the agent's HTTP API on the
	// loopback and submits privileged plugin jobs. The one the operator
	// granted runs; the other is refused.
	t.Run("api_submission", func(t *testing.T) {
		t.Parallel()
		addr, err := url.Parse(a.Addr)
		must.NoError(t, err)
		marker := func(id string) string { return filepath.Join(a.Dir, "marker-"+id) }
		var bodies []string
		for _, id := range []string{apiUngranted, apiGranted} {
			job := grantParse(t, a, grantJob{ID: id, Privileged: true, PluginID: id,
				Script: fmt.Sprintf(`id -u > %s && echo "wrote the marker as uid $(id -u)"`, marker(id))})
			a.TrackJob(id)
			t.Cleanup(func() { escRemove(t, marker(id)) })
			b, err := json.Marshal(map[string]any{"Job": job})
			must.NoError(t, err)
			bodies = append(bodies, string(b))
		}
		attacker := grantRun(t, a, grantJob{Command: "/bin/bash", Args: []string{"-c", escWho + `
port=$1
n=0
while IFS= read -r body; do
  n=$((n+1))
  if ! exec 3<>"/dev/tcp/127.0.0.1/$port"; then echo "RESULT submit_$n FAILED cannot connect"; continue; fi
  printf 'PUT /v1/jobs HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' "$(printf %s "$body" | wc -c)" "$body" >&3
  resp=$(cat <&3 | tr -d '\r')
  exec 3<&-
  case "$resp" in "HTTP/1."?" 200"*) echo "RESULT submit_$n OK $(printf '%s' "$resp" | tail -n 1)" ;;
    *) echo "RESULT submit_$n FAILED $(printf '%s' "$resp" | head -n 1)" ;; esac
done < /local/data
echo DONE
`, "attacker", addr.Port()}, Data: strings.Join(bodies, "\n") + "\n"})
		al := waitNamespacedAlloc(t, a, "default", attacker, escTimeout, StatusComplete, StatusFailed)
		must.Eq(t, StatusComplete, al.ClientStatus, must.Sprint(al.Describe()))
		out := grantLogs(t, a, "default", al.ID)
		must.StrContains(t, out, "uid=65534", must.Sprint("the attacker is an ordinary task"))
		res := escParse(out)
		for _, n := range []string{"submit_1", "submit_2"} {
			must.True(t, res[n].OK, must.Sprintf("the attacker could not submit its job (%s): %s", n, res[n].Why))
		}

		// Without a grant for the job: refused, nothing written.
		grantRefused(t, a, "default", apiUngranted, "privileged = true needs the operator's grant on this node",
			fmt.Sprintf(`privileged_grant { namespace = "default", job = %q, `, apiUngranted))
		escMustNotExist(t, marker(apiUngranted), "the marker of the job no grant names")

		// With one: it runs, as root on the host.
		al = waitNamespacedAlloc(t, a, "default", apiGranted, escTimeout, StatusComplete, StatusFailed)
		must.Eq(t, StatusComplete, al.ClientStatus, must.Sprint(al.Describe()))
		fi, err := os.Stat(marker(apiGranted))
		must.NoError(t, err, must.Sprint("the granted job wrote no marker"))
		must.Eq(t, uint32(0), fi.Sys().(*syscall.Stat_t).Uid)
		b, err := os.ReadFile(marker(apiGranted))
		must.NoError(t, err)
		must.Eq(t, "0", strings.TrimSpace(string(b)))
	})

	// Hole 8: the operator's plugin restarts; another job takes its id
	// meanwhile.
	t.Run("plugin_id_capture", func(t *testing.T) {
		t.Parallel()
		grantRun(t, a, grantJob{ID: opJob, Type: "service", Privileged: true, PluginID: opPlugin, PluginType: "monolith",
			Command: opCommand, Args: []string{"--state-dir", filepath.Join(a.Dir, "op-state"), "--node-id", "e2e-grant"},
			Attempts: 3, Delay: "15s"})
		op := waitNamespacedAlloc(t, a, "default", opJob, escTimeout, StatusRunning)
		_, attrs, err := a.WaitPluginAttr(opPlugin, "healthy", "true", 100*time.Millisecond, time.Minute)
		must.NoError(t, err, must.Sprint(a.Allocation(t, op.ID).Describe()))
		must.Eq(t, "monolith", attrs["type"])
		pid, err := TaskPIDByComm(op.ID, "t", "csi-fixture")
		must.NoError(t, err)
		exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
		must.NoError(t, err)
		must.Eq(t, opCommand, exe, must.Sprint("the granted task runs the granted file"))

		must.NoError(t, unix.Kill(pid, unix.SIGKILL))
		_, _, err = a.WaitPluginAttr(opPlugin, "healthy", "false", 50*time.Millisecond, 10*time.Second)
		must.NoError(t, err)
		squatted := time.Now()
		squatter := grantRun(t, a, grantJob{Type: "service", PluginID: opPlugin, PluginType: "controller",
			Command: TaskCSIBinDir + "/csi-fixture", Args: []string{"--state-dir", "/local/state", "--node-id", "e2e-squat"}})
		al := waitNamespacedAlloc(t, a, "default", squatter, escTimeout, StatusRunning, StatusFailed)
		text := eventsText(al, "t")
		t.Logf("events of the squatter %s:\n%s", squatter, text)
		if al.ClientStatus == StatusRunning {
			if _, attrs, err := a.WaitPluginAttr(opPlugin, "type", "controller", 100*time.Millisecond, 20*time.Second); err == nil {
				t.Errorf("ESCAPED: the squatter's task serves plugin %q (attributes %v)", opPlugin, attrs)
			}
		} else {
			must.StrContains(t, text, fmt.Sprintf("csi_plugin id %q is reserved on this node by the operator for the tasks of privileged_grant", opPlugin))
			must.StrContains(t, text, fmt.Sprintf("job = %q", opJob))
		}

		// The operator's plugin comes back after its restart delay.
		_, attrs, err = a.WaitPluginAttr(opPlugin, "healthy", "true", 200*time.Millisecond, time.Minute)
		if err != nil {
			t.Fatalf("the operator's plugin did not come back (squatted %v ago): %v\n%s", time.Since(squatted).Round(time.Second), err,
				eventsText(a.Allocation(t, op.ID), "t"))
		}
		must.Eq(t, "monolith", attrs["type"], must.Sprint("the operator's plugin serves its id again"))
		pid, err = TaskPIDByComm(op.ID, "t", "csi-fixture")
		must.NoError(t, err)
		exe, err = os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
		must.NoError(t, err)
		must.Eq(t, opCommand, exe)
	})
}

// The command pin against a job under the operator's own job name: another
// binary, or the granted one with LD_PRELOAD.
func TestEscapeGrantPinnedCommand(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	u := escUniq()
	// The grant names every job "grant-pinned-<u>-...": the attacks take
	// names it matches, as a job author with ACLs off can.
	prefix, plugin := "grant-pinned-"+u, "pinned-"+u
	a, command := grantPinnedAgent(t, prefix+"-*", plugin, "")
	etcFile := "/etc/ncsi-grant-pinned-" + u
	t.Cleanup(func() { escRemove(t, etcFile) })
	attack := escTry + escWho + fmt.Sprintf(`try write_etc sh -c 'echo pinned > %s'
echo DONE
`, etcFile)

	// Another binary under a granted name.
	job := grantRun(t, a, grantJob{ID: prefix + "-shell", Privileged: true, PluginID: plugin, PluginType: "monolith", Script: attack})
	grantRefused(t, a, "default", job, fmt.Sprintf(`csi_plugin id %q is reserved on this node`, plugin),
		`the task's command resolves to "`, `", not "`+command+`"`)
	escMustNotExist(t, etcFile, "a file the job's shell wrote")

	// The granted binary, with the job's library preloaded: the job's
	// code would run as root before the plugin's.
	job = grantRun(t, a, grantJob{ID: prefix + "-preload", Privileged: true, PluginID: plugin, PluginType: "monolith", Command: command,
		Args: []string{"--state-dir", filepath.Join(a.Dir, "pinned-state")}, Env: map[string]string{"LD_PRELOAD": "/local/evil.so"}})
	grantRefused(t, a, "default", job, "env LD_PRELOAD is not allowed in this task")

	// The granted binary with a volume over /etc (its loader reads
	// /etc/ld.so.preload).
	job = grantRun(t, a, grantJob{ID: prefix + "-etc", Privileged: true, PluginID: plugin, PluginType: "monolith", Command: command,
		Args: []string{"--state-dir", filepath.Join(a.Dir, "pinned-state")}, Volume: &VolSpec{Name: "etc", Plugin: plugin, ID: "etc-" + u, Dest: "/etc"}})
	grantRefused(t, a, "default", job, `a mount at "/etc" would put the job's files into /etc`)
}

func TestEscapeGrantHardenedNode(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	fixture := csiBin(t, "csi-fixture")
	u := escUniq()
	nsVictim, nsAttack := "grant-victim-"+u, "grant-attack-"+u
	opJob := "grant-operator-b-" + u
	// The operator trusts its plugin job, and (to show that the root-only
	// rule holds under a grant) every job of the attacker's namespace.
	a := grantAgent(t, grantBlock("default", opJob)+grantBlock(nsAttack, "*"), `    denied_host_uids = "0"
    denied_host_gids = "0"`, nil)
	grantNamespace(t, a, nsVictim)
	grantNamespace(t, a, nsAttack)

	// Hole 3: the operator's own plugin on a node that denies uid 0.
	t.Run("denied_uid_operator_plugin", func(t *testing.T) {
		t.Parallel()
		id := "hardened-" + u
		grantRun(t, a, grantJob{ID: opJob, Type: "service", Privileged: true, PluginID: id, PluginType: "monolith",
			Command: fixture, Args: []string{"--state-dir", filepath.Join(a.Dir, "op-b-state"), "--node-id", "e2e-hardened"}})
		al := waitNamespacedAlloc(t, a, "default", opJob, escTimeout, StatusRunning, StatusFailed)
		must.Eq(t, StatusRunning, al.ClientStatus, must.Sprintf("the operator's plugin was refused:\n%s", eventsText(al, "t")))
		_, _, err := a.WaitPluginAttr(id, "healthy", "true", 100*time.Millisecond, time.Minute)
		must.NoError(t, err)
		pid, err := TaskPIDByComm(al.ID, "t", "csi-fixture")
		must.NoError(t, err)
		uid, err := StatusField(pid, "Uid")
		must.NoError(t, err)
		must.Eq(t, "0", strings.Fields(uid)[0], must.Sprint("the privileged plugin runs as root"))

		// The rule's other half: a task that is not privileged, plugin or
		// not, cannot name root.
		for _, j := range []grantJob{
			{User: "root", Script: `echo DONE`},
			{PluginID: "hardened-ctl-" + u, Script: `echo DONE`},
		} {
			id := grantRun(t, a, j)
			grantRefused(t, a, "default", id, `running as uid 0 is denied on this node (denied_host_uids = "0")`)
		}
	})

	// Hole 2: a privileged plugin task as nobody reaches another
	// namespace's task.
	t.Run("privileged_nobody", func(t *testing.T) {
		t.Parallel()
		secret := "grant-secret-" + u
		victim := grantRun(t, a, grantJob{Namespace: nsVictim, Type: "service", Env: map[string]string{"GRANT_SECRET": secret},
			Script: `echo ready; exec sleep 300`})
		vAl := waitNamespacedAlloc(t, a, nsVictim, victim, escTimeout, StatusRunning)
		attacker := grantRun(t, a, grantJob{Namespace: nsAttack, User: "nobody", Privileged: true, PluginID: "nobody-" + u,
			Script: escTry + escWho + fmt.Sprintf(`
find_victim() {
  for e in /proc/[0-9]*/environ; do
    if tr '\0' '\n' < "$e" 2>/dev/null | grep -qx 'GRANT_SECRET=%[1]s'; then basename "$(dirname "$e")"; return 0; fi
  done
  return 1
}
pid=$(find_victim)
try read_environ sh -c "tr '\0' '\n' < /proc/$pid/environ | grep GRANT_SECRET"
try write_alloc_data sh -c "echo pwned > /proc/$pid/root/alloc/data/pwned-%[2]s"
try kill_task kill -9 "$pid"
echo DONE
`, secret, u)})
		victimData := filepath.Join(a.DataDir, "alloc", vAl.ID, "alloc", "data")
		_, err := os.Stat(victimData)
		must.NoError(t, err, must.Sprint("the victim's /alloc/data on the host"))
		grantRefused(t, a, nsAttack, attacker, `user "nobody": a privileged task runs as root only`)
		escMustNotExist(t, filepath.Join(victimData, "pwned-"+u), "a file in the victim's /alloc/data")
		must.Eq(t, StatusRunning, waitNamespacedAlloc(t, a, nsVictim, victim, escTimeout, StatusRunning).ClientStatus)
		must.SliceNotEmpty(t, TaskPIDs(vAl.ID, "t"), must.Sprint("the victim's task is gone"))
	})

	// Hole 4: a group of the host's that the user is not a member of.
	t.Run("user_group_shadow", func(t *testing.T) {
		t.Parallel()
		g, err := user.LookupGroup("shadow")
		if err != nil {
			t.Skipf("no shadow group on this host: %v", err)
		}
		fi, err := os.Stat("/etc/shadow")
		must.NoError(t, err)
		if fmt.Sprint(fi.Sys().(*syscall.Stat_t).Gid) != g.Gid || fi.Mode().Perm()&0o040 == 0 {
			t.Skipf("/etc/shadow is not readable by group shadow here (mode %v)", fi.Mode())
		}
		want := sha256File(t, "/etc/shadow")
		for _, name := range []string{"nobody:shadow", "65534:" + g.Gid} {
			t.Run(strings.ReplaceAll(name, ":", "_"), func(t *testing.T) {
				id := grantRun(t, a, grantJob{User: name, Script: escTry + escWho + `try read_shadow sha256sum /etc/shadow
echo DONE
`})
				al := waitNamespacedAlloc(t, a, "default", id, escTimeout, StatusComplete, StatusFailed)
				if al.ClientStatus == StatusComplete {
					res := escParse(grantLogs(t, a, "default", al.ID))
					if r := res["read_shadow"]; r.OK && strings.HasPrefix(r.Why, want) {
						t.Errorf("ESCAPED: user %q read the host's /etc/shadow (sha256 %s)", name, want)
					}
				}
				grantRefused(t, a, "default", id, "is not a member of group", "allow_user_groups")
			})
		}
	})
}
