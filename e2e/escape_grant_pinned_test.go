//go:build e2e

package e2e

// What a job under a granted name (ACLs off: any job author can take it)
// still makes the pinned program do as root. The command pin holds the
// program itself; these are the ways around it that go through what the
// program runs or reads next:
//
//   - PATH: a CSI plugin runs mkfs, mount, losetup or resize2fs by name,
//     and finds them in the PATH it inherits from the job's env block. On
//     the code before this case, a job set PATH=/local/bin:..., rendered
//     its own mkfs.ext4 there with a template, and the pinned fixture ran
//     it as root when a volume was created.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
)

func TestEscapeGrantPinnedPath(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	u := escUniq()
	prefix, plugin := "grant-path-"+u, "path-"+u
	a, command := grantPinnedAgent(t, prefix+"-*", plugin, "")
	marker := filepath.Join(a.Dir, "path-marker-"+u)
	t.Cleanup(func() { escRemove(t, marker) })

	// The job's mkfs.ext4: it writes the marker as whoever runs it, then
	// formats as the real one would, so that nothing else fails.
	evil := fmt.Sprintf("#!/bin/sh\nid -u > %s\nPATH=/usr/sbin:/usr/bin:/sbin:/bin exec mkfs.ext4 \"$@\"\n", marker)
	job := grantRun(t, a, grantJob{ID: prefix + "-plugin", Type: "service", Privileged: true, PluginID: plugin, PluginType: "monolith",
		Command: command, Args: []string{"--state-dir", filepath.Join(a.Dir, "path-state"), "--node-id", "e2e-path"},
		Env:  map[string]string{"PATH": "/local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Data: evil, DataDest: "local/bin/mkfs.ext4", DataPerms: "0755"})
	al := waitNamespacedAlloc(t, a, "default", job, escTimeout, StatusRunning, StatusFailed)
	text := eventsText(al, "t")
	t.Logf("events of the job's plugin %s:\n%s", job, text)
	if al.ClientStatus == StatusRunning {
		// It runs under the grant: a volume created through it has the
		// fixture format an image with mkfs.ext4, found in the job's PATH.
		_, _, err := a.WaitPluginAttr(plugin, "healthy", "true", 200*time.Millisecond, escTimeout)
		must.NoError(t, err, must.Sprint(eventsText(a.Allocation(t, al.ID), "t")))
		work := grantRun(t, a, grantJob{Script: "echo DONE", Volume: &VolSpec{Name: "data", Plugin: plugin, ID: "path-vol-" + u,
			Dest: "/data", Create: true, CreateType: "ext4"}})
		wAl := waitNamespacedAlloc(t, a, "default", work, escTimeout, StatusComplete, StatusFailed)
		t.Logf("events of the workload %s:\n%s", work, eventsText(wAl, "t"))
		if fi, err := os.Stat(marker); err == nil {
			b, _ := os.ReadFile(marker)
			t.Errorf("ESCAPED: the pinned plugin ran the job's /local/bin/mkfs.ext4, which wrote %s as uid %s (owner uid %d)",
				marker, strings.TrimSpace(string(b)), fi.Sys().(*syscall.Stat_t).Uid)
		}
		t.Fatalf("job %s runs with its own PATH under the pinned grant: it was not refused", job)
	}
	must.StrContains(t, text, `env PATH entry "/local/bin"`)
	must.StrContains(t, text, `inside the task's mount "/local"`)
	must.SliceEmpty(t, TaskPIDs(al.ID, "t"), must.Sprint("a refused task has processes"))
	escMustNotExist(t, marker, "the marker of the job's mkfs.ext4")
}

// Exec into the pinned task: nomad alloc exec (and so a script check, a
// template's change_script, an action, which Nomad runs the same way)
// runs any command in the task. On the code before this case, a shell
// exec'd into the job's copy of the pinned plugin wrote a host file as
// root.
func TestEscapeGrantPinnedExec(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	u := escUniq()
	prefix, plugin := "grant-exec-"+u, "exec-"+u
	a, command := grantPinnedAgent(t, prefix+"-*", plugin, "")
	marker := filepath.Join(a.Dir, "exec-marker-"+u)
	t.Cleanup(func() { escRemove(t, marker) })

	job := grantRun(t, a, grantJob{ID: prefix + "-plugin", Type: "service", Privileged: true, PluginID: plugin, PluginType: "monolith",
		Command: command, Args: []string{"--state-dir", filepath.Join(a.Dir, "exec-state"), "--node-id", "e2e-exec"}})
	al := waitNamespacedAlloc(t, a, "default", job, escTimeout, StatusRunning)
	pid, err := TaskPIDByComm(al.ID, "t", "csi-fixture")
	must.NoError(t, err)
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	must.NoError(t, err)
	must.Eq(t, command, exe, must.Sprint("the job's task runs the pinned file"))

	out, err := a.Nomad("alloc", "exec", "-i=false", "-t=false", "-task", "t", al.ID, "/bin/sh", "-c", fmt.Sprintf("id -u > %s && echo wrote", marker))
	t.Logf("nomad alloc exec: err %v, output:\n%s", err, out)
	if fi, serr := os.Stat(marker); serr == nil {
		b, _ := os.ReadFile(marker)
		t.Errorf("ESCAPED: a shell exec'd into the pinned task wrote %s as uid %s (owner uid %d)",
			marker, strings.TrimSpace(string(b)), fi.Sys().(*syscall.Stat_t).Uid)
	}
	must.Error(t, err, must.Sprint("exec into the pinned task was not refused"))
	// Nomad 1.11.3's CLI says only "unexpected EOF" once the session is
	// up; the agent's log has the driver's refusal.
	log, err := a.ReadLog()
	must.NoError(t, err)
	must.StrContains(t, log, "exec into this task is refused: it runs privileged under privileged_grant")
	escMustNotExist(t, marker, "the marker of the exec'd shell")
	// The plugin itself runs on.
	must.Eq(t, StatusRunning, a.Allocation(t, al.ID).ClientStatus)
}

// A template with env = true feeds the task's environment as the env
// block does: the pinned task's checks see its variables too.
func TestEscapeGrantPinnedTemplateEnv(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	u := escUniq()
	prefix, plugin := "grant-tenv-"+u, "tenv-"+u
	a, command := grantPinnedAgent(t, prefix+"-*", plugin, "")
	for i, c := range []struct{ env, want string }{
		{"LD_PRELOAD=/local/evil.so", "env LD_PRELOAD is not allowed in this task"},
		{"PATH=/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", `its env PATH entry "/local/bin" is inside the task's mount "/local"`},
		{"AWS_CONFIG_FILE=/local/aws-config", "env AWS_CONFIG_FILE is not allowed in this task"},
	} {
		job := grantRun(t, a, grantJob{ID: fmt.Sprintf("%s-%d", prefix, i), Privileged: true, PluginID: plugin, PluginType: "monolith",
			Command: command, Args: []string{"--state-dir", filepath.Join(a.Dir, "tenv-state")}, Data: c.env + "\n", DataEnv: true})
		al := waitNamespacedAlloc(t, a, "default", job, escTimeout, StatusRunning, StatusFailed)
		text := eventsText(al, "t")
		if al.ClientStatus == StatusRunning {
			t.Errorf("job %s runs the pinned plugin with %s from its template: it was not refused\n%s", job, c.env, text)
			// It holds the plugin id: stopped (its allocation ended)
			// before the next case.
			stopNamespaced(t, a, "default", job)
			continue
		}
		must.StrContains(t, text, c.want)
		must.SliceEmpty(t, TaskPIDs(al.ID, "t"), must.Sprint("a refused task has processes"))
	}
}

// Another plugin's socket: a job granted the pinned program for a plugin
// id of its own runs it with --endpoint naming the socket of another
// plugin task (root_dir/plugins/<id>/csi.sock, in the host's view every
// privileged task has). The fixture, as most plugins, removes a stale
// socket before it listens. On the code before this case the driver then
// sent the other plugin's volume calls (CreateVolume, NodeStageVolume with
// the volume's secrets, NodePublishVolume) to the job's process.
func TestEscapeGrantPinnedSocket(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	u := escUniq()
	prefix, victim, evil := "grant-sock-"+u, "victim-"+u, "evil-"+u
	// The operator's plugin, and a job granted the same program for a
	// plugin id of its own.
	a, command := grantPinnedAgentWith(t, prefix+"-op", victim, func(command string) string {
		return fmt.Sprintf("\n    privileged_grant {\n      namespace = \"default\"\n      job       = %q\n      command   = %q\n    }\n", prefix+"-evil", command)
	})
	grantRun(t, a, grantJob{ID: prefix + "-op", Type: "service", Privileged: true, PluginID: victim, PluginType: "monolith",
		Command: command, Args: []string{"--state-dir", filepath.Join(a.Dir, "op-state"), "--node-id", "e2e-operator"}})
	_, _, err := a.WaitPluginAttr(victim, "node_id", "e2e-operator", 200*time.Millisecond, time.Minute)
	must.NoError(t, err)

	calls := filepath.Join(a.Dir, "evil-calls.log")
	sock := filepath.Join(a.DriverRoot, "plugins", victim, "csi.sock")
	grantRun(t, a, grantJob{ID: prefix + "-evil", Type: "service", Privileged: true, PluginID: evil, PluginType: "monolith",
		Command: command, Args: []string{"--state-dir", filepath.Join(a.Dir, "evil-state"), "--node-id", "e2e-evil",
			"--log-calls", calls, "--endpoint", "unix://" + sock}})
	waitNamespacedAlloc(t, a, "default", prefix+"-evil", escTimeout, StatusRunning)
	// The job's process listens on the operator's plugin's socket path.
	must.Wait(t, wait.InitialSuccess(wait.ErrorFunc(func() error {
		_, err := os.Stat(calls)
		return err
	}), wait.Timeout(30*time.Second), wait.Gap(200*time.Millisecond)))

	secret := "s3cr3t-" + u
	work := grantRun(t, a, grantJob{Script: "echo DONE", Volume: &VolSpec{Name: "data", Plugin: victim, ID: "sock-vol-" + u,
		Dest: "/data", Create: true, CreateType: "dir", Secrets: map[string]string{"token": secret}}})
	wAl := waitNamespacedAlloc(t, a, "default", work, 3*escTimeout, StatusComplete, StatusFailed)
	t.Logf("events of the workload %s:\n%s", work, eventsText(wAl, "t"))
	b, err := os.ReadFile(calls)
	must.NoError(t, err)
	t.Logf("calls the job's process received:\n%s", b)
	for _, m := range []string{"CreateVolume", "NodeStageVolume", "NodePublishVolume"} {
		if strings.Contains(string(b), m) {
			t.Errorf("ESCAPED: the job's process on plugin %q's socket received %s", victim, m)
		}
	}
	must.Eq(t, StatusFailed, wAl.ClientStatus, must.Sprint("the workload's volume was set up through the job's process"))
	must.StrContains(t, eventsText(wAl, "t"), "is not the plugin task's")
}
