package driver

import (
	"errors"
	"fmt"
	"os"

	"github.com/hashicorp/nomad/plugins/drivers"
	pstructs "github.com/hashicorp/nomad/plugins/shared/structs"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// hostProbe answers the fingerprint's questions about this machine, so that
// the health logic can be tested without changing the machine.
type hostProbe interface {
	// IsRoot reports whether the driver runs as root.
	IsRoot() bool
	// MountNamespaces is nil when tasks can get mount namespaces.
	MountNamespaces() error
	// Cgroups is nil when tasks can be placed in control groups.
	Cgroups() error
	// Kernel is nil when the kernel has every call the driver makes, or
	// one sentence naming the one it lacks (mounter.KernelSupport).
	Kernel() error
	// Writable is nil when dir can hold the driver's state.
	Writable(dir string) error
	// Statfs is statfs(2) of dir.
	Statfs(dir string, st *unix.Statfs_t) error
}

type realHost struct{}

func (realHost) IsRoot() bool { return os.Geteuid() == 0 }

func (realHost) MountNamespaces() error {
	if _, err := os.Stat("/proc/self/ns/mnt"); err != nil {
		return errors.New("the kernel does not offer mount namespaces (/proc/self/ns/mnt is missing)")
	}
	return nil
}

func (realHost) Cgroups() error { return cgroups.Available() }

func (realHost) Statfs(dir string, st *unix.Statfs_t) error { return unix.Statfs(dir, st) }
func (realHost) Kernel() error                              { return mounter.KernelSupport() }

func (realHost) Writable(dir string) error {
	f, err := os.CreateTemp(dir, ".probe-*")
	if err != nil {
		return err
	}
	name := f.Name()
	_ = f.Close()
	return os.Remove(name)
}

// buildFingerprint checks that the driver can do its job here and says what
// is missing, in one sentence, when it cannot.
func (d *Driver) buildFingerprint() *drivers.Fingerprint {
	fp := &drivers.Fingerprint{
		Attributes: map[string]*pstructs.Attribute{},
		Health:     drivers.HealthStateHealthy,
	}
	conf := d.currentConfig()
	switch {
	case conf == nil:
		fp.Health = drivers.HealthStateUndetected
		fp.HealthDescription = "the csi driver has not been configured yet"
		return fp
	case !conf.Enabled:
		fp.Health = drivers.HealthStateUndetected
		fp.HealthDescription = "the csi driver is disabled: set enabled = true in the agent's config for this driver (plugin \"nomad-driver-csi\")"
		return fp
	case !d.host.IsRoot():
		fp.Health = drivers.HealthStateUndetected
		fp.HealthDescription = "the csi driver must run as root: run the Nomad client as root"
		return fp
	}
	if err := d.host.MountNamespaces(); err != nil {
		fp.Health = drivers.HealthStateUndetected
		fp.HealthDescription = err.Error()
		return fp
	}
	if err := d.host.Kernel(); err != nil {
		fp.Health = drivers.HealthStateUndetected
		fp.HealthDescription = err.Error()
		return fp
	}

	if p := d.currentProber(); p != nil {
		for k, v := range fingerprint.Build(p.Snapshot()) {
			fp.Attributes[k] = v
		}
	}
	fp.Attributes["driver.csi"] = pstructs.NewBoolAttribute(true)
	fp.Attributes["driver.csi.version"] = pstructs.NewStringAttribute(Version)
	fp.Attributes["driver.csi.allow_privileged"] = pstructs.NewBoolAttribute(conf.AllowPrivileged)
	fp.Attributes["driver.csi.privileged_plugins_only"] = pstructs.NewBoolAttribute(conf.PrivilegedPluginsOnly)

	if err := d.host.Cgroups(); err != nil {
		fp.Health = drivers.HealthStateUnhealthy
		fp.HealthDescription = fmt.Sprintf("cannot limit task resources: %v", err)
		return fp
	}
	werr := d.host.Writable(conf.tasksDir())
	if werr != nil && !isFullErrno(werr) {
		fp.Health = drivers.HealthStateUnhealthy
		fp.HealthDescription = fmt.Sprintf("root_dir %q is not writable: %v", conf.RootDir, werr)
		return fp
	}
	// Full is not broken (see diskfull.go): the driver stays healthy and
	// says so, and a job can keep off the node by the attribute.
	fp.HealthDescription = drivers.DriverHealthy
	err := d.rootRoom(conf, werr)
	var full *fullError
	if errors.As(err, &full) {
		fp.HealthDescription = full.Error()
		fp.Attributes["driver.csi.root_dir_full"] = pstructs.NewStringAttribute(full.what)
	} else if err != nil {
		d.logger.Debug("failed to check the room left in root_dir", "error", err)
	}
	d.noteFull(full)
	return fp
}

// noteFull logs root_dir's file system filling up and being freed, once
// each.
func (d *Driver) noteFull(full *fullError) {
	d.mu.Lock()
	was := d.rootFull
	d.rootFull = full != nil
	d.mu.Unlock()
	switch {
	case full != nil && !was:
		d.logger.Warn("root_dir's file system is full: new tasks are refused until files are removed there; running tasks go on",
			"root_dir", full.rootDir, "file_system", full.fs, "full", full.what,
			"fix", "remove files there; keep root_dir on a file system of its own, apart from Nomad's data_dir")
	case full == nil && was:
		d.logger.Info("root_dir's file system has room again: new tasks start")
	}
}

// clearDropped adds an empty value for every attribute the last
// fingerprint sent that this one does not: Nomad keeps a node attribute
// until a driver sends it empty, so a plugin's health description or a
// forgotten plugin would otherwise stay on the node for good.
func (d *Driver) clearDropped(fp *drivers.Fingerprint) {
	d.mu.Lock()
	defer d.mu.Unlock()
	sent := make(map[string]bool, len(fp.Attributes))
	for k := range fp.Attributes {
		sent[k] = true
	}
	for k := range d.sentAttrs {
		if !sent[k] {
			fp.Attributes[k] = pstructs.NewStringAttribute("")
		}
	}
	d.sentAttrs = sent
}
