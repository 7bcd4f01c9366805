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
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/shimtest"
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
	e := newStartBench(b)
	var driverTimes, floorTimes []time.Duration
	b.ResetTimer()
	b.StopTimer()
	for i := 0; i < b.N; i++ {
		task := e.task(b, fmt.Sprintf("t%d", i), TaskConfig{
			Command: "/bin/true",
			Volumes: map[string]VolumeConfig{"data": e.volume(b, fmt.Sprintf("drv-%d", i))},
		}, false)
		driverTimes = append(driverTimes, e.start(b, task))

		// The floor: the same calls, directly, and a bare fork/exec.
		e.spareReady(b)
		floorVol := e.newVolume(b, fmt.Sprintf("floor-%d", i))
		base := filepath.Join(e.d.currentConfig().stageRoot(), "floor", fmt.Sprint(i))
		staging, target := filepath.Join(base, "staging"), filepath.Join(base, "target")
		must.NoError(b, os.MkdirAll(staging, 0o700))
		ctx := context.Background()
		start := time.Now()
		_, err := e.client.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: floorVol, StagingTargetPath: staging, VolumeCapability: benchCapability})
		if err == nil {
			_, err = e.client.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: floorVol, StagingTargetPath: staging, TargetPath: target, VolumeCapability: benchCapability})
		}
		if err == nil {
			err = exec.Command("/bin/true").Run()
		}
		floorTimes = append(floorTimes, time.Since(start))
		must.NoError(b, err)
		_, err = e.client.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: floorVol, TargetPath: target})
		must.NoError(b, err)
		_, err = e.client.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: floorVol, StagingTargetPath: staging})
		must.NoError(b, err)
	}
	drv, floor := median(driverTimes), median(floorTimes)
	b.ReportMetric(float64(drv.Microseconds())/1000, "driver-ms")
	b.ReportMetric(float64(floor.Microseconds())/1000, "floor-ms")
	b.ReportMetric(float64(drv)/float64(floor), "ratio")
}

// BenchmarkStartTaskIsolation measures what isolation adds to a task's
// start (issue 9: at most 10 %): the driver's StartTask of the same task,
// as the same user (root), isolated (not privileged: the chroot_env root,
// /dev, /proc, /sys, PID and IPC namespaces, the device filter) and
// privileged (the host's view: none of these), interleaved in each
// iteration, the order alternating. Each start waits for the spare
// supervisor first, as the driver has one ready between starts.
//
//   - plain: a task with Nomad's directories (/alloc, /local, /secrets and,
//     isolated, /tmp), as Nomad starts every task;
//   - plain-no-dirs: the same without them, the only kind of task whose
//     isolated start takes the root the spare prepared ahead;
//   - volume: plain with one fresh volume of the fixture plugin (staged
//     and published in the start);
//   - plain-no-spares: plain with the driver's spare supervisors turned
//     off. A spare is started in a PID namespace of its own, for the
//     default (private) pid_mode, so only an isolated task takes it: a
//     privileged task always starts its own supervisor. Without spares
//     both do, and the ratio is that of the isolation layers alone.
//
// It reports the medians (isolated-ms, privileged-ms) and their ratio
// (isolated / privileged); ns/op is the mean of the two starts' sum:
//
//	go test -run '^$' -bench StartTaskIsolation -benchtime 20x ./driver/
//
// It needs root (real mounts, namespaces and cgroups).
func BenchmarkStartTaskIsolation(b *testing.B) {
	e := newStartBench(b)
	for _, c := range []struct {
		name                 string
		dirs, volume, spares bool
	}{
		{"plain", true, false, true},
		{"plain-no-dirs", false, false, true},
		{"volume", true, true, true},
		{"plain-no-spares", true, false, false},
	} {
		b.Run(c.name, func(b *testing.B) {
			if !c.spares {
				spares := e.d.spares
				e.d.spares = nil
				defer func() { e.d.spares = spares }()
			}
			var isolated, privileged []time.Duration
			run := func(i int, priv bool) time.Duration {
				tc := TaskConfig{Command: "/bin/true", Privileged: priv}
				if c.volume {
					tc.Volumes = map[string]VolumeConfig{"data": e.volume(b, fmt.Sprintf("%s-%d-%t-%d", c.name, i, priv, b.N))}
				}
				task := e.task(b, fmt.Sprintf("%s%d", c.name, i), tc, c.dirs)
				task.User = "root"
				return e.start(b, task)
			}
			b.ResetTimer()
			b.StopTimer()
			for i := 0; i < b.N; i++ {
				if i%2 == 0 {
					isolated = append(isolated, run(i, false))
					privileged = append(privileged, run(i, true))
				} else {
					privileged = append(privileged, run(i, true))
					isolated = append(isolated, run(i, false))
				}
			}
			iso, priv := median(isolated), median(privileged)
			b.ReportMetric(float64(iso.Microseconds())/1000, "isolated-ms")
			b.ReportMetric(float64(priv.Microseconds())/1000, "privileged-ms")
			b.ReportMetric(float64(iso)/float64(priv), "ratio")
		})
	}
}

// benchCapability is the capability the benchmarks' volumes are used with.
var benchCapability = &csi.VolumeCapability{
	AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
}

// startBench is a driver with the fixture plugin running as a plugin task
// and healthy, for the StartTask benchmarks. Its configuration allows a
// task that is not a plugin to be privileged, so that isolation can be
// compared with its absence.
type startBench struct {
	d      *Driver
	client csihook.Client
	logs   string
	allocs string
}

func newStartBench(b *testing.B, tweak ...func(*Config)) *startBench {
	requireRoot(b)
	fixture := buildFixture(b)
	// Supervisors run from the shim, built fresh, as make dev builds it.
	shimData, err := os.ReadFile(shimtest.Build(b, ""))
	must.NoError(b, err)
	shimSource = fstest.MapFS{"shimbin/" + shimName: {Data: shimData}}
	b.Cleanup(func() { shimSource = fstest.MapFS{} })
	root := shortTempDir(b)
	state := shortTempDir(b)
	e := &startBench{logs: shortTempDir(b), allocs: shortTempDir(b)}
	b.Cleanup(func() { unmountUnder(root) })

	b.Cleanup(func() { removeCgroupParent("nomad-csi-bench") })
	e.d = NewPlugin(hclog.NewNullLogger())
	b.Cleanup(e.d.Shutdown)
	conf := Config{Enabled: true, AllowPrivileged: true, PrivilegedPluginsOnly: false, PrivilegedGrants: grantAll,
		RootDir: root, CgroupParent: "nomad-csi-bench"}
	for _, f := range tweak {
		f(&conf)
	}
	b.Cleanup(func() { removeCgroupParent(conf.CgroupParent) })
	must.NoError(b, setConfig(e.d, conf))

	plugin := e.task(b, "plugin", TaskConfig{
		Command:    fixture,
		Args:       []string{"--state-dir", state, "--node-id", "bench"},
		Privileged: true,
		CSIPlugin:  &PluginTaskConfig{ID: "fixture", Type: "monolith", MountDir: "/csi"},
	}, false)
	_, _, err = e.d.StartTask(plugin)
	must.NoError(b, err)
	b.Cleanup(func() { _ = e.d.DestroyTask(plugin.ID, true) })
	eventually(b, 15*time.Second, func() error {
		if st, ok := e.d.prober.Get("fixture"); !ok || !st.Healthy {
			return fmt.Errorf("plugin not healthy yet")
		}
		return nil
	})
	e.client, err = csihook.DialUnix(e.d.currentConfig().pluginSocket("fixture"))
	must.NoError(b, err)
	b.Cleanup(func() { _ = e.client.Close() })
	return e
}

// newVolume creates a dir volume of the fixture plugin and returns its id.
func (e *startBench) newVolume(b *testing.B, name string) string {
	resp, err := e.client.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name: name, VolumeCapabilities: []*csi.VolumeCapability{benchCapability}, Parameters: map[string]string{"type": "dir"},
	})
	must.NoError(b, err)
	return resp.GetVolume().GetVolumeId()
}

// volume creates a volume and returns a task's volume block for it.
func (e *startBench) volume(b *testing.B, name string) VolumeConfig {
	return VolumeConfig{PluginID: "fixture", VolumeID: e.newVolume(b, name), Destination: "/ncsi-bench-data", AccessMode: "single-node-writer"}
}

// spareReady waits for the spare supervisor the driver starts after each
// task, so that it is neither missing from a timed start nor starting
// beside it.
func (e *startBench) spareReady(b *testing.B) {
	eventually(b, 10*time.Second, func() error {
		if !e.d.spares.Waiting(e.d.shimPath()) {
			return fmt.Errorf("no spare supervisor yet")
		}
		return nil
	})
}

// task is a task config for the benchmark, logging to plain files; with
// dirs it has an allocation directory with the task's directories in it,
// as Nomad makes them.
func (e *startBench) task(b *testing.B, name string, tc TaskConfig, dirs bool) *drivers.TaskConfig {
	cfg := realTask(b, name, tc)
	cfg.StdoutPath = filepath.Join(e.logs, name+".out")
	cfg.StderrPath = filepath.Join(e.logs, name+".err")
	must.NoError(b, os.WriteFile(cfg.StdoutPath, nil, 0o600))
	must.NoError(b, os.WriteFile(cfg.StderrPath, nil, 0o600))
	cfg.Env = map[string]string{"PATH": "/usr/bin:/bin"}
	if dirs {
		cfg.AllocDir = filepath.Join(e.allocs, cfg.AllocID)
		td := cfg.TaskDir()
		for _, dir := range []string{td.SharedAllocDir, td.LocalDir, td.SecretsDir, filepath.Join(td.Dir, "tmp")} {
			must.NoError(b, os.MkdirAll(dir, 0o755))
		}
	}
	return cfg
}

// start waits for the spare supervisor (if the driver has spares), then times the driver's StartTask
// of task, with the benchmark's timer running only then; the task
// (/bin/true) is waited for and destroyed afterwards.
func (e *startBench) start(b *testing.B, task *drivers.TaskConfig) time.Duration {
	if e.d.spares != nil {
		e.spareReady(b)
	}
	b.StartTimer()
	start := time.Now()
	_, _, err := e.d.StartTask(task)
	took := time.Since(start)
	b.StopTimer()
	must.NoError(b, err)
	h, _ := e.d.tasks.Get(task.ID)
	<-h.done
	must.NoError(b, e.d.DestroyTask(task.ID, false))
	return took
}

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}
