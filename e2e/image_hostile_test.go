//go:build e2e

package e2e

// Images a hostile job names, through the real registry and a real agent:
// what the job's author sees, and what the node keeps.

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

func TestImageHostileImages(t *testing.T) {
	reg := StartRegistry(t)
	a := StartAgent(t, AgentOptions{Drivers: []string{DriverName}, DriverConfig: `    registry_ca_file = "` + reg.CAFile + `"
    image_gc = "24h"
    image_max_size = "256MiB"`})

	t.Run("sparse file bomb", func(t *testing.T) {
		// A layer of a few KiB whose one sparse file reads as 1 GiB of
		// zeros: refused by image_max_size before it is written.
		bomb, err := imagebuild.SparseLayer("bomb", 1<<30)
		must.NoError(t, err)
		img, err := imagebuild.Build(imagebuild.Spec{}, bomb)
		must.NoError(t, err)
		ref, err := reg.Push("evil/sparse:1", img)
		must.NoError(t, err)
		job := imageJob(t, a, ref, reg.Username, reg.Password, 1)
		al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusFailed)
		all := eventsText(al, "")
		t.Logf("events:\n%s", all)
		must.StrContains(t, all, "unpacks to more than this node's image_max_size = 256 MiB")
		must.StrContains(t, all, ref)
		st := storeState(t, a.DriverRoot)
		must.MapNotContainsKey(t, st, "layers")
		must.MapNotContainsKey(t, st, "manifests")
		must.MapNotContainsKey(t, st, "tmp")
		must.Less(t, int64(1<<20), diskUsage(t, image.Dir(a.DriverRoot)))
	})

	t.Run("a stalled registry holds no other job's pull", func(t *testing.T) {
		// A hostile job's image on the base layer a victim's image also
		// has, served through a proxy that crawls (its author's
		// registry, slow for ever); the victim's image comes from the
		// registry itself: another source. The victim's pull does not
		// wait for the hostile one.
		shared, err := imagebuild.Layer(imagebuild.File("shared", randomBytes(t, 2<<20), 0o644))
		must.NoError(t, err)
		diff, err := shared.DiffID()
		must.NoError(t, err)
		hostileImg, err := imagebuild.Build(imagebuild.Spec{Env: []string{"HOSTILE=1"}}, shared)
		must.NoError(t, err)
		hostileRef, err := reg.Push("evil/slow:1", hostileImg)
		must.NoError(t, err)
		own, err := imagebuild.Layer(imagebuild.File("victim", []byte("victim"), 0o644))
		must.NoError(t, err)
		victimImg, err := imagebuild.Build(imagebuild.Spec{}, shared, own)
		must.NoError(t, err)
		_, err = reg.Push("app/victim:1", victimImg)
		must.NoError(t, err)
		victimRef := reg.Direct + "/app/victim:1"

		// 2 MiB at 32 KiB a second: a minute, within its own 10 m.
		reg.SetBlobDelay(time.Second)
		defer reg.SetBlobDelay(0)
		hostile := a.RunJob(t, "image", map[string]string{"Image": hostileRef, "Username": reg.Username, "Password": reg.Password,
			"Count": "1", "Timeout": "10m"})
		defer a.StopJob(t, hostile.ID)
		must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
			entries, err := os.ReadDir(partialLayer(image.Dir(a.DriverRoot), diff.Hex))
			return err == nil && len(entries) > 0
		}), wait.Timeout(2*time.Minute), wait.Gap(50*time.Millisecond)), must.Sprint("the hostile pull never unpacked the shared layer"))

		victim := a.RunJob(t, "image", map[string]string{"Image": victimRef, "Username": reg.Username, "Password": reg.Password,
			"Count": "1", "Timeout": "40s"})
		texts := allocEvents(t, a, victim.ID, 1, "Pulled image "+victimRef, "did not finish within image_pull_timeout")
		must.StrContains(t, texts[0], "Pulled image "+victimRef)
		_, err = os.Stat(filepath.Join(image.Dir(a.DriverRoot), "layers", diff.Hex, "fs", "shared"))
		must.NoError(t, err)
		a.StopJob(t, victim.ID)
	})
}

// diskUsage is the bytes dir's files take on disk.
func diskUsage(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			if os.IsNotExist(err) && strings.Contains(p, string(filepath.Separator)+"tmp") {
				return nil
			}
			return err
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			n += st.Blocks * 512
		}
		return nil
	})
	must.NoError(t, err)
	return n
}
