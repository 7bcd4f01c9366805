//go:build e2e

package e2e

// An image's STOPSIGNAL against a real agent: Nomad passes the driver the
// job's kill_signal, "" when it sets none, and the driver then stops a task
// from an image with its image's signal, after the agent restarted and
// recovered the task too; an image that asks for SIGSTOP freezes its task,
// which kill_timeout's kill still ends. A real-time STOPSIGNAL (a systemd
// image's SIGRTMIN+3) reaches the task as signal 37 after the restart, and
// one the task ignores is ended by kill_timeout's kill.

import (
	"path/filepath"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// withStopSignal is img with its configuration's StopSignal set to sig.
func withStopSignal(t *testing.T, img v1.Image, sig string) v1.Image {
	t.Helper()
	cf, err := img.ConfigFile()
	must.NoError(t, err)
	cf = cf.DeepCopy()
	cf.Config.StopSignal = sig
	img, err = mutate.ConfigFile(img, cf)
	must.NoError(t, err)
	return img
}

func TestImageStopSignal(t *testing.T) {
	t.Parallel()
	dirs := newImageDirs(t)
	layout := filepath.Join(dirs.images, "layout")
	tools := toolsImage(t)
	must.NoError(t, imagebuild.WriteLayout(layout, "usr1", withStopSignal(t, tools, "usr1")))
	must.NoError(t, imagebuild.WriteLayout(layout, "stop", withStopSignal(t, tools, "19")))
	must.NoError(t, imagebuild.WriteLayout(layout, "rt", withStopSignal(t, tools, "SIGRTMIN+3")))
	must.NoError(t, imagebuild.WriteLayout(layout, "rtmax", withStopSignal(t, tools, "RTMAX-1")))
	a := StartAgent(t, dirs.agentOptions(AgentOptions{Persistent: true, Drivers: []string{DriverName}}))

	// The job sets no kill_signal (image_task.hcl); kill_timeout is 3s.
	script := volHCLString(`trap 'echo caught-usr1; exit 0' USR1; trap 'echo caught-int; exit 7' INT; echo ready; while :; do sleep 0.1; done`)
	usr1 := a.RunJob(t, "image_task", map[string]string{"Type": "service", "Count": "1", "Image": "oci:" + layout + ":usr1",
		"Script": script, "User": "root", "ReadOnly": ""})
	stop := a.RunJob(t, "image_task", map[string]string{"Type": "service", "Count": "1", "Image": "oci:" + layout + ":stop",
		"Script": script, "User": "root", "ReadOnly": ""})
	// busybox's trap takes real-time signals by number: SIGRTMIN+3 is
	// 37, RTMAX-1 is 63, which this task ignores.
	rtScript := volHCLString(`trap 'echo caught-rt; exit 0' 37; trap 'echo caught-int; exit 7' INT; echo ready; while :; do sleep 0.1; done`)
	ignoring := volHCLString(`trap '' 63; trap 'echo caught-int; exit 7' INT; echo ready; while :; do sleep 0.1; done`)
	rt := a.RunJob(t, "image_task", map[string]string{"Type": "service", "Count": "1", "Image": "oci:" + layout + ":rt",
		"Script": rtScript, "User": "root", "ReadOnly": ""})
	rtIgnored := a.RunJob(t, "image_task", map[string]string{"Type": "service", "Count": "1", "Image": "oci:" + layout + ":rtmax",
		"Script": ignoring, "User": "root", "ReadOnly": ""})
	t.Cleanup(func() { a.stopJobs([]string{usr1.ID, stop.ID, rt.ID, rtIgnored.ID}, time.Minute) })
	alUsr1 := a.WaitAlloc(t, usr1.ID, 2*time.Minute, StatusRunning)
	alStop := a.WaitAlloc(t, stop.ID, 2*time.Minute, StatusRunning)
	alRT := a.WaitAlloc(t, rt.ID, 2*time.Minute, StatusRunning)
	alRTIgnored := a.WaitAlloc(t, rtIgnored.ID, 2*time.Minute, StatusRunning)
	for _, id := range []string{alUsr1.ID, alStop.ID, alRT.ID, alRTIgnored.ID} {
		a.WaitLogs(t, id, "t", "ready", time.Minute)
	}

	// The signal is the task's state: a driver that recovers the task
	// stops it with it.
	must.NoError(t, a.Restart())
	volWaitRecovered(t, a, []string{alUsr1.ID, alStop.ID, alRT.ID, alRTIgnored.ID}, 30*time.Second)

	a.StopJob(t, usr1.ID)
	al := a.WaitAllocID(t, alUsr1.ID, endTimeout, StatusComplete, StatusFailed)
	logs := a.AllocLogs(t, al.ID, "t", false)
	must.StrContains(t, logs, "caught-usr1", must.Sprintf("logs:\n%s\n%s", logs, al.Describe()))
	must.StrNotContains(t, logs, "caught-int")
	ev := terminated(t, al, "t")
	must.Eq(t, 0, ev.ExitCode, must.Sprint(al.Describe()))

	a.StopJob(t, stop.ID)
	al = a.WaitAllocID(t, alStop.ID, endTimeout, StatusComplete, StatusFailed)
	ev = terminated(t, al, "t")
	killed := ev.Signal == int(unix.SIGKILL) || ev.ExitCode == 128+int(unix.SIGKILL)
	must.True(t, killed, must.Sprintf("want a SIGKILL exit after kill_timeout, got %q:\n%s", ev.DisplayMessage, al.Describe()))
	must.StrNotContains(t, a.AllocLogs(t, al.ID, "t", false), "caught-int")
	must.SliceEmpty(t, TaskPIDs(al.ID, "t"))

	a.StopJob(t, rt.ID)
	al = a.WaitAllocID(t, alRT.ID, endTimeout, StatusComplete, StatusFailed)
	logs = a.AllocLogs(t, al.ID, "t", false)
	must.StrContains(t, logs, "caught-rt", must.Sprintf("logs:\n%s\n%s", logs, al.Describe()))
	must.StrNotContains(t, logs, "caught-int")
	must.Eq(t, 0, terminated(t, al, "t").ExitCode, must.Sprint(al.Describe()))

	a.StopJob(t, rtIgnored.ID)
	al = a.WaitAllocID(t, alRTIgnored.ID, endTimeout, StatusComplete, StatusFailed)
	ev = terminated(t, al, "t")
	killed = ev.Signal == int(unix.SIGKILL) || ev.ExitCode == 128+int(unix.SIGKILL)
	must.True(t, killed, must.Sprintf("want a SIGKILL exit after kill_timeout, got %q:\n%s", ev.DisplayMessage, al.Describe()))
	must.StrNotContains(t, a.AllocLogs(t, al.ID, "t", false), "caught-int")
	must.SliceEmpty(t, TaskPIDs(al.ID, "t"))
}
