package driver

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

// hostileHolderMark is an argument only the hostile task's holders run
// with, so that a holder left alive anywhere on the host is found.
const hostileHolderMark = "987654"

// hostileHolders is a shell fragment of a task that makes its volume at
// $DEST as hard to let go as a process without privileges can: its working
// directory is in the volume, it tries to mount over part of the volume
// from a user namespace of its own, and a holder that ignores the stop
// signals keeps forking more holders, each with the volume as its working
// directory and a file of it open.
const hostileHolders = `
cd "$DEST" || exit 1
echo data > f
mkdir -p sub
unshare -Urm sh -c "mount -t tmpfs t '$DEST/sub' && exec sleep ` + hostileHolderMark + `" 2>/dev/null &
( trap '' TERM INT HUP QUIT
  exec 3<f
  while :; do
    ( trap '' TERM INT HUP QUIT; exec 4<f; exec sleep ` + hostileHolderMark + ` ) 2>/dev/null &
    sleep 0.02
  done ) 2>/dev/null &
sleep 0.5
echo ready
`

// A task that keeps its volume busy when it stops (its working directory,
// open files, holders that ignore SIGTERM and fork faster than one kill
// round, a mount over the volume tried from a user namespace of its own)
// loses its volume anyway: once the task is destroyed nothing of it is
// mounted on the host, staged or journaled, the volume's loop device is
// detached and no holder runs. Once stopped with a signal it ignores, once
// after its main process exits and leaves its holders behind (destroyed
// from three places at once).
func TestDriver_hostileTaskCannotKeepItsVolume_Root(t *testing.T) {
	requireRoot(t)
	fixture := buildFixture(t)
	root := shortTempDir(t)
	state := shortTempDir(t)
	work := shortTempDir(t)
	t.Cleanup(func() { detachLoopsOf(state) })
	t.Cleanup(func() { unmountUnder(root) })
	t.Cleanup(func() { killHostileHolders(t) })

	h, d := harnessDriver(t, Config{RootDir: root, AllowPrivileged: true, PrivilegedGrants: grantAll})
	plugin := fixturePluginTask(t, fixture, state)
	defer mkAllocDir(t, h, plugin, true)()
	startTask(t, h, plugin)
	defer func() {
		_ = h.StopTask(plugin.ID, 5*time.Second, "SIGTERM")
		_ = h.DestroyTask(plugin.ID, true)
	}()
	eventually(t, 15*time.Second, func() error {
		if st, ok := d.prober.Get("fixture"); !ok || !st.Healthy {
			return fmt.Errorf("plugin not healthy yet: %+v", st.HealthDescription)
		}
		return nil
	})
	dest := filepath.Join(work, "data")

	for _, tc := range []struct {
		name string
		// tail ends the task's script: it waits for a stop or exits.
		tail string
		stop func(t *testing.T, id string)
	}{
		{
			name: "stopped_ignoring_the_signal",
			tail: `trap '' TERM INT HUP QUIT; while :; do sleep 1; done`,
			stop: func(t *testing.T, id string) {
				must.NoError(t, h.StopTask(id, time.Second, "SIGTERM"))
				waitExit(t, h, id, 30*time.Second)
				must.NoError(t, h.DestroyTask(id, false))
			},
		},
		{
			name: "destroyed_running_from_three_places",
			tail: `trap '' TERM INT HUP QUIT; while :; do sleep 1; done`,
			stop: func(t *testing.T, id string) {
				var wg sync.WaitGroup
				errs := make([]error, 3)
				for i := range errs {
					wg.Add(1)
					go func() {
						defer wg.Done()
						errs[i] = d.DestroyTask(id, true)
					}()
				}
				wg.Wait()
				for _, err := range errs {
					if err != nil && !errors.Is(err, drivers.ErrTaskNotFound) {
						t.Fatalf("destroy: %v", err)
					}
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			task := realTask(t, "hostile", TaskConfig{
				Command: "/bin/sh",
				Args:    []string{"-c", hostileHolders + tc.tail},
				Volumes: map[string]VolumeConfig{"data": {
					PluginID:    "fixture",
					VolumeID:    "hostile-" + tc.name,
					Destination: dest,
					AccessMode:  "single-node-writer",
					Create:      &VolumeCreateBlock{CapacityMin: "16MiB", Parameters: map[string]string{"type": "ext4"}},
				}},
			})
			task.Env = map[string]string{"DEST": dest}
			// Root without privileges is the stronger attacker, and owns
			// the volume's root directory.
			task.User = "root"
			defer mkAllocDir(t, h, task, true)()
			startTask(t, h, task)
			eventually(t, 20*time.Second, fileHas(filepath.Join(task.TaskDir().LogDir, "hostile.stdout.0"), "ready\n"))
			vols, err := d.volumes()
			must.NoError(t, err)
			if n := vols.VolumeCounts(); n != (csihook.VolumeCounts{Staged: 1, Published: 1}) {
				t.Fatalf("before the stop: %+v, want 1 staged and 1 published", n)
			}
			if len(hostileHolderPids(t)) == 0 {
				b, _ := os.ReadFile(filepath.Join(task.TaskDir().LogDir, "hostile.stderr.0"))
				t.Fatalf("the task's holders are not running: the test would prove nothing; its stderr: %s", b)
			}

			tc.stop(t, task.ID)

			must.SliceEmpty(t, hostileHolderPids(t), must.Sprint("holders of the task outlived it"))
			for _, dir := range []string{"staging", "publish"} {
				left := mountsUnder(t, filepath.Join(root, "mnt", dir))
				must.SliceEmpty(t, left, must.Sprintf("left mounted under the driver's %s directory", dir))
			}
			must.SliceEmpty(t, mountsUnder(t, work), must.Sprint("left mounted at the task's destination on the host"))
			must.Eq(t, csihook.VolumeCounts{}, vols.VolumeCounts(), must.Sprint("staged, refused and published volumes left in the journal"))
			must.SliceEmpty(t, vols.Tasks(), must.Sprint("task records left in the journal"))
			out, err := exec.Command("losetup", "-a").Output()
			must.NoError(t, err)
			// The backing file is named as the plugin task sees it.
			for _, line := range strings.Split(string(out), "\n") {
				if strings.Contains(line, filepath.Base(state)+"/") {
					t.Fatalf("the volume's loop device is still attached: %s", line)
				}
			}
		})
	}
}

// hostileHolderPids lists the host's processes that run as the hostile
// task's holders, zombies aside (a zombie holds no mount).
func hostileHolderPids(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	must.NoError(t, err)
	var out []string
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue // gone since the listing
		}
		if args := strings.Split(string(b), "\x00"); len(args) >= 2 && filepath.Base(args[0]) == "sleep" && args[1] == hostileHolderMark {
			out = append(out, e.Name())
		}
	}
	return out
}

// detachLoopsOf detaches the loop devices whose backing file is under the
// fixture's state directory (named as the plugin task sees it), which a
// failed test leaves.
func detachLoopsOf(state string) {
	out, _ := exec.Command("losetup", "-a").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if dev, _, ok := strings.Cut(line, ":"); ok && strings.Contains(line, filepath.Base(state)+"/") {
			_ = exec.Command("losetup", "-d", dev).Run()
		}
	}
}

// killHostileHolders kills, by their pids, holders a failed test left
// behind.
func killHostileHolders(t *testing.T) {
	for _, pid := range hostileHolderPids(t) {
		if n, err := strconv.Atoi(pid); err == nil {
			_ = unix.Kill(n, unix.SIGKILL)
		}
	}
}
