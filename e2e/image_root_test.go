//go:build e2e

package e2e

// Tasks whose root is their image, against a real agent: the e2e fixture
// plugin from its image serves volumes whose mounts reach the host, from an
// OCI archive with no registry as from a registry; an isolated task from an
// image sees the image, not the host, as the image's user; readonly_rootfs.
// The images are built here from host files (e2e/imagebuild), no network.
// (image_test.go has the pulls themselves: errors, events, one fetch per
// blob for two tasks.)

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// toolsImage is a small image for tasks: the host's static busybox as
// /bin/* and perl with its libraries (what the escape suite's attacks
// run), an /etc/passwd with root and nobody, and an /etc/name a task can
// tell the image by. It is two layers, the second on top of the first.
func toolsImage(t testing.TB) v1.Image {
	t.Helper()
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("test needs a static /bin/busybox (Debian's busybox-static) to make an image")
	}
	base, err := imagebuild.HostFiles(map[string]string{"/bin/busybox": "/bin/busybox"})
	must.NoError(t, err)
	out, err := exec.Command("/bin/busybox", "--list").Output()
	must.NoError(t, err)
	for _, applet := range strings.Fields(string(out)) {
		if applet != "busybox" {
			base = append(base, imagebuild.Symlink("bin/"+applet, "busybox"))
		}
	}
	base = append(base,
		imagebuild.Dir("tmp", 0o1777),
		imagebuild.File("etc/passwd", []byte("root:x:0:0::/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"), 0o644),
		imagebuild.File("etc/group", []byte("root:x:0:\nnogroup:x:65534:\n"), 0o644),
		imagebuild.File("etc/name", []byte("tools-image\n"), 0o644))
	l0, err := imagebuild.Layer(base...)
	must.NoError(t, err)
	perl, err := imagebuild.HostFiles(nil, "/usr/bin/perl")
	must.NoError(t, err)
	l1, err := imagebuild.Layer(perl...)
	must.NoError(t, err)
	img, err := imagebuild.Build(imagebuild.Spec{Env: []string{"PATH=/usr/bin:/bin"}}, l0, l1)
	must.NoError(t, err)
	return img
}

// imageDirs are the directory the tests' images are written to (the
// driver's local_image_dirs) and the host volume a plugin from an image
// keeps its state in.
type imageDirs struct {
	images string
	state  string
}

func newImageDirs(t testing.TB) imageDirs {
	t.Helper()
	base := OwnedTempDir(t, "ncsp-")
	// Registered before the test's agent starts, so it runs after the
	// agent's Close: the images, the plugins' state and what the tests
	// put beside them go with the test, not with the next run's sweep.
	t.Cleanup(func() { cleanupPluginBase(t, base) })
	d := imageDirs{images: filepath.Join(base, "images"), state: filepath.Join(base, "state")}
	must.NoError(t, os.MkdirAll(d.images, 0o700))
	must.NoError(t, os.MkdirAll(d.state, 0o755))
	return d
}

// agentOptions are an agent's options for the image tests: the images'
// directory as local_image_dirs and the state directory as the host
// volume "image-state".
func (d imageDirs) agentOptions(opts AgentOptions) AgentOptions {
	opts.DriverConfig += fmt.Sprintf("\n    local_image_dirs = [%q]", d.images)
	opts.ClientConfig += fmt.Sprintf("\n  host_volume \"image-state\" {\n    path = %q\n  }", d.state)
	return opts
}

// startImageFixture runs the fixture from image (a reference) as plugin
// id, its state in the agent's host volume "image-state" (dirs.state), and
// waits until it is healthy.
func startImageFixture(t *testing.T, a *Agent, dirs imageDirs, id, image string) *VolFixture {
	t.Helper()
	dir := filepath.Join(dirs.state, id)
	must.NoError(t, os.MkdirAll(dir, 0o755))
	p := &VolFixture{ID: id, StateDir: filepath.Join(dir, "state"), CallLog: filepath.Join(dir, "calls.log"), agent: a, t: t}
	args := []string{"--state-dir", p.StateDir, "--node-id", "e2e-node", "--log-calls", p.CallLog}
	job := a.RunJob(t, "image_plugin", map[string]string{
		"PluginID": id, "PluginType": "monolith", "Image": image, "Args": volHCLList(args),
		"HostVolume": "image-state", "StatePath": dirs.state,
	})
	p.JobID = job.ID
	t.Cleanup(func() { a.stopJobs([]string{job.ID}, time.Minute) })
	al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusRunning)
	p.AllocID = al.ID
	a.WaitVolPluginHealthy(t, id, time.Minute)
	return p
}

// imageGrant is a privileged_grant block (HCL) for the jobs named job
// (a glob), in every namespace, pinned to image ("repo@sha256:...").
func imageGrant(job, image string) string {
	return fmt.Sprintf("    privileged_grant {\n      namespace = \"*\"\n      job       = %q\n      image     = %q\n    }\n", job, image)
}

// volumeMountsOnHost lists the host's mounts under the driver's stage root
// whose root is the fixture's directory of volume volID.
func volumeMountsOnHost(t *testing.T, a *Agent, volID string) []string {
	t.Helper()
	table, err := mounter.New().List()
	must.NoError(t, err)
	var out []string
	for _, mp := range table {
		if mounter.PathWithin(mp.Path, filepath.Join(a.DriverRoot, "mnt")) && strings.HasSuffix(mp.Root, "/volumes/"+volID) {
			out = append(out, mp.Path)
		}
	}
	return out
}

func TestImageTasks(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	dirs := newImageDirs(t)
	plugin := fixtureImage(t)
	archive := filepath.Join(dirs.images, "plugin.tar")
	must.NoError(t, imagebuild.WriteOCIArchive(archive, "plugin", plugin))
	layout := filepath.Join(dirs.images, "layout")
	must.NoError(t, imagebuild.WriteLayout(layout, "tools", toolsImage(t)))
	reg := StartRegistry(t)
	regRef, err := reg.Push("csi/fixture:root", plugin)
	must.NoError(t, err)
	digest, err := plugin.Digest()
	must.NoError(t, err)
	// The operator grants the plugin jobs privilege for the fixture's
	// image, pinned by its digest, and nothing else.
	a := StartAgent(t, dirs.agentOptions(AgentOptions{AllowPrivileged: true,
		Grants:       imageGrant("image_plugin-*", "fixture@"+digest.String()) + imageGrant("image_native_plugin-*", "fixture@"+digest.String()),
		DriverConfig: fmt.Sprintf("    registry_ca_file = %q\n    auth {\n      config = %q\n    }", reg.CAFile, reg.DockerConfig(t, reg.Password))}))
	t.Cleanup(func() { volFinalCheck(t, a) })

	// Nomad's own csi_plugin block on a task from the image: Nomad counts
	// the plugin healthy, creates a volume through it, and a workload
	// (group volume block, volume_mount) writes into it. It runs first and
	// alone: waiting for Nomad to release the volume's claims runs the
	// servers' garbage collection, which would remove the finished
	// allocations of the cases beside it while they read them.
	t.Run("native_plugin_from_image", func(t *testing.T) {
		const id = "img-native"
		dir := filepath.Join(dirs.state, id)
		must.NoError(t, os.MkdirAll(dir, 0o755))
		plug := a.RunJob(t, "image_native_plugin", map[string]string{
			"PluginID": id, "Image": regRef, "HostVolume": "image-state", "StatePath": dirs.state,
			"Args": volHCLList([]string{"--state-dir", filepath.Join(dir, "state"), "--node-id", "e2e-native"}),
		})
		t.Cleanup(func() { a.stopJobs([]string{plug.ID}, time.Minute) })
		pal := a.WaitAlloc(t, plug.ID, 2*time.Minute, StatusRunning)
		if _, err := a.WaitNativePlugin(id, 1, 1, time.Minute); err != nil {
			t.Fatalf("%v\n%s", err, a.Allocation(t, pal.ID).Describe())
		}
		vol := "img-native-" + escUniq()
		must.NoError(t, a.CreateNativeVolume(vol, id, "single-node-writer", "dir"))
		t.Cleanup(func() {
			if err := a.DeleteNativeVolume(vol, time.Minute); err != nil {
				t.Errorf("%v", err)
			}
		})
		token := "native-image-" + escUniq()
		w := a.RunJob(t, "native_workload", map[string]string{"Type": "batch", "Count": "1", "Driver": DriverName,
			"VolumeID": vol, "AccessMode": "single-node-writer", "Dest": "/data",
			"Script": "set -e\necho " + token + " > /data/token\necho wrote: $(cat /data/token)"})
		t.Cleanup(func() { a.stopJobs([]string{w.ID}, time.Minute) })
		wal := a.WaitAlloc(t, w.ID, 2*time.Minute, StatusComplete)
		must.StrContains(t, a.AllocLogs(t, wal.ID, "t", false), "wrote: "+token)
		if _, err := a.WaitNativeVolumeReleased(vol, time.Minute); err != nil {
			t.Fatalf("%v", err)
		}
		// What the workload wrote is in the plugin's backing directory on
		// the host, which the plugin in its image keeps in its host volume.
		matches, err := filepath.Glob(filepath.Join(dir, "state", "volumes", "*", "token"))
		must.NoError(t, err)
		must.SliceLen(t, 1, matches, must.Sprintf("the token in the plugin's volumes under %s", dir))
		b, err := os.ReadFile(matches[0])
		must.NoError(t, err)
		must.Eq(t, token+"\n", string(b))
	})

	// The fixture from its image becomes healthy, and the volume it stages
	// and publishes for a workload is a mount on the host, its writes in
	// the fixture's backing directory, gone again once the workload ends:
	// from an OCI archive with no registry, and from a registry.
	servesVolumes := func(t *testing.T, fx *VolFixture) {
		name := "img-vol-" + escUniq()
		w := a.RunVolJob(t, VolJob{Type: "service", Script: `echo from-the-workload > /data/hello && echo written && exec sleep 3600`,
			Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: "/data", Create: true, CreateType: "dir"}}})
		t.Cleanup(func() { a.stopJobs([]string{w.ID}, time.Minute) })
		al := a.WaitAlloc(t, w.ID, volTimeout, StatusRunning)
		a.WaitLogs(t, al.ID, "t", "written", volTimeout)
		volID := fx.VolumeID(name)
		must.NotEq(t, "", volID, must.Sprintf("the fixture has no volume %s", name))
		mounts := volumeMountsOnHost(t, a, volID)
		must.SliceNotEmpty(t, mounts, must.Sprint("the volume the plugin in its image published is no mount on the host"))
		t.Logf("the volume's mounts on the host: %v", mounts)
		b, err := os.ReadFile(filepath.Join(fx.StateDir, "volumes", volID, "hello"))
		must.NoError(t, err)
		must.Eq(t, "from-the-workload\n", string(b))
		a.stopJobs([]string{w.ID}, time.Minute)
		deadline := time.Now().Add(time.Minute)
		for len(volumeMountsOnHost(t, a, volID)) > 0 {
			if time.Now().After(deadline) {
				t.Fatalf("the volume's mounts are still on the host a minute after its workload stopped: %v", volumeMountsOnHost(t, a, volID))
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	t.Run("plugin_from_oci_archive", func(t *testing.T) {
		t.Parallel()
		servesVolumes(t, startImageFixture(t, a, dirs, "img-archive", "oci-archive:"+archive+":plugin"))
	})
	// The same from a registry (TLS with the test CA, the plugin's auth
	// config), run beside the archive's case as a second plugin.
	t.Run("plugin_from_registry", func(t *testing.T) {
		t.Parallel()
		servesVolumes(t, startImageFixture(t, a, dirs, "img-registry", regRef))
	})

	// A privileged plugin job from an image the grant does not pin is
	// refused before it runs, naming privileged_grant and the digest its
	// image resolved to; the same job from the pinned image runs (above).
	t.Run("privileged_image_outside_grant_refused", func(t *testing.T) {
		t.Parallel()
		other := "oci:" + layout + ":tools"
		job := a.RunJob(t, "image_plugin", map[string]string{
			"PluginID": "img-ungranted", "PluginType": "monolith", "Image": other, "Args": volHCLList(nil),
			"HostVolume": "image-state", "StatePath": dirs.state,
		})
		t.Cleanup(func() { a.stopJobs([]string{job.ID}, time.Minute) })
		al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusFailed, StatusPending)
		text := eventsNaming(t, a, al.ID, "plugin", "privileged_grant")
		t.Logf("the plugin task's events:\n%s", text)
		must.StrContains(t, text, "privileged_grant")
		must.StrContains(t, text, "resolved to sha256:")
		must.StrNotContains(t, text, "Started")
		must.SliceEmpty(t, TaskPIDs(al.ID, "plugin"))
	})

	// The granted image with the job's own entrypoint (a shell and its
	// script, as root on the node) is refused before anything runs, naming
	// the entrypoint and the grant; the image's own program runs (above).
	t.Run("granted_image_with_job_entrypoint_refused", func(t *testing.T) {
		t.Parallel()
		job := a.RunJob(t, "image_plugin", map[string]string{
			"PluginID": "img-entry", "PluginType": "monolith", "Image": regRef, "Args": volHCLList(nil),
			"HostVolume": "image-state", "StatePath": dirs.state,
			"Entrypoint": volHCLList([]string{"/bin/sh", "-c", "id > " + filepath.Join(dirs.state, "entrypoint-ran")}),
		})
		t.Cleanup(func() { a.stopJobs([]string{job.ID}, time.Minute) })
		al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusFailed, StatusPending)
		text := eventsNaming(t, a, al.ID, "plugin", "privileged_grant")
		t.Logf("the plugin task's events:\n%s", text)
		must.StrContains(t, text, `entrypoint ["/bin/sh" "-c"`)
		must.StrContains(t, text, "is not allowed in this task")
		must.StrContains(t, text, "privileged_grant")
		must.StrNotContains(t, text, "Started")
		must.SliceEmpty(t, TaskPIDs(al.ID, "plugin"))
		_, err := os.Stat(filepath.Join(dirs.state, "entrypoint-ran"))
		must.ErrorIs(t, err, os.ErrNotExist)
	})

	// An isolated task from an image sees the image, not the host, runs as
	// nobody (the image's own) and writes only its own layer; with
	// readonly_rootfs it writes nothing.
	t.Run("isolated_task_sees_its_image", func(t *testing.T) {
		t.Parallel()
		script := `echo "name=$(cat /etc/name)"; echo "ids=$(id -u):$(id -g)"
if [ -e /usr/sbin/losetup ] || [ -e /etc/os-release ]; then echo host=visible; else echo host=absent; fi
if echo x > /tmp/x 2>/dev/null; then echo tmp=writable; else echo tmp=read-only; fi
if touch /etc/written 2>/dev/null; then echo etc=writable; else echo etc=read-only; fi`
		for _, tc := range []struct {
			user, readOnly, ids, etc string
		}{
			{"", "", "65534:65534", "read-only"}, // the image's nobody, who may not write /etc
			{"root", "", "0:0", "writable"},      // into the task's own layer
			{"root", "true", "0:0", "read-only"}, // readonly_rootfs
		} {
			job := a.RunJob(t, "image_task", map[string]string{"Type": "batch", "Count": "1", "Image": "oci:" + layout + ":tools",
				"Script": volHCLString(script), "User": tc.user, "ReadOnly": tc.readOnly})
			t.Cleanup(func() { a.stopJobs([]string{job.ID}, time.Minute) })
			al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusComplete)
			out := escLogs(t, a, al.ID, "t")
			t.Logf("user=%q readonly_rootfs=%q: %s", tc.user, tc.readOnly, out)
			must.StrContains(t, out, "name=tools-image")
			must.StrContains(t, out, "ids="+tc.ids)
			must.StrContains(t, out, "host=absent")
			must.StrContains(t, out, "tmp=writable")
			must.StrContains(t, out, "etc="+tc.etc)
		}
	})
}

// A task whose root is its image survives the agent's (and the driver's)
// restart: the same process, recovered, its root still the image with what
// it wrote in its own layer (the overlay lives in the task's mount
// namespace, which the task holds), "nomad alloc exec" still in it; and
// the store still knows the image is in use: a GC that runs every second,
// with image_gc = "1s", removes it only once the task is gone.
func TestImageTaskSurvivesAgentRestart(t *testing.T) {
	t.Parallel()
	dirs := newImageDirs(t)
	layout := filepath.Join(dirs.images, "layout")
	must.NoError(t, imagebuild.WriteLayout(layout, "tools", toolsImage(t)))
	a := StartAgent(t, dirs.agentOptions(AgentOptions{Persistent: true, Drivers: []string{DriverName},
		DriverConfig: `    image_gc = "1s"`}))
	job := a.RunJob(t, "image_task", map[string]string{"Type": "service", "Count": "1", "Image": "oci:" + layout + ":tools",
		"Script": volHCLString(`echo mine > /etc/mine && echo started && exec sleep 3600`), "User": "root", "ReadOnly": ""})
	t.Cleanup(func() { a.stopJobs([]string{job.ID}, time.Minute) })
	al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "started", time.Minute)
	pids := TaskPIDs(al.ID, "t")
	must.SliceNotEmpty(t, pids)
	startedAt := al.Task("t").StartedAt
	inUse := func() bool {
		for _, in := range listImages(t, a.DriverRoot) {
			for _, u := range in.InUseBy {
				if strings.HasPrefix(u.TaskID, al.ID+"/") {
					return true
				}
			}
		}
		return false
	}
	must.True(t, inUse(), must.Sprint("the store does not know the task uses its image"))

	must.NoError(t, a.Restart())
	volWaitRecovered(t, a, []string{al.ID}, 30*time.Second)
	var out string
	var err error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if out, err = a.AllocExec(al.ID, "t", "/bin/cat", "/etc/mine", "/etc/name"); err == nil {
			break
		}
	}
	must.NoError(t, err, must.Sprintf("nomad alloc exec after the restart: %s", out))
	must.StrContains(t, out, "mine")
	must.StrContains(t, out, "tools-image")
	al = a.WaitAllocID(t, al.ID, 30*time.Second, StatusRunning)
	must.True(t, al.Task("t").StartedAt.Equal(startedAt), must.Sprint("the task was started again"))
	must.Eq(t, pids, TaskPIDs(al.ID, "t"), must.Sprint("the task's processes changed across the restart"))

	// Three GC periods: the image stays, leased by the recovered task.
	time.Sleep(3 * time.Second)
	must.True(t, inUse(), must.Sprint("the recovered task's lease on its image is gone"))
	must.SliceLen(t, 1, listImages(t, a.DriverRoot))

	a.StopJob(t, job.ID)
	a.WaitAllocID(t, al.ID, time.Minute, StatusComplete, StatusFailed)
	deadline := time.Now().Add(30 * time.Second)
	for len(listImages(t, a.DriverRoot)) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the image of a task that is gone is still in the store after image_gc: %+v", listImages(t, a.DriverRoot))
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// eventsNaming is the text of the task's events once one of them contains
// want, or after a minute without (the caller's checks then say what is
// missing).
func eventsNaming(t *testing.T, a *Agent, allocID, task, want string) string {
	t.Helper()
	var text string
	deadline := time.Now().Add(time.Minute)
	for !strings.Contains(text, want) && time.Now().Before(deadline) {
		time.Sleep(250 * time.Millisecond)
		text = eventsText(a.Allocation(t, allocID), task)
	}
	return text
}
