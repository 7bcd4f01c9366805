//go:build e2e

package e2e

// Helpers for Nomad's own (native) CSI support with plugins run by the csi
// driver: plugins registered with a task-level csi_plugin block, volumes
// made with "nomad volume create" and claimed by group volume blocks. They
// are exported for the benchmarks in e2e/bench.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/nomad/api"
)

// FixtureBinary is the CSI plugin fixture built by e2e/tools/build.sh.
func FixtureBinary(root string) string { return filepath.Join(root, "build", "csi", "csi-fixture") }

// CheckFixture reports why the fixture cannot be used (not built).
func CheckFixture(root string) error {
	if _, err := os.Stat(FixtureBinary(root)); err != nil {
		return fmt.Errorf("no CSI fixture at %s: run make csi-tools (e2e/tools/build.sh build/csi): %w", FixtureBinary(root), err)
	}
	return nil
}

// NativeCSIDir is the directory Nomad's client keeps its CSI sockets,
// staging and per-allocation mounts in: <client state_dir>/csi, and the
// state dir of a -dev or client agent is <data_dir>/client.
func (a *Agent) NativeCSIDir() string { return filepath.Join(a.DataDir, "client", "csi") }

// NativeStageDir is the host directory Nomad binds into a plugin task of
// the given type and id at its stage_publish_base_dir. A plugin run by the
// csi driver sees the host's file system, so stage_publish_base_dir may be
// this very path.
func (a *Agent) NativeStageDir(pluginType, pluginID string) string {
	return filepath.Join(a.NativeCSIDir(), pluginType, pluginID)
}

// NativePluginVars are the template variables of e2e/jobs/native_plugin.hcl
// for a privileged monolith fixture plugin with state in a directory of its
// own under the agent's directory. stageDir is its stage_publish_base_dir:
// "" leaves Nomad's default (/local/csi, inside the task), "host" makes it
// the host directory itself (NativeStageDir).
func (a *Agent) NativePluginVars(pluginID string, privileged bool, stageDir string) map[string]string {
	if stageDir == "host" {
		stageDir = a.NativeStageDir("monolith", pluginID)
	}
	attempts := "2"
	if !privileged {
		attempts = "0"
	}
	return map[string]string{
		"Driver":     DriverName,
		"Fixture":    FixtureBinary(a.Root),
		"StateDir":   filepath.Join(a.Dir, "fx-"+pluginID),
		"PluginID":   pluginID,
		"MountDir":   filepath.Join(a.Dir, "sock-"+pluginID),
		"StageDir":   stageDir,
		"Privileged": fmt.Sprint(privileged),
		"Attempts":   attempts,
	}
}

// ManagedPluginVars are the template variables of
// e2e/jobs/native_managed_plugin.hcl: the fixture as a driver-managed
// plugin (the driver's own csi_plugin block).
func (a *Agent) ManagedPluginVars(pluginID string) map[string]string {
	return map[string]string{
		"Fixture":  FixtureBinary(a.Root),
		"StateDir": filepath.Join(a.Dir, "fx-"+pluginID),
		"PluginID": pluginID,
		"MountDir": filepath.Join(a.Dir, "sock-"+pluginID),
	}
}

// SubmitRendered registers a rendered job over the HTTP API (parsed first, not
// counted in the returned instant) and returns the moment just before the
// registration. Close stops the job.
func (a *Agent) SubmitRendered(job Job) (time.Time, error) {
	hcl, err := os.ReadFile(job.File)
	if err != nil {
		return time.Time{}, err
	}
	parsed, err := a.api.Jobs().ParseHCLOpts(&api.JobsParseRequest{JobHCL: string(hcl), Canonicalize: true})
	if err != nil {
		return time.Time{}, fmt.Errorf("failed to parse %s: %w", job.File, err)
	}
	a.mu.Lock()
	a.jobs = append(a.jobs, job.ID)
	a.mu.Unlock()
	t0 := time.Now()
	if _, _, err := a.api.Jobs().Register(parsed, nil); err != nil {
		return time.Time{}, fmt.Errorf("failed to register %s: %w", job.ID, err)
	}
	return t0, nil
}

// StopWaitPurge stops a job, waits until its allocations are terminal, and
// purges it when purge is set.
func (a *Agent) StopWaitPurge(jobID string, purge bool, timeout time.Duration) error {
	if _, _, err := a.api.Jobs().Deregister(jobID, false, nil); err != nil {
		return fmt.Errorf("failed to stop job %s: %w", jobID, err)
	}
	deadline := time.Now().Add(Scaled(timeout))
	for {
		allocs, err := a.JobAllocations(jobID)
		if err != nil {
			return err
		}
		if allTerminal(allocs) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("allocations of job %s still running %v after the stop", jobID, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if purge {
		if _, _, err := a.api.Jobs().Deregister(jobID, true, nil); err != nil {
			return fmt.Errorf("failed to purge job %s: %w", jobID, err)
		}
	}
	return nil
}

// NativePluginInfo is /v1/plugin/csi/<id>.
type NativePluginInfo = api.CSIPlugin

// NativePlugin reads a plugin as the servers know it.
func (a *Agent) NativePlugin(id string) (*NativePluginInfo, error) {
	p, _, err := a.api.CSIPlugins().Info(id, nil)
	if err != nil {
		return nil, fmt.Errorf("failed to read CSI plugin %s: %w", id, err)
	}
	return p, nil
}

// WaitNativePlugin waits until the servers count the plugin's controllers
// and nodes healthy (at least the numbers given) and returns it.
func (a *Agent) WaitNativePlugin(id string, controllers, nodes int, timeout time.Duration) (*NativePluginInfo, error) {
	deadline := time.Now().Add(Scaled(timeout))
	var last *NativePluginInfo
	var lastErr error
	for time.Now().Before(deadline) {
		p, err := a.NativePlugin(id)
		if err == nil {
			last = p
			if p.ControllersHealthy >= controllers && p.NodesHealthy >= nodes {
				return p, nil
			}
		}
		lastErr = err
		time.Sleep(100 * time.Millisecond)
	}
	if last == nil {
		return nil, fmt.Errorf("plugin %s unknown to the servers after %v: %v", id, timeout, lastErr)
	}
	return last, fmt.Errorf("plugin %s not healthy after %v: controllers %d/%d, nodes %d/%d healthy",
		id, timeout, last.ControllersHealthy, last.ControllersExpected, last.NodesHealthy, last.NodesExpected)
}

// NativeVolumeInfo is /v1/volume/csi/<id>.
type NativeVolumeInfo struct{ api.CSIVolume }

// Claims counts the volume's reader and writer claims.
func (v *NativeVolumeInfo) Claims() int { return len(v.ReadAllocs) + len(v.WriteAllocs) }

// NativeVolume reads a volume as the servers know it.
func (a *Agent) NativeVolume(id string) (*NativeVolumeInfo, error) {
	v, _, err := a.api.CSIVolumes().Info(id, nil)
	if err != nil {
		return nil, fmt.Errorf("failed to read CSI volume %s: %w", id, err)
	}
	return &NativeVolumeInfo{*v}, nil
}

// CreateNativeVolumeFile runs "nomad volume create" on a volume spec file.
func (a *Agent) CreateNativeVolumeFile(specFile string) (string, error) {
	out, err := a.Nomad("volume", "create", specFile)
	if err != nil {
		return out, fmt.Errorf("nomad volume create %s failed: %w\n%s", specFile, err, out)
	}
	return out, nil
}

// CreateNativeVolume renders e2e/jobs/native_volume.hcl for one volume of
// the plugin and creates it.
func (a *Agent) CreateNativeVolume(volumeID, pluginID, accessMode, volumeType string) error {
	spec, err := a.RenderJob("native_volume", map[string]string{
		"VolumeID": volumeID, "PluginID": pluginID, "AccessMode": accessMode, "VolumeType": volumeType,
	})
	if err != nil {
		return err
	}
	_, err = a.CreateNativeVolumeFile(spec.File)
	return err
}

// WaitNativeVolumeReleased waits until the servers hold no claim on a volume
// any more: the allocations that had it are gone and Nomad has unpublished
// it from their nodes. A "nomad system gc" now and then hurries the
// claims of terminal allocations along.
func (a *Agent) WaitNativeVolumeReleased(id string, timeout time.Duration) (*NativeVolumeInfo, error) {
	deadline := time.Now().Add(Scaled(timeout))
	nextGC := time.Now().Add(3 * time.Second)
	var last *NativeVolumeInfo
	for time.Now().Before(deadline) {
		v, err := a.NativeVolume(id)
		if err != nil {
			return nil, err
		}
		last = v
		if v.Claims() == 0 && len(v.Allocations) == 0 {
			return v, nil
		}
		if time.Now().After(nextGC) {
			_ = a.api.System().GarbageCollect()
			nextGC = time.Now().Add(3 * time.Second)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return last, fmt.Errorf("volume %s still has %d claims and %d allocations after %v", id, last.Claims(), len(last.Allocations), timeout)
}

// DeleteNativeVolume runs "nomad volume delete", retrying while claims are
// still being released.
func (a *Agent) DeleteNativeVolume(id string, timeout time.Duration) error {
	deadline := time.Now().Add(Scaled(timeout))
	for {
		out, err := a.Nomad("volume", "delete", id)
		if err == nil {
			return nil
		}
		if strings.Contains(out, "not found") {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nomad volume delete %s failed: %w\n%s", id, err, out)
		}
		_ = a.api.System().GarbageCollect()
		time.Sleep(time.Second)
	}
}

// NativeLoopsUnder lists the loop devices whose backing file is (or was,
// when deleted while attached) below dir.
func NativeLoopsUnder(dir string) []string {
	var devs []string
	backing, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, b := range backing {
		f, err := os.ReadFile(b)
		if err == nil && strings.HasPrefix(string(f), filepath.Clean(dir)+"/") {
			devs = append(devs, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(b))))
		}
	}
	return devs
}

// DetachNativeLoops detaches the loop devices backed by files below dir.
func DetachNativeLoops(dir string) error {
	var errs []string
	for _, dev := range NativeLoopsUnder(dir) {
		if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v: %s", dev, err, strings.TrimSpace(string(out))))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("failed to detach loop devices: %s", strings.Join(errs, "; "))
	}
	return nil
}

// nativeEnviron reads a process's environment as KEY=VALUE strings.
func nativeEnviron(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	if err != nil {
		return nil, err
	}
	return strings.Split(strings.TrimRight(string(b), "\x00"), "\x00"), nil
}
