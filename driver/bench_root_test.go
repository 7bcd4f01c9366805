package driver

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"testing"
	"testing/fstest"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

// BenchmarkStartTaskWithVolume measures what the issue calls volume task
// start: the driver's StartTask, from the call to its return with the task
// running, for a task with one fresh (never staged) volume of the fixture
// plugin, against the floor measured in the same run and iteration: the
// same CSI calls (NodeStageVolume, NodePublishVolume) sent directly to the
// same plugin, plus a bare fork/exec of the same command. Volumes are
// created, and everything torn down, with the timer stopped. It reports
// the medians and their ratio:
//
//	go test -run '^$' -bench StartTaskWithVolume -benchtime 20x ./driver/
//
// It needs root (real mounts, namespaces and cgroups).
func BenchmarkStartTaskWithVolume(b *testing.B) {
	requireRoot(b)
	fixture := buildFixture(b)
	// Supervisors run from the shim, built fresh, as make dev builds it.
	shim := filepath.Join(shortTempDir(b), shimName)
	build := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", shim, "github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/shim")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := build.CombinedOutput()
	must.NoError(b, err, must.Sprintf("go build: %s", out))
	shimData, err := os.ReadFile(shim)
	must.NoError(b, err)
	shimSource = fstest.MapFS{"shimbin/" + shimName: {Data: shimData}}
	b.Cleanup(func() { shimSource = fstest.MapFS{} })
	root := shortTempDir(b)
	state := shortTempDir(b)
	b.Cleanup(func() { unmountUnder(root) })

	b.Cleanup(func() { removeCgroupParent("nomad-csi-bench") })
	d := NewPlugin(hclog.NewNullLogger())
	b.Cleanup(d.Shutdown)
	must.NoError(b, setConfig(d, Config{Enabled: true, AllowPrivileged: true, RootDir: root, CgroupParent: "nomad-csi-bench"}))
	logs := shortTempDir(b)

	plugin := benchTask(b, logs, "plugin", TaskConfig{
		Command:    fixture,
		Args:       []string{"--state-dir", state, "--node-id", "bench"},
		Privileged: true,
		CSIPlugin:  &PluginTaskConfig{ID: "fixture", Type: "monolith", MountDir: "/csi"},
	})
	_, _, err = d.StartTask(plugin)
	must.NoError(b, err)
	b.Cleanup(func() { _ = d.DestroyTask(plugin.ID, true) })
	eventually(b, 15*time.Second, func() error {
		if st, ok := d.prober.Get("fixture"); !ok || !st.Healthy {
			return fmt.Errorf("plugin not healthy yet")
		}
		return nil
	})
	client, err := csihook.DialUnix(d.currentConfig().pluginSocket("fixture"))
	must.NoError(b, err)
	defer client.Close()
	ctx := context.Background()
	capability := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	newVolume := func(name string) string {
		resp, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: name, VolumeCapabilities: []*csi.VolumeCapability{capability}, Parameters: map[string]string{"type": "dir"},
		})
		must.NoError(b, err)
		return resp.GetVolume().GetVolumeId()
	}

	// The driver starts a spare supervisor after each task: wait for it,
	// so that it is neither missing from the driver's start nor running
	// during the floor's.
	spareReady := func() {
		eventually(b, 10*time.Second, func() error {
			if !d.spares.Waiting(d.shimPath()) {
				return fmt.Errorf("no spare supervisor yet")
			}
			return nil
		})
	}

	var driverTimes, floorTimes []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		spareReady()
		volID := newVolume(fmt.Sprintf("drv-%d", i))
		task := benchTask(b, logs, fmt.Sprintf("t%d", i), TaskConfig{
			Command: "/bin/true",
			Volumes: map[string]VolumeConfig{"data": {
				PluginID: "fixture", VolumeID: volID, Destination: "/ncsi-bench-data", AccessMode: "single-node-writer",
			}},
		})
		b.StartTimer()
		start := time.Now()
		_, _, err := d.StartTask(task)
		driverTimes = append(driverTimes, time.Since(start))
		b.StopTimer()
		must.NoError(b, err)
		h, _ := d.tasks.Get(task.ID)
		<-h.done
		must.NoError(b, d.DestroyTask(task.ID, false))

		// The floor: the same calls, directly, and a bare fork/exec.
		spareReady()
		floorVol := newVolume(fmt.Sprintf("floor-%d", i))
		base := filepath.Join(d.currentConfig().stageRoot(), "floor", fmt.Sprint(i))
		staging, target := filepath.Join(base, "staging"), filepath.Join(base, "target")
		must.NoError(b, os.MkdirAll(staging, 0o700))
		start = time.Now()
		_, err = client.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: floorVol, StagingTargetPath: staging, VolumeCapability: capability})
		if err == nil {
			_, err = client.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: floorVol, StagingTargetPath: staging, TargetPath: target, VolumeCapability: capability})
		}
		if err == nil {
			err = exec.Command("/bin/true").Run()
		}
		floorTimes = append(floorTimes, time.Since(start))
		must.NoError(b, err)
		_, err = client.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: floorVol, TargetPath: target})
		must.NoError(b, err)
		_, err = client.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: floorVol, StagingTargetPath: staging})
		must.NoError(b, err)
		b.StartTimer()
	}
	b.StopTimer()
	drv, floor := median(driverTimes), median(floorTimes)
	b.ReportMetric(float64(drv.Microseconds())/1000, "driver-ms")
	b.ReportMetric(float64(floor.Microseconds())/1000, "floor-ms")
	b.ReportMetric(float64(drv)/float64(floor), "ratio")
}

// benchTask is a task config for the benchmark, logging to plain files.
func benchTask(b *testing.B, logs, name string, tc TaskConfig) *drivers.TaskConfig {
	cfg := realTask(b, name, tc)
	cfg.StdoutPath = filepath.Join(logs, name+".out")
	cfg.StderrPath = filepath.Join(logs, name+".err")
	must.NoError(b, os.WriteFile(cfg.StdoutPath, nil, 0o600))
	must.NoError(b, os.WriteFile(cfg.StderrPath, nil, 0o600))
	cfg.Env = map[string]string{"PATH": "/usr/bin:/bin"}
	return cfg
}

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}
