package driver

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

func TestConfig_validateImages(t *testing.T) {
	ok := Config{RootDir: "/var/lib/x", CgroupParent: "c"}
	cases := []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"defaults", func(*Config) {}, ""},
		{"all set", func(c *Config) {
			c.Auth = &PluginAuth{Config: "/etc/docker/config.json", Helper: "ecr-login"}
			c.RegistryCAFile, c.InsecureRegistries = "/etc/ca.pem", []string{"reg.internal:5000", "[::1]:5000"}
			c.LocalImageDirs, c.ImageGC, c.ImageMaxLayers, c.ImageMaxSize = []string{"/srv/images"}, "0", 500, "1TiB"
		}, ""},
		{"relative auth config", func(c *Config) { c.Auth = &PluginAuth{Config: "config.json"} }, "auth config must be an absolute path"},
		{"helper path", func(c *Config) { c.Auth = &PluginAuth{Helper: "../../bin/sh"} }, "auth helper \"../../bin/sh\" must be the name"},
		{"relative ca", func(c *Config) { c.RegistryCAFile = "ca.pem" }, "registry_ca_file must be an absolute path"},
		{"insecure with scheme", func(c *Config) { c.InsecureRegistries = []string{"http://reg:5000"} }, "insecure_registries[0] \"http://reg:5000\" must be a registry's host[:port]"},
		{"local dir relative", func(c *Config) { c.LocalImageDirs = []string{"images"} }, "local_image_dirs[0] must be an absolute, clean path"},
		{"local dir slash", func(c *Config) { c.LocalImageDirs = []string{"/"} }, "local_image_dirs[0] must be an absolute, clean path other than \"/\""},
		{"local dir in root_dir", func(c *Config) { c.LocalImageDirs = []string{"/srv", "/var/lib/x/images"} }, "local_image_dirs[1] \"/var/lib/x/images\" must not be root_dir"},
		{"local dir around root_dir", func(c *Config) { c.LocalImageDirs = []string{"/var/lib"} }, "must not be root_dir \"/var/lib/x\", inside it or around it"},
		{"chroot_env holds root_dir", func(c *Config) { c.ChrootEnv = map[string]string{"/var/lib": "/var/lib"} },
			"root_dir \"/var/lib/x\" must not be inside, be or hold the chroot_env source \"/var/lib\""},
		{"chroot_env inside root_dir", func(c *Config) { c.ChrootEnv = map[string]string{"/var/lib/x/images": "/images"} },
			"chroot_env source \"/var/lib/x/images\""},
		{"root_dir under the default chroot_env", func(c *Config) { c.RootDir = "/usr/local/csi" },
			"root_dir \"/usr/local/csi\" must not be inside, be or hold the chroot_env source \"/usr\""},
		{"bad gc", func(c *Config) { c.ImageGC = "daily" }, "image_gc must be a duration of at least \"1s\""},
		{"tiny gc", func(c *Config) { c.ImageGC = "10ms" }, "image_gc must be a duration"},
		{"too many layers", func(c *Config) { c.ImageMaxLayers = 501 }, "image_max_layers must be from 1 to 500"},
		{"bad size", func(c *Config) { c.ImageMaxSize = "huge" }, "image_max_size must be a size such as \"20GiB\""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			tc.mod(&c)
			err := c.validate()
			if tc.want == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, tc.want)
		})
	}
}

func TestTaskConfig_validateImage(t *testing.T) {
	conf := &Config{}
	cases := []struct {
		name string
		tc   TaskConfig
		want string
	}{
		{"registry", TaskConfig{Command: "x", Image: "registry.example/csi:1.2"}, ""},
		{"digest", TaskConfig{Command: "x", Image: "registry.example/csi@sha256:" + strings.Repeat("0", 64), ImagePullTimeout: "30s"}, ""},
		{"layout", TaskConfig{Command: "x", Image: "oci:/srv/images/csi:1.2", Auth: &TaskAuth{Username: "u", Password: "p"}}, ""},
		{"bad ref", TaskConfig{Command: "x", Image: "Not A Ref"}, "image \"Not A Ref\" has a space"},
		{"relative local", TaskConfig{Command: "x", Image: "oci-archive:csi.tar"}, "needs an absolute, clean host path"},
		{"auth without image", TaskConfig{Command: "x", Auth: &TaskAuth{Username: "u"}}, "auth is only for image"},
		{"force_pull without image", TaskConfig{Command: "x", ForcePull: true}, "force_pull is only for image"},
		{"bad timeout", TaskConfig{Command: "x", Image: "r/x:1", ImagePullTimeout: "forever"}, "image_pull_timeout \"forever\" must be a duration"},
		{"long timeout", TaskConfig{Command: "x", Image: "r/x:1", ImagePullTimeout: "48h"}, "image_pull_timeout \"48h\" must be a duration from \"1s\" to \"24h0m0s\""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.tc.validate(conf)
			if c.want == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, c.want)
		})
	}
}

// imageDriver is a test driver with a local image directory holding one
// image, whose image roots are recorded instead of made.
type imageDriver struct {
	*testDriver
	ref    string
	digest string
	roots  []*image.Image
	events *eventLog
}

func newImageDriver(t *testing.T, rootErr error, mods ...func(c *Config, digest string)) *imageDriver {
	t.Helper()
	return newImageDriverOf(t, imagebuild.Spec{Entrypoint: []string{"/bin/plugin"}},
		[]imagebuild.Entry{imagebuild.File("bin/plugin", []byte("#!/bin/sh\n"), 0o755)}, rootErr, mods...)
}

// newImageDriverOf is newImageDriver with an image of spec and the files
// of entries.
func newImageDriverOf(t *testing.T, spec imagebuild.Spec, entries []imagebuild.Entry, rootErr error, mods ...func(c *Config, digest string)) *imageDriver {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the image store sets owners of unpacked files")
	}
	dir := shortTempDir(t)
	layer, err := imagebuild.Layer(entries...)
	must.NoError(t, err)
	img, err := imagebuild.Build(spec, layer)
	must.NoError(t, err)
	must.NoError(t, imagebuild.WriteLayout(filepath.Join(dir, "plugin"), "1.0", img))
	digest, err := img.Digest()
	must.NoError(t, err)
	id := &imageDriver{ref: "oci:" + filepath.Join(dir, "plugin") + ":1.0", digest: digest.String()}
	conf := Config{Enabled: true, LocalImageDirs: []string{dir}}
	for _, m := range mods {
		m(&conf, id.digest)
	}
	id.testDriver = newTestDriver(t, conf, func(d *Driver) {
		d.imageRoot = func(_ *Config, _ *drivers.TaskConfig, _ *TaskConfig, _ *executor.Spec, img *image.Image) error {
			id.roots = append(id.roots, img)
			return rootErr
		}
	})
	id.events = watchEvents(t, id.testDriver)
	return id
}

func (id *imageDriver) uses(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(image.Dir(id.currentConfig().RootDir), "uses"))
	must.NoError(t, err)
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

func TestStartTask_pullsLeasesAndReleasesTheImage(t *testing.T) {
	d := newImageDriver(t, nil)
	cfg := taskConfig(t, TaskConfig{Command: "/bin/plugin", Image: d.ref})
	handle, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	must.SliceLen(t, 1, d.roots)
	must.Eq(t, d.digest, d.roots[0].Digest)
	must.Eq(t, []string{"/bin/plugin"}, d.roots[0].Config.Entrypoint)
	d.events.waitFor(t, "Pulled image "+d.ref)
	must.SliceLen(t, 1, d.uses(t))
	var st TaskState
	must.NoError(t, handle.GetDriverState(&st))
	must.Eq(t, d.digest, st.Image)

	// A second task of the same image: present, no download.
	cfg2 := taskConfig(t, TaskConfig{Command: "/bin/plugin", Image: d.ref})
	cfg2.ID = "alloc-2/web/def"
	_, _, err = d.StartTask(cfg2)
	must.NoError(t, err)
	d.events.waitFor(t, "alloc-2/web/def: Image "+d.ref+" is present")
	must.SliceLen(t, 2, d.uses(t))

	// Destroyed, the task lets its image go.
	d.procs[0].exit(executor.ExitStatus{})
	must.NoError(t, d.DestroyTask(cfg.ID, true))
	must.SliceLen(t, 1, d.uses(t))
	list, err := d.images.List(nil)
	must.NoError(t, err)
	must.SliceLen(t, 1, list)
	must.SliceLen(t, 1, list[0].InUseBy)
	must.Eq(t, cfg2.ID, list[0].InUseBy[0].TaskID)
}

func TestStartTask_failedStartReleasesTheImage(t *testing.T) {
	d := newImageDriver(t, errors.New("no root"))
	_, _, err := d.StartTask(taskConfig(t, TaskConfig{Command: "/bin/plugin", Image: d.ref}))
	must.ErrorContains(t, err, "no root")
	must.SliceEmpty(t, d.uses(t))
	must.SliceEmpty(t, d.started)
}

func TestStartTask_imageErrorsReachTheTask(t *testing.T) {
	d := newImageDriver(t, nil)
	dir := filepath.Dir(strings.TrimSuffix(strings.TrimPrefix(d.ref, "oci:"), ":1.0"))
	for ref, want := range map[string]string{
		strings.TrimSuffix(d.ref, "1.0") + "2.0":    "has no image named \"2.0\"",
		"oci-archive:/etc/shadow":                   "is not inside a directory of the plugin option local_image_dirs",
		"oci:" + filepath.Join(dir, "missing"):      "does not exist",
		"docker-archive:" + filepath.Join(dir, "x"): "does not exist",
	} {
		_, _, err := d.StartTask(taskConfig(t, TaskConfig{Command: "/bin/plugin", Image: ref}))
		must.ErrorContains(t, err, want)
		must.ErrorContains(t, err, ref)
	}
	must.SliceEmpty(t, d.roots)
	must.SliceEmpty(t, d.uses(t))
}

func TestRecoverTask_keepsTheImageLease(t *testing.T) {
	d := newImageDriver(t, nil)
	cfg := taskConfig(t, TaskConfig{Command: "/bin/plugin", Image: d.ref})
	handle, _, err := d.StartTask(cfg)
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(d.currentConfig().taskStateDir(cfg.ID), 0o700))

	// A new driver process on the same root_dir: the lease is on disk,
	// and GC keeps the image although its clock says it is old.
	d2 := newTestDriver(t, Config{Enabled: true, RootDir: d.currentConfig().RootDir, LocalImageDirs: d.currentConfig().LocalImageDirs})
	must.NoError(t, d2.RecoverTask(handle))
	removed, err := d2.images.GC(1, d2.taskLive(d2.currentConfig()))
	must.NoError(t, err)
	must.SliceEmpty(t, removed)
	list, err := d2.images.List(d2.taskLive(d2.currentConfig()))
	must.NoError(t, err)
	must.SliceLen(t, 1, list)
	must.SliceLen(t, 1, list[0].InUseBy)

	// Once the task is gone, GC takes it.
	d2.procs[0].exit(executor.ExitStatus{})
	must.NoError(t, d2.DestroyTask(cfg.ID, true))
	must.NoError(t, os.RemoveAll(d.currentConfig().taskStateDir(cfg.ID)))
	d.tasks.Delete(cfg.ID)
	removed, err = d2.images.GC(1, d2.taskLive(d2.currentConfig()))
	must.NoError(t, err)
	must.Eq(t, []string{d.digest}, removed)
}

// A pull's progress becomes a few events, not one per read.
func TestPullEventsAreFew(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true})
	events := watchEvents(t, d)
	cfg := taskConfig(t, TaskConfig{Command: "x", Image: "r/x:1"})
	p := &pullEvents{d: d.Driver, cfg: cfg, ref: "r/x:1", start: time.Now()}
	for i := int64(0); i <= 1000; i++ {
		p.progress(image.Progress{Ref: "r/x:1", Done: i * (120 << 20) / 1000, Total: 120 << 20})
	}
	// 5 s later, 10% further: one more.
	p.last = p.last.Add(-6 * time.Second)
	p.progress(image.Progress{Ref: "r/x:1", Done: 50 << 20, Total: 120 << 20})
	p.progress(image.Progress{Ref: "r/x:1", Done: 51 << 20, Total: 120 << 20})
	p.finish(&image.Image{Digest: "sha256:" + strings.Repeat("a", 64)})
	events.waitFor(t, "Pulled image r/x:1 (sha256:aaaaaaaaaaaa, 120 MiB)")
	must.Eq(t, []string{cfg.ID + ": Downloading image r/x:1: 0 KiB of 120 MiB", cfg.ID + ": Downloading image r/x:1: 50 MiB of 120 MiB"},
		events.with("Downloading"))
}

// A privileged task from an image is granted by the digest its reference
// resolved to, as pulled.
func TestStartTask_theGrantMatchesThePulledDigest(t *testing.T) {
	grant := func(digest string) func(c *Config, _ string) {
		return func(c *Config, _ string) {
			c.AllowPrivileged, c.PrivilegedPluginsOnly = true, false
			c.PrivilegedGrants = []PrivilegedGrant{{Namespace: "default", Job: "csi", Image: "registry.example/plugin@" + digest}}
		}
	}
	start := func(d *imageDriver) error {
		cfg := taskConfig(t, TaskConfig{Command: "/bin/plugin", Image: d.ref, Privileged: true})
		cfg.JobID = "csi"
		_, _, err := d.StartTask(cfg)
		return err
	}
	var pinned string
	d := newImageDriver(t, nil, func(c *Config, digest string) { pinned = digest; grant(digest)(c, digest) })
	must.NoError(t, start(d))
	must.SliceLen(t, 1, d.roots)

	other := "sha256:" + strings.Repeat("0", 64)
	d = newImageDriver(t, nil, grant(other))
	err := start(d)
	must.ErrorContains(t, err, "resolved to "+pinned)
	must.ErrorContains(t, err, "privileged_grant")
	must.SliceEmpty(t, d.roots)
	// The refused task lets its image go.
	must.SliceEmpty(t, d.uses(t))
}

// Under an image grant, a job's mount where the image's entrypoint leads
// through its symlinks (/usr/local/bin/plugin -> /opt/p/plugin) would put
// the job's files in place of the granted program: the starting task is
// told the file, and refused.
func TestStartTask_theGrantedProgramIsTheImagesFile(t *testing.T) {
	d := newImageDriverOf(t, imagebuild.Spec{Entrypoint: []string{"/usr/local/bin/plugin"}}, []imagebuild.Entry{
		imagebuild.File("opt/p/plugin", []byte("#!/bin/sh\n"), 0o755),
		imagebuild.Symlink("usr/local/bin/plugin", "/opt/p/plugin"),
	}, nil, func(c *Config, digest string) {
		c.AllowPrivileged, c.PrivilegedPluginsOnly = true, false
		c.PrivilegedGrants = []PrivilegedGrant{{Namespace: "default", Job: "csi", Image: "registry.example/plugin@" + digest}}
	})
	for _, target := range []string{"/var/lib/p", "/opt/p"} {
		cfg := taskConfig(t, TaskConfig{Image: d.ref, Privileged: true})
		cfg.JobID = "csi"
		cfg.Mounts = []*drivers.MountConfig{{TaskPath: target, HostPath: t.TempDir()}}
		h, _, err := d.StartTask(cfg)
		if target == "/var/lib/p" {
			must.NoError(t, err)
			must.NoError(t, d.DestroyTask(h.Config.ID, true))
			continue
		}
		must.ErrorContains(t, err, `a mount at "/opt/p"`)
		must.ErrorContains(t, err, "privileged_grant")
	}
}

// A task whose config is wrong in itself or against the agent's (a volume
// size that is no size, a mode that is none, a relative destination, a
// capability or host namespace the node does not allow) is refused before
// its image is pulled: no download, nothing left in the store for
// image_gc.
func TestStartTask_badConfigRefusedBeforeThePull(t *testing.T) {
	withVolume := func(label string, edit func(*VolumeConfig)) func(*TaskConfig) {
		return func(tc *TaskConfig) {
			v := VolumeConfig{PluginID: "hostpath", VolumeID: "db", Destination: "/data"}
			edit(&v)
			tc.Volumes = map[string]VolumeConfig{label: v}
		}
	}
	for name, c := range map[string]struct {
		edit func(*TaskConfig)
		want string
	}{
		"size":        {withVolume("data", func(v *VolumeConfig) { v.Create = &VolumeCreateBlock{CapacityMin: "lots"} }), `create capacity_min "lots" is not a size`},
		"access mode": {withVolume("data", func(v *VolumeConfig) { v.AccessMode = "single-node-multi-writer" }), `access_mode "single-node-multi-writer" is not supported`},
		"destination": {withVolume("data", func(v *VolumeConfig) { v.Destination = "data" }), `destination "data" must be an absolute path`},
		"name":        {withVolume("../data", func(v *VolumeConfig) {}), `name must be 1-63 letters`},
		"cap_add":     {func(tc *TaskConfig) { tc.CapAdd = []string{"sys_admin"} }, `cap_add: sys_admin not allowed on this node`},
		"pid_mode":    {func(tc *TaskConfig) { tc.PIDMode = "host" }, `pid_mode = "host" is not allowed on this node`},
	} {
		t.Run(name, func(t *testing.T) {
			d := newImageDriver(t, nil)
			tc := TaskConfig{Command: "/bin/plugin", Image: d.ref}
			c.edit(&tc)
			_, _, err := d.StartTask(taskConfig(t, tc))
			must.ErrorContains(t, err, c.want)
			must.ErrorContains(t, err, "invalid task config: ")
			list, err := d.images.List(nil)
			must.NoError(t, err)
			must.SliceEmpty(t, list, must.Sprint("the image was pulled for a task its config refuses"))
			must.SliceEmpty(t, d.roots)
			must.SliceEmpty(t, d.started)
		})
	}
}

// A task from an image stops with the image's STOPSIGNAL when its job
// sets no kill_signal (Nomad passes ""), as Docker and Nomad's docker
// driver stop a container; the job's kill_signal wins; an image that names
// none, or one the driver does not know, stops with SIGINT, as exec. A
// driver that recovers the task keeps the image's signal.
func TestStopTask_imageStopSignal(t *testing.T) {
	entries := []imagebuild.Entry{imagebuild.File("bin/plugin", []byte("#!/bin/sh\n"), 0o755)}
	for _, tc := range []struct {
		name, stopSignal, killSignal string
		want                         syscall.Signal
	}{
		{"the image's", "SIGTERM", "", syscall.SIGTERM},
		{"the image's without SIG", "quit", "", syscall.SIGQUIT},
		{"the image's by number", "15", "", syscall.SIGTERM},
		{"kill_signal wins", "SIGTERM", "SIGUSR1", syscall.SIGUSR1},
		{"none", "", "", syscall.SIGINT},
		// Real-time ones, as systemd images ask, by name and number.
		{"real-time", "SIGRTMIN+3", "", syscall.Signal(37)},
		{"real-time without SIG", "rtmin+3", "", syscall.Signal(37)},
		{"real-time by number", "37", "", syscall.Signal(37)},
		{"last real-time", "SIGRTMAX", "", syscall.Signal(64)},
		// SIGKILL and SIGSTOP are signals: the task is killed at once,
		// or frozen until the kill after kill_timeout.
		{"SIGKILL", "SIGKILL", "", syscall.SIGKILL},
		{"SIGSTOP", "SIGSTOP", "", syscall.SIGSTOP},
		// Not signals to stop with: 0 delivers nothing; 32 and 33 are
		// the C library's; past the last one.
		{"unknown", "SIGRTMIN+31", "", syscall.SIGINT},
		{"zero", "0", "", syscall.SIGINT},
		{"SIGNULL", "SIGNULL", "", syscall.SIGINT},
		{"the C library's", "33", "", syscall.SIGINT},
		{"past the last", "999", "", syscall.SIGINT},
		{"negative", "-9", "", syscall.SIGINT},
		// A hostile image's: the event quotes it cut short.
		{"huge", strings.Repeat("SIGX", 1<<18), "", syscall.SIGINT},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newImageDriverOf(t, imagebuild.Spec{Entrypoint: []string{"/bin/plugin"}, StopSignal: tc.stopSignal}, entries, nil)
			cfg := taskConfig(t, TaskConfig{Image: d.ref})
			handle, _, err := d.StartTask(cfg)
			must.NoError(t, err)
			must.NoError(t, d.StopTask(cfg.ID, time.Second, tc.killSignal))
			must.Eq(t, []syscall.Signal{tc.want}, d.procs[0].signals)
			if tc.stopSignal == "SIGRTMIN+31" {
				d.events.waitFor(t, `asks to be stopped with "SIGRTMIN+31"`)
			}
			if tc.name == "huge" {
				d.events.waitFor(t, `asks to be stopped with "SIGXSIGX`)
				for _, e := range d.events.with("asks to be stopped") {
					must.Less(t, 1024, len(e), must.Sprintf("an event of %d bytes", len(e)))
				}
			}

			// Recovered by a new driver process, from the handle alone.
			must.NoError(t, os.MkdirAll(d.currentConfig().taskStateDir(cfg.ID), 0o700))
			d2 := newTestDriver(t, Config{Enabled: true, RootDir: d.currentConfig().RootDir, LocalImageDirs: d.currentConfig().LocalImageDirs})
			must.NoError(t, d2.RecoverTask(handle))
			must.NoError(t, d2.StopTask(cfg.ID, time.Second, tc.killSignal))
			must.Eq(t, []syscall.Signal{tc.want}, d2.procs[0].signals)
		})
	}
}
