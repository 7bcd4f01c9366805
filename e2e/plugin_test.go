//go:build e2e

package e2e

// CSI plugins served by tasks of the csi driver, against a real agent: the
// example plugin job and a job placed on its health attribute, mount
// propagation from a plugin task to the host and to other tasks, the
// privilege rules, a plugin's death and return, a plugin found in
// plugin_socket_dirs, and third-party mock plugins.
//
// The cases that need privileged tasks share one PluginAgent (its driver
// allows privileged tasks and scans a socket directory); each uses its own
// plugin id, so they run in parallel. The privilege-rule cases run on the
// shared agent, whose driver does not allow privileged tasks.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// capSysAdmin is CAP_SYS_ADMIN's bit in CapEff.
const capSysAdmin = 1 << 21

func TestCSIPluginTasks(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	fixture := csiBin(t, "csi-fixture")
	p := StartPluginAgent(t)
	hostNS, err := os.Readlink("/proc/self/ns/mnt")
	must.NoError(t, err)

	// 1. The example plugin job, as it is, serves the fixture on the node:
	// healthy, with its identity and capabilities in the node's attributes
	// (API and CLI), and a job constrained on its health is placed.
	t.Run("example_job_serves_plugin", func(t *testing.T) {
		t.Parallel()
		stateDir := filepath.Join(p.Base, "example-state")
		file := filepath.Join(p.Root, "examples", "jobs", "csi-plugin.nomad.hcl")
		start := time.Now()
		p.TrackJob("csi-plugin")
		out, err := p.Nomad("job", "run", "-detach",
			"-var", "plugin_command="+fixture,
			"-var", "plugin_args="+HCLList("--state-dir", stateDir, "--node-id", "e2e-example-node"),
			file)
		must.NoError(t, err, must.Sprintf("nomad job run %s: %s", file, out))
		al := p.WaitAlloc(t, "csi-plugin", startTimeout, StatusRunning)

		seen, attrs, err := p.WaitPluginAttr("fixture", "healthy", "true", 50*time.Millisecond, time.Minute)
		must.NoError(t, err, must.Sprint(p.Allocation(t, al.ID).Describe()))
		t.Logf("submit -> driver.csi.plugin.fixture.healthy = true in %v", seen.Sub(start).Round(time.Millisecond))
		want := map[string]string{
			"healthy":              "true",
			"id":                   "fixture",
			"source":               "task",
			"type":                 "monolith",
			"socket":               p.PluginSocket("fixture"),
			"vendor":               "fixture.csi.nomad-driver-csi",
			"version":              "0.1.0",
			"node_id":              "e2e-example-node",
			"node_service":         "true",
			"controller_service":   "true",
			"stage_unstage":        "true",
			"get_volume_stats":     "true",
			"expand":               "true",
			"create_delete_volume": "true",
			"controller_expand":    "true",
			"online_expansion":     "true",
		}
		for k, v := range want {
			must.Eq(t, v, attrs[k], must.Sprintf("driver.csi.plugin.fixture.%s; all: %v", k, attrs))
		}
		// Nomad keeps a node attribute until a driver sends it empty: the
		// description of the unhealthy first probe is cleared, not gone.
		must.Eq(t, "", attrs["health_description"], must.Sprintf("a healthy plugin has a health_description: %v", attrs))
		all, err := p.NodeAttributes()
		must.NoError(t, err)
		must.SliceContains(t, strings.Split(all["driver.csi.plugins"], ","), "fixture")

		// What an operator reads.
		cli, err := p.Nomad("node", "status", "-verbose", p.NodeID)
		must.NoError(t, err, must.Sprint(cli))
		for _, k := range []string{"healthy", "vendor", "version", "node_id", "stage_unstage", "get_volume_stats", "expand", "create_delete_volume"} {
			re := regexp.MustCompile(`(?m)^\s*driver\.csi\.plugin\.fixture\.` + regexp.QuoteMeta(k) + `\s*=\s*` + regexp.QuoteMeta(want[k]) + `\s*$`)
			must.True(t, re.MatchString(cli), must.Sprintf("nomad node status -verbose has no %q line:\n%s", "driver.csi.plugin.fixture."+k+" = "+want[k], cliLines(cli, "driver.csi")))
		}
		t.Logf("nomad node status -verbose:\n%s", cliLines(cli, "driver.csi.plugin.fixture."))

		job := p.RunJob(t, "plugin_constrained", map[string]string{"Key": "fixture"})
		done := p.WaitAlloc(t, job.ID, startTimeout, StatusComplete)
		must.Eq(t, p.NodeID, done.NodeID)
		must.StrContains(t, p.AllocLogs(t, done.ID, "t", false), "placed-where-the-plugin-is-healthy")
	})

	// 2. A mount made inside a node-plugin task under the stage root
	// reaches the host and another task with the host's view (a privileged plugin task), started before it.
	t.Run("bidirectional_propagation", func(t *testing.T) {
		t.Parallel()
		x := strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
		probe := filepath.Join(p.StageRoot(), "probe-"+x)
		trigger := filepath.Join(p.Base, "trigger-"+x)
		token := "propagated-" + x
		job := p.RunJob(t, "plugin_propagation", map[string]string{
			"StageRoot": p.StageRoot(), "Trigger": trigger, "Probe": probe, "Source": "probe-" + x,
			"Token": token, "PluginID": "probe-" + x,
		})
		// Runs before the agent's Close stops the job: the tmpfs goes
		// first, from the host, which takes it out of the tasks too.
		t.Cleanup(func() {
			for _, mp := range []string{probe, probe + "-private"} {
				if mountInfo(mp) != nil {
					if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
						t.Errorf("failed to unmount %s: %v", mp, err)
					}
				}
			}
		})
		al := p.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
		mounterLog := p.WaitLogs(t, al.ID, "mounter", "mounter waiting", 20*time.Second)
		watcherLog := p.WaitLogs(t, al.ID, "watcher", "watching", 20*time.Second)
		for name, log := range map[string]string{"mounter": mounterLog, "watcher": watcherLog} {
			must.StrNotContains(t, log, "mntns="+hostNS+"\n", must.Sprintf("the %s shares the host's mount namespace", name))
		}
		must.Nil(t, mountInfo(probe), must.Sprint("the probe is mounted before the trigger"))

		must.NoError(t, os.WriteFile(trigger, nil, 0o644))
		start := time.Now()
		p.WaitLogs(t, al.ID, "mounter", "mounted", 20*time.Second)
		privateLog := p.WaitLogs(t, al.ID, "private", "mounted: ", 20*time.Second)

		var m *mounter.MountPoint
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if m = mountInfo(probe); m != nil {
				break
			}
		}
		must.NotNil(t, m, must.Sprintf("the host does not see the task's mount at %s", probe))
		t.Logf("host mountinfo after %v: %+v", time.Since(start).Round(time.Millisecond), *m)
		must.Eq(t, "tmpfs", m.FSType)
		must.Eq(t, "probe-"+x, m.Source)
		b, err := os.ReadFile(filepath.Join(probe, "hello"))
		must.NoError(t, err, must.Sprint("the host cannot read the file the task wrote in its mount"))
		must.Eq(t, token, strings.TrimSpace(string(b)))

		logs := p.WaitLogs(t, al.ID, "watcher", "mountinfo:", 20*time.Second)
		must.StrContains(t, logs, "seen: "+token)
		info := lineWith(logs, "mountinfo:")
		must.StrContains(t, info, " - tmpfs probe-"+x+" ", must.Sprintf("the watcher does not see the mount as a mount:\n%s", logs))
		// A slave of the host's: host mounts come in, its own would not go
		// out.
		must.StrContains(t, info, " master:", must.Sprintf("the watcher's copy of the mount is not a slave of the host's: %s", info))
		t.Logf("watcher (privileged, started before the mount): %s | %s", lineWith(logs, "seen:"), info)

		// The control: a privileged task's own mount, not under a
		// bidirectional mount of its own, stays in its namespace.
		t.Logf("private task: %s", lineWith(privateLog, "mounted: "))
		must.Nil(t, mountInfo(probe+"-private"), must.Sprintf("a mount made by a privileged task without a bidirectional mount reached the host: %s", lineWith(privateLog, "mounted: ")))
		_, err = os.Stat(filepath.Join(probe+"-private", "hello"))
		must.True(t, os.IsNotExist(err), must.Sprintf("the host sees a file written in a private task's mount: %v", err))
	})

	// 4. The plugin's process dies: the node says so within 2s, the task
	// says why, and Nomad's restart brings the plugin back.
	t.Run("plugin_killed_and_restarted", func(t *testing.T) {
		t.Parallel()
		const id = "fixture-kill"
		job := p.RunJob(t, "plugin_task", map[string]string{
			"Command": fixture, "Args": HCLList("--state-dir", filepath.Join(p.Base, "kill-state"), "--node-id", "e2e-kill"),
			"Privileged": "true", "PluginID": id, "Type": "monolith",
		})
		al := p.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
		_, _, err := p.WaitPluginAttr(id, "healthy", "true", 50*time.Millisecond, time.Minute)
		must.NoError(t, err, must.Sprint(p.Allocation(t, al.ID).Describe()))
		pid, err := TaskPIDByComm(al.ID, "plugin", "csi-fixture")
		must.NoError(t, err)
		capEff, err := CapEff(pid)
		must.NoError(t, err)
		must.NotEq(t, 0, capEff&capSysAdmin, must.Sprintf("privileged plugin pid %d lacks CAP_SYS_ADMIN: CapEff=%016x", pid, capEff))

		killed := time.Now()
		must.NoError(t, unix.Kill(pid, unix.SIGKILL))
		seen, attrs, err := p.WaitPluginAttr(id, "healthy", "false", 20*time.Millisecond, 10*time.Second)
		must.NoError(t, err)
		took := seen.Sub(killed)
		t.Logf("SIGKILL pid %d -> healthy = false in %v (health_description %q)", pid, took.Round(time.Millisecond), attrs["health_description"])
		must.Less(t, 2*time.Second, took, must.Sprint("the node took too long to say the plugin is unhealthy"))
		must.NotEq(t, "", attrs["health_description"])

		back, attrs, err := p.WaitPluginAttr(id, "healthy", "true", 50*time.Millisecond, 30*time.Second)
		must.NoError(t, err, must.Sprint(p.Allocation(t, al.ID).Describe()))
		t.Logf("SIGKILL -> healthy = true again in %v (vendor %s)", back.Sub(killed).Round(time.Millisecond), attrs["vendor"])

		full := p.Allocation(t, al.ID)
		ts := full.Task("plugin")
		must.NotNil(t, ts)
		must.Eq(t, "running", ts.State, must.Sprint(full.Describe()))
		must.GreaterEq(t, uint64(1), ts.Restarts, must.Sprint(full.Describe()))
		newPID, err := TaskPIDByComm(al.ID, "plugin", "csi-fixture")
		must.NoError(t, err)
		must.NotEq(t, pid, newPID)

		// The driver's health events on the task: healthy, unhealthy with
		// the reason, healthy again.
		unhealthy := fmt.Sprintf("CSI plugin %q unhealthy: ", id)
		var text string
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			text = eventsText(p.Allocation(t, al.ID), "plugin")
			if strings.Contains(text, unhealthy) {
				break
			}
		}
		t.Logf("task events:\n%s", text)
		must.StrContains(t, text, unhealthy, must.Sprint("no unhealthy event on the plugin's task"))
		must.GreaterEq(t, 2, strings.Count(text, fmt.Sprintf("CSI plugin %q healthy", id)), must.Sprint("want a healthy event before and after the kill"))
	})

	// 4b. "nomad alloc exec" in a privileged plugin task runs with the
	// host root's full capability set, as the plugin does.
	t.Run("alloc_exec_privileged_plugin", func(t *testing.T) {
		t.Parallel()
		const id = "fixture-exec"
		job := p.RunJob(t, "plugin_task", map[string]string{
			"Command": fixture, "Args": HCLList("--state-dir", filepath.Join(p.Base, "exec-state"), "--node-id", "e2e-exec"),
			"Privileged": "true", "PluginID": id, "Type": "monolith",
		})
		al := p.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
		_, _, err := p.WaitPluginAttr(id, "healthy", "true", 50*time.Millisecond, time.Minute)
		must.NoError(t, err, must.Sprint(p.Allocation(t, al.ID).Describe()))
		pid, err := TaskPIDByComm(al.ID, "plugin", "csi-fixture")
		must.NoError(t, err)
		pluginCaps, err := CapEff(pid)
		must.NoError(t, err)
		_, host := escFullCaps(t)
		st := execStatus(t, p.Agent, al.ID, "plugin")
		t.Logf("privileged plugin: CapEff=%016x; alloc exec: CapEff=%016x CapBnd=%016x Uid=%s; host root's set %016x",
			pluginCaps, st.capEff, st.capBnd, st.uid, host)
		must.Eq(t, host, pluginCaps, must.Sprintf("the privileged plugin pid %d has CapEff %016x, want the host root's %016x", pid, pluginCaps, host))
		must.Eq(t, "0", st.uid)
		must.Eq(t, host, st.capEff, must.Sprintf("alloc exec in a privileged plugin task has CapEff %016x, want the host root's %016x", st.capEff, host))
		must.Eq(t, host, st.capBnd, must.Sprintf("alloc exec in a privileged plugin task has CapBnd %016x, want the host root's %016x", st.capBnd, host))
	})

	// 5. A plugin started outside Nomad in plugin_socket_dirs is found,
	// fingerprinted the same way, and reported unhealthy once it dies.
	t.Run("socket_dir_plugin", func(t *testing.T) {
		t.Parallel()
		dir := filepath.Join(p.SocketDir, "ext")
		must.NoError(t, os.MkdirAll(dir, 0o755))
		logPath := filepath.Join(p.Base, "sockdir-fixture.log")
		logf, err := os.Create(logPath)
		must.NoError(t, err)
		defer logf.Close()
		cmd := exec.Command(fixture, "--endpoint", "unix://"+filepath.Join(dir, "csi.sock"),
			"--state-dir", filepath.Join(p.Base, "sockdir-state"), "--node-id", "e2e-sockdir",
			"--name", "sockdir.e2e", "--vendor-version", "9.9.9")
		cmd.Stdout, cmd.Stderr = logf, logf
		start := time.Now()
		must.NoError(t, cmd.Start())
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		t.Cleanup(func() {
			_ = unix.Kill(cmd.Process.Pid, unix.SIGKILL)
			<-exited
		})

		// The directory is scanned every 10s.
		seen, attrs, err := p.WaitPluginAttr("sockdir_e2e", "healthy", "true", 100*time.Millisecond, 30*time.Second)
		must.NoError(t, err, must.Sprint(csiTail(logPath, 20)))
		t.Logf("started outside Nomad -> healthy = true in %v", seen.Sub(start).Round(time.Millisecond))
		for k, v := range map[string]string{
			"id": "sockdir.e2e", "source": "socket_dir", "type": "monolith", "socket": filepath.Join(dir, "csi.sock"),
			"vendor": "sockdir.e2e", "version": "9.9.9", "node_id": "e2e-sockdir", "stage_unstage": "true",
			"create_delete_volume": "true",
		} {
			must.Eq(t, v, attrs[k], must.Sprintf("driver.csi.plugin.sockdir_e2e.%s; all: %v", k, attrs))
		}

		killed := time.Now()
		must.NoError(t, unix.Kill(cmd.Process.Pid, unix.SIGKILL))
		<-exited
		seen, attrs, err = p.WaitPluginAttr("sockdir_e2e", "healthy", "false", 20*time.Millisecond, 10*time.Second)
		must.NoError(t, err)
		t.Logf("SIGKILL -> healthy = false in %v (health_description %q)", seen.Sub(killed).Round(time.Millisecond), attrs["health_description"])
		must.Less(t, 2*time.Second, seen.Sub(killed))
		must.Eq(t, "sockdir.e2e", attrs["vendor"], must.Sprint("the last known vendor is kept while the plugin is down"))
	})

	// 6. Third-party plugins run as plugin tasks and report their own
	// names.
	t.Run("mock_plugins", func(t *testing.T) {
		t.Parallel()
		for _, mock := range []struct{ bin, id, vendor string }{
			{"gocsi-mock", "gocsi-mock", "mock.gocsi.rexray.com"},
			{"csi-mock-driver", "k8s-mock", "io.kubernetes.storage.mock"},
		} {
			t.Run(mock.bin, func(t *testing.T) {
				t.Parallel()
				job := p.RunJob(t, "plugin_task", map[string]string{
					"Command": csiBin(t, mock.bin), "Args": HCLList(), "Privileged": "true", "PluginID": mock.id, "Type": "monolith",
				})
				al := p.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
				seen, attrs, err := p.WaitPluginAttr(mock.id, "healthy", "true", 50*time.Millisecond, time.Minute)
				if err != nil {
					logs, _ := p.Nomad("alloc", "logs", "-stderr", al.ID, "plugin")
					t.Fatalf("%v\n%s\nstderr:\n%s", err, p.Allocation(t, al.ID).Describe(), logs)
				}
				t.Logf("%s healthy %v after its task started: vendor=%s version=%s node_id=%s type=%s",
					mock.bin, seen.Sub(p.Allocation(t, al.ID).Task("plugin").StartedAt).Round(time.Millisecond),
					attrs["vendor"], attrs["version"], attrs["node_id"], attrs["type"])
				must.Eq(t, mock.vendor, attrs["vendor"], must.Sprintf("all: %v", attrs))
				must.Eq(t, "true", attrs["node_service"])
				must.Eq(t, "true", attrs["controller_service"])
			})
		}
	})
}

// 3. The privilege rules, on the shared agent (allow_privileged = false).
func TestCSIPluginPrivilege(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	a := shared(t)
	fixture := csiBin(t, "csi-fixture")

	t.Run("privileged_plugin_refused", func(t *testing.T) {
		t.Parallel()
		job, out, err := a.SubmitJob(t, "plugin_task", map[string]string{
			"Command": fixture, "Args": HCLList("--state-dir", "/nonexistent"), "Privileged": "true",
			"PluginID": "refused-monolith", "Type": "monolith",
		})
		t.Cleanup(func() { stopAndPurge(t, a, job.ID) })
		said := out
		if err == nil {
			al := a.WaitAlloc(t, job.ID, startTimeout, StatusFailed)
			said = eventsText(al, "plugin")
			must.Eq(t, 0, len(TaskPIDs(al.ID, "plugin")), must.Sprint("a refused task has processes"))
		}
		must.StrContains(t, said, "allow_privileged", must.Sprintf("the refusal does not name allow_privileged:\n%s", said))
		t.Logf("refused: %s", lineWith(said, "allow_privileged"))
	})

	t.Run("controller_runs_unprivileged", func(t *testing.T) {
		t.Parallel()
		const id = "ctrl-fixture"
		// Not privileged: it sees the fixture where chroot_env binds it,
		// and its state directory is in its own /tmp.
		job := a.RunJob(t, "plugin_task", map[string]string{
			"Command": filepath.Join(TaskCSIBinDir, "csi-fixture"), "Args": HCLList("--state-dir", "/tmp/state"), "Privileged": "false",
			"PluginID": id, "Type": "controller",
		})
		t.Cleanup(func() { stopAndPurge(t, a, job.ID) })
		al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
		_, attrs, err := a.WaitPluginAttr(id, "healthy", "true", 50*time.Millisecond, time.Minute)
		must.NoError(t, err, must.Sprint(a.Allocation(t, al.ID).Describe()))
		t.Logf("controller plugin attributes: %v", attrs)
		must.Eq(t, "controller", attrs["type"])
		must.Eq(t, "true", attrs["controller_service"])
		must.Eq(t, "true", attrs["create_delete_volume"])
		must.Eq(t, "", attrs["node_id"], must.Sprint("a declared controller is not asked for its node"))

		all, err := a.NodeAttributes()
		must.NoError(t, err)
		must.Eq(t, "false", all["driver.csi.allow_privileged"])
		pid, err := TaskPIDByComm(al.ID, "plugin", "csi-fixture")
		must.NoError(t, err)
		capEff, err := CapEff(pid)
		must.NoError(t, err)
		must.Eq(t, 0, capEff&capSysAdmin, must.Sprintf("controller plugin pid %d has CAP_SYS_ADMIN: CapEff=%016x", pid, capEff))
		t.Logf("controller plugin pid %d CapEff=%016x", pid, capEff)
		must.Eq(t, "running", a.Allocation(t, al.ID).Task("plugin").State)
	})
}

// stopAndPurge stops a job on an agent that outlives the test, waits for
// its allocations to end, and purges it.
func stopAndPurge(t *testing.T, a *Agent, jobID string) {
	if out, err := a.Nomad("job", "stop", "-detach", jobID); err != nil {
		t.Logf("nomad job stop %s: %v: %s", jobID, err, out)
		return
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		allocs, err := a.JobAllocations(jobID)
		if err != nil || allTerminal(allocs) {
			break
		}
	}
	if out, err := a.Nomad("job", "stop", "-purge", "-detach", jobID); err != nil {
		t.Logf("nomad job stop -purge %s: %v: %s", jobID, err, out)
	}
}

// mountInfo returns the topmost mount at path in the test's mount
// namespace (the host's), or nil.
func mountInfo(path string) *mounter.MountPoint {
	table, err := mounter.New().List()
	if err != nil {
		return nil
	}
	var found *mounter.MountPoint
	for i := range table {
		if table[i].Path == path {
			found = &table[i]
		}
	}
	return found
}

// cliLines returns the lines of CLI output that contain sub.
func cliLines(out, sub string) string {
	var lines []string
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, sub) {
			lines = append(lines, "  "+strings.TrimSpace(line))
		}
	}
	return strings.Join(lines, "\n")
}
