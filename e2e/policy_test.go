//go:build e2e

package e2e

// The driver's policies against a real agent (issue 9, items 5-7): a
// privileged task that is not a CSI plugin task is refused; a plugin task
// cannot take the id of a plugin in plugin_socket_dirs; a task of one
// Nomad namespace cannot use a volume that belongs to another. The cases
// share one PluginAgent (allow_privileged = true, privileged_plugins_only
// and allow_cross_namespace_volumes at their defaults, a socket
// directory) and run in parallel.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/nomad/api"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

func TestPolicy(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	fixture := csiBin(t, "csi-fixture")
	p := StartPluginAgent(t)

	// Item 5: privileged = true without a csi_plugin block.
	t.Run("privileged_non_plugin_refused", func(t *testing.T) {
		t.Parallel()
		job, out, err := p.SubmitJob(t, "policy-privileged", nil)
		must.NoError(t, err, must.Sprint(out))
		al := p.WaitAlloc(t, job.ID, startTimeout, StatusFailed)
		text := eventsText(al, "t")
		t.Logf("events:\n%s", text)
		must.StrContains(t, text, "privileged = true is only allowed for CSI plugin tasks on this node (privileged_plugins_only = true in the driver's plugin config)")
		must.Eq(t, 0, len(TaskPIDs(al.ID, "t")), must.Sprint("a refused task has processes"))
		all, err := p.NodeAttributes()
		must.NoError(t, err)
		must.Eq(t, "true", all["driver.csi.privileged_plugins_only"])
	})

	// Item 6: a controller plugin task (no privilege needed) names itself
	// with the id of an operator's plugin in plugin_socket_dirs.
	t.Run("controller_cannot_shadow_socket_plugin", func(t *testing.T) {
		t.Parallel()
		x := strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
		id := "policysock" + x
		dir := filepath.Join(p.SocketDir, "pol-"+x)
		must.NoError(t, os.MkdirAll(dir, 0o755))
		logPath := filepath.Join(p.Base, "policy-sock-"+x+".log")
		logf, err := os.Create(logPath)
		must.NoError(t, err)
		defer logf.Close()
		cmd := exec.Command(fixture, "--endpoint", "unix://"+filepath.Join(dir, "csi.sock"),
			"--state-dir", filepath.Join(p.Base, "policy-sock-state-"+x), "--node-id", "e2e-policy", "--name", id)
		cmd.Stdout, cmd.Stderr = logf, logf
		must.NoError(t, cmd.Start())
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		t.Cleanup(func() {
			_ = unix.Kill(cmd.Process.Pid, unix.SIGKILL)
			<-exited
		})
		_, attrs, err := p.WaitPluginAttr(id, "healthy", "true", 100*time.Millisecond, 30*time.Second)
		must.NoError(t, err, must.Sprint(csiTail(logPath, 20)))
		must.Eq(t, "socket_dir", attrs["source"])

		job, out, err := p.SubmitJob(t, "plugin_task", map[string]string{
			"Command": fixture, "Args": HCLList("--state-dir", filepath.Join(p.Base, "policy-squat-"+x)),
			"Privileged": "false", "PluginID": id, "Type": "controller",
		})
		must.NoError(t, err, must.Sprint(out))
		al := p.WaitAlloc(t, job.ID, startTimeout, StatusFailed)
		text := eventsText(al, "plugin")
		t.Logf("events:\n%s", text)
		must.StrContains(t, text, fmt.Sprintf("csi_plugin id %q is already served on this node by the socket %q in plugin_socket_dirs", id, filepath.Join(dir, "csi.sock")))
		must.Eq(t, 0, len(TaskPIDs(al.ID, "plugin")), must.Sprint("a refused plugin task has processes"))

		// The operator's plugin still owns the id.
		all, err := p.NodeAttributes()
		must.NoError(t, err)
		prefix := "driver.csi.plugin." + id + "."
		must.Eq(t, "socket_dir", all[prefix+"source"], must.Sprintf("attributes %s*", prefix))
		must.Eq(t, "true", all[prefix+"healthy"])
		must.Eq(t, filepath.Join(dir, "csi.sock"), all[prefix+"socket"])
	})

	// Item 7: namespace B names namespace A's volume.
	t.Run("volume_of_other_namespace_refused", func(t *testing.T) {
		t.Parallel()
		x := strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
		fx := p.StartVolFixture(t, "polfx"+x, VolFixtureOptions{})
		nsA, nsB := "pol-a-"+x, "pol-b-"+x
		for _, ns := range []string{nsA, nsB} {
			out, err := p.Nomad("namespace", "apply", "-description", "policy e2e", ns)
			must.NoError(t, err, must.Sprint(out))
		}
		volID := "polvol-" + x
		run := func(ns, dest string) Job {
			t.Helper()
			job, err := p.RenderJob("policy-volume", map[string]string{
				"Namespace": ns, "PluginID": fx.ID, "VolumeID": volID, "Dest": dest,
			})
			must.NoError(t, err)
			t.Cleanup(func() { stopNamespaced(t, p.Agent, ns, job.ID) })
			out, err := p.Nomad("job", "run", "-detach", job.File)
			must.NoError(t, err, must.Sprint(out))
			return job
		}
		dst := filepath.Join(p.Base, "policy-dst-"+x)
		a := run(nsA, filepath.Join(dst, "a"))
		alA := waitNamespacedAlloc(t, p.Agent, nsA, a.ID, volTimeout, StatusRunning)
		must.StrContains(t, eventsText(alA, "t"), `Published volume "data"`)
		st, err := csihook.ReadJournal(filepath.Join(p.RootDir, "journal"))
		must.NoError(t, err)
		var owners []string
		for _, v := range st.Volumes {
			if v.PluginID == fx.ID {
				owners = append(owners, v.Namespace+" "+v.Server)
			}
		}
		must.Eq(t, []string{nsA + ` job "` + fx.JobID + `" in namespace "default"`}, owners)

		b := run(nsB, filepath.Join(dst, "b"))
		alB := waitNamespacedAlloc(t, p.Agent, nsB, b.ID, volTimeout, StatusFailed)
		text := eventsText(alB, "t")
		t.Logf("events of namespace %s's task:\n%s", nsB, text)
		must.StrContains(t, text, fmt.Sprintf(`(created on this node as %q) of CSI plugin %q belongs to namespace %q`, volID, fx.ID, nsA))
		must.StrContains(t, text, fmt.Sprintf(`not to namespace %q`, nsB))
		must.StrContains(t, text, "allow_cross_namespace_volumes = true")
		must.Eq(t, 0, len(TaskPIDs(alB.ID, "t")), must.Sprint("a refused task has processes"))
		pubs := 0
		for _, c := range fx.Calls() {
			if strings.HasPrefix(c, "NodePublishVolume ") {
				pubs++
			}
		}
		must.Eq(t, 1, pubs, must.Sprintf("the plugin published for the refused task too: %v", fx.Calls()))
		// Namespace A's task is untouched.
		must.Eq(t, StatusRunning, p.Allocation(t, alA.ID).ClientStatus)
	})
}

// waitNamespacedAlloc is WaitAlloc for a job outside the default
// namespace.
func waitNamespacedAlloc(t *testing.T, a *Agent, ns, jobID string, timeout time.Duration, want ...string) *Allocation {
	t.Helper()
	return a.waitAllocStatus(t, ns, jobID, fmt.Sprintf("allocation of job %s/%s", ns, jobID), timeout, want, func() (*Allocation, error) {
		allocs, _, err := a.api.Jobs().Allocations(jobID, false, &api.QueryOptions{Namespace: ns})
		if err != nil || len(allocs) == 0 {
			return nil, err
		}
		sort.Slice(allocs, func(i, j int) bool { return allocs[i].CreateIndex > allocs[j].CreateIndex })
		return a.allocation(allocs[0].ID)
	})
}

// stopNamespaced stops and purges a job of a namespace (the harness stops
// default-namespace jobs only) and waits for its allocations to end, so
// that its volumes are torn down before the plugin's job stops.
func stopNamespaced(t *testing.T, a *Agent, ns, jobID string) {
	if out, err := a.Nomad("job", "stop", "-namespace", ns, "-detach", jobID); err != nil {
		t.Logf("nomad job stop -namespace %s %s: %v: %s", ns, jobID, err, out)
		return
	}
	for deadline := time.Now().Add(volTimeout); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		allocs, _, err := a.api.Jobs().Allocations(jobID, false, &api.QueryOptions{Namespace: ns})
		running := slices.ContainsFunc(allocs, func(al *AllocStub) bool { return !IsTerminal(al.ClientStatus) })
		if err != nil || !running {
			break
		}
	}
	if out, err := a.Nomad("job", "stop", "-namespace", ns, "-purge", "-detach", jobID); err != nil {
		t.Logf("nomad job stop -purge -namespace %s %s: %v: %s", ns, jobID, err, out)
	}
}
