package driver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/atomicfile"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// Images: the task option `image` names an OCI image the driver pulls
// into its store under root_dir (driver/image) before the task's root is
// made from it. What a hostile job can do with `image` and `auth`:
//   - make the node fetch from any registry over HTTPS (plain HTTP only to
//     insecure_registries), with its own credentials or none; the
//     operator's auth config and helper are used for the registries they
//     name, for any job, as Docker's are;
//   - use any image already in the store by naming it (as Docker and the
//     kubelet share pulled images on a node), but one a task pulled with
//     its own auth only with the same credentials (or its registry's
//     consent), and any layer the store has by its diff id;
//   - read a host file only as an image, and only inside local_image_dirs,
//     never through a symlink; errors never quote a file;
//   - fill the store no further than image_max_size per image and
//     image_max_layers layers, within image_pull_timeout.

// Defaults of the image options.
const (
	// DefaultImageGC keeps an image a day after its last task: plugin
	// images are few and large, and an update rolled back within a day
	// finds its image.
	DefaultImageGC          = "24h"
	DefaultImageMaxSize     = "20GiB"
	DefaultImagePullTimeout = "5m"
	// maxImageLayers is overlayfs's limit of lower layers.
	maxImageLayers      = 500
	maxImagePullTimeout = 24 * time.Hour
)

// PluginAuth is the plugin's auth block, as Nomad's docker driver's:
// config is a docker-style config.json, helper a docker-credential-<helper>
// program.
type PluginAuth struct {
	Config string `codec:"config"`
	Helper string `codec:"helper"`
}

// TaskAuth is a task's auth block. Never logged.
type TaskAuth struct {
	Username string `codec:"username"`
	Password string `codec:"password"`
}

var validHelperName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// validRegistryHost is host[:port] as insecure_registries lists them.
var validRegistryHost = regexp.MustCompile(`^[A-Za-z0-9.-]+(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:]+\](:[0-9]{1,5})?$`)

// imageGC is image_gc parsed (its default when unset); 0 keeps images for
// ever.
func (c *Config) imageGC() time.Duration {
	s := c.ImageGC
	if s == "" {
		s = DefaultImageGC
	}
	if s == "0" {
		return 0
	}
	d, _ := time.ParseDuration(s)
	return d
}

// imageMaxLayers is image_max_layers (its default when unset).
func (c *Config) imageMaxLayers() int {
	if c.ImageMaxLayers == 0 {
		return image.DefaultMaxLayers
	}
	return c.ImageMaxLayers
}

func (c *Config) validateImages() error {
	if a := c.Auth; a != nil {
		if a.Config != "" && !filepath.IsAbs(a.Config) {
			return fmt.Errorf("auth config must be an absolute path to a docker-style config.json, got %q", a.Config)
		}
		if a.Helper != "" && !validHelperName.MatchString(a.Helper) {
			return fmt.Errorf("auth helper %q must be the name of a credential helper (docker-credential-<helper>), such as \"ecr-login\"", a.Helper)
		}
	}
	if c.RegistryCAFile != "" && !filepath.IsAbs(c.RegistryCAFile) {
		return fmt.Errorf("registry_ca_file must be an absolute path to a PEM file of CA certificates, got %q", c.RegistryCAFile)
	}
	for i, r := range c.InsecureRegistries {
		if !validRegistryHost.MatchString(r) {
			return fmt.Errorf("insecure_registries[%d] %q must be a registry's host[:port], such as \"registry.internal:5000\", without a scheme or path", i, r)
		}
	}
	for i, d := range c.LocalImageDirs {
		if !filepath.IsAbs(d) || filepath.Clean(d) != d || d == "/" {
			return fmt.Errorf("local_image_dirs[%d] must be an absolute, clean path other than \"/\", such as \"/srv/images\", got %q", i, d)
		}
		// A job names files in these directories: none may hold the
		// driver's own state, nor be held by it.
		if mounter.PathWithin(d, c.RootDir) || mounter.PathWithin(c.RootDir, d) {
			return fmt.Errorf("local_image_dirs[%d] %q must not be root_dir %q, inside it or around it: jobs name files in these directories", i, d, c.RootDir)
		}
	}
	// Every task that is not privileged and has no image sees the
	// chroot_env sources: root_dir (the image store, other tasks' state)
	// must be none of them, nor inside or around one.
	for src := range c.chrootEnv() {
		if mounter.PathWithin(c.RootDir, filepath.Clean(src)) || mounter.PathWithin(filepath.Clean(src), c.RootDir) {
			return fmt.Errorf("root_dir %q must not be inside, be or hold the chroot_env source %q: every task that is not privileged sees that, and would read the image store and other tasks' state; move root_dir (default %q) or bind a narrower directory",
				c.RootDir, src, DefaultRootDir)
		}
	}
	if d, err := time.ParseDuration(c.ImageGC); c.ImageGC != "0" && c.ImageGC != "" && (err != nil || d < time.Second) {
		return fmt.Errorf("image_gc must be a duration of at least \"1s\" (how long an image no task uses is kept), or \"0\" to keep images, got %q", c.ImageGC)
	}
	if n := c.imageMaxLayers(); n < 1 || n > maxImageLayers {
		return fmt.Errorf("image_max_layers must be from 1 to %d (overlayfs's limit), got %d", maxImageLayers, c.ImageMaxLayers)
	}
	if _, err := c.imageMaxSize(); err != nil {
		return err
	}
	return nil
}

func (c *Config) imageMaxSize() (int64, error) {
	if c.ImageMaxSize == "" {
		return image.DefaultMaxSize, nil
	}
	n, err := humanize.ParseBytes(c.ImageMaxSize)
	if err != nil || n == 0 || n > 1<<50 {
		return 0, fmt.Errorf("image_max_size must be a size such as \"20GiB\", got %q", c.ImageMaxSize)
	}
	return int64(n), nil
}

// imageOptions are the store's options from the plugin's config.
func (c *Config) imageOptions(logger hclog.Logger) image.Options {
	size, _ := c.imageMaxSize()
	o := image.Options{RegistryCAFile: c.RegistryCAFile, InsecureRegistries: c.InsecureRegistries, LocalDirs: c.LocalImageDirs,
		MaxLayers: c.imageMaxLayers(), MaxSize: size, Logger: logger}
	if c.Auth != nil {
		o.AuthConfigFile, o.AuthHelper = c.Auth.Config, c.Auth.Helper
	}
	return o
}

// validateImage checks a task's image, auth and image_pull_timeout.
func (tc *TaskConfig) validateImage(cfg *Config) error {
	if tc.Image == "" {
		if tc.Auth != nil {
			return errors.New("auth is only for image: remove it, or set image")
		}
		if tc.ForcePull {
			return errors.New("force_pull is only for image: remove it, or set image")
		}
		return nil
	}
	if _, err := image.ParseReference(tc.Image, cfg.InsecureRegistries); err != nil {
		return err
	}
	if _, err := tc.imagePullTimeout(); err != nil {
		return err
	}
	return nil
}

func (tc *TaskConfig) imagePullTimeout() (time.Duration, error) {
	s := tc.ImagePullTimeout
	if s == "" {
		s = DefaultImagePullTimeout
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < time.Second || d > maxImagePullTimeout {
		return 0, fmt.Errorf("image_pull_timeout %q must be a duration from \"1s\" to \"%s\", such as \"5m\"", tc.ImagePullTimeout, maxImagePullTimeout)
	}
	return d, nil
}

// imageStore is the driver's store (nil when the driver is disabled or
// the store could not be opened: then a task with an image fails, saying
// why).
func (d *Driver) imageStore() (*image.Store, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.images == nil {
		return nil, fmt.Errorf("the image store under root_dir is not usable: %w", d.imagesErr)
	}
	return d.images, nil
}

// openImages opens the image store for cfg, writes the options the
// operator's CLI pulls with, and starts the GC loop once.
func (d *Driver) openImages(cfg *Config) {
	s, err := image.Open(cfg.RootDir, cfg.imageOptions(d.logger.Named("image")))
	if err != nil {
		d.logger.Error("the image store cannot be opened: tasks with an image will fail", "error", err)
	} else if err := writeImageOptions(cfg); err != nil {
		d.logger.Warn("failed to write the image options for the operator's CLI", "error", err)
	}
	d.mu.Lock()
	d.images, d.imagesErr = s, err
	d.mu.Unlock()
	if s != nil && cfg.imageGC() > 0 {
		d.imageGCOnce.Do(func() { d.goBackground(d.imageGCLoop) })
	}
}

// ImageOptions is what `images pull` of the CLI reads to pull as the
// driver does (images/options.json): paths and names, never a secret.
type ImageOptions struct {
	RegistryCAFile     string   `json:"registry_ca_file,omitempty"`
	InsecureRegistries []string `json:"insecure_registries,omitempty"`
	LocalImageDirs     []string `json:"local_image_dirs,omitempty"`
	AuthConfig         string   `json:"auth_config,omitempty"`
	AuthHelper         string   `json:"auth_helper,omitempty"`
	ImageMaxLayers     int      `json:"image_max_layers"`
	ImageMaxSize       int64    `json:"image_max_size"`
}

// ImageOptionsFile is where the driver writes them.
func ImageOptionsFile(rootDir string) string {
	return filepath.Join(image.Dir(rootDir), "options.json")
}

func writeImageOptions(cfg *Config) error {
	o := cfg.imageOptions(nil)
	b, err := json.MarshalIndent(ImageOptions{RegistryCAFile: o.RegistryCAFile, InsecureRegistries: o.InsecureRegistries,
		LocalImageDirs: o.LocalDirs, AuthConfig: o.AuthConfigFile, AuthHelper: o.AuthHelper,
		ImageMaxLayers: o.MaxLayers, ImageMaxSize: o.MaxSize}, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(ImageOptionsFile(cfg.RootDir), b, 0o600, false)
}

// StoreOptions turns options the driver wrote back into the store's.
func (o ImageOptions) StoreOptions() image.Options {
	return image.Options{RegistryCAFile: o.RegistryCAFile, InsecureRegistries: o.InsecureRegistries, LocalDirs: o.LocalImageDirs,
		AuthConfigFile: o.AuthConfig, AuthHelper: o.AuthHelper, MaxLayers: o.ImageMaxLayers, MaxSize: o.ImageMaxSize}
}

// TaskExists says whether a task (by ID) still has its state under
// rootDir: a task the driver runs, or one a restarted driver will be
// asked to recover. An image lease of any other task is let go.
func TaskExists(rootDir, taskID string) bool {
	_, err := os.Stat(TaskStateDir(rootDir, taskID))
	return err == nil
}

// taskLive says which leases hold: a task the driver runs, starts (its
// lease is taken before its state exists) or is to recover.
func (d *Driver) taskLive(conf *Config) image.Live {
	return func(u image.Use) bool {
		if _, ok := d.tasks.Get(u.TaskID); ok || d.invocations.alive(u.TaskID) {
			return true
		}
		return TaskExists(conf.RootDir, u.TaskID)
	}
}

// imageGCLoop removes images no task used for image_gc, checking every
// quarter of it (at most every 10 minutes, at least every second).
func (d *Driver) imageGCLoop() {
	for {
		conf := d.currentConfig()
		var delay time.Duration
		if conf != nil {
			delay = conf.imageGC()
		}
		period := min(max(delay/4, time.Second), 10*time.Minute)
		if delay > 0 {
			if s, err := d.imageStore(); err == nil {
				removed, err := s.GC(delay, d.taskLive(conf))
				if err != nil {
					d.logger.Warn("image GC failed", "error", err)
				}
				for _, r := range removed {
					d.logger.Info("removed an image no task used", "digest", r, "image_gc", conf.ImageGC)
				}
			}
		}
		select {
		case <-d.ctx.Done():
			return
		case <-time.After(period):
		}
	}
}

// pullImage pulls the task's image, telling the task's events, and takes
// the task's lease on it.
func (d *Driver) pullImage(logger hclog.Logger, cfg *drivers.TaskConfig, tc *TaskConfig) (*image.Image, error) {
	s, err := d.imageStore()
	if err != nil {
		return nil, err
	}
	timeout, err := tc.imagePullTimeout()
	if err != nil {
		return nil, fmt.Errorf("invalid task config: %w", err)
	}
	ctx, cancel := context.WithTimeout(d.ctx, timeout)
	defer cancel()
	job := jobOf(cfg)
	req := image.PullRequest{
		Use:       &image.Use{TaskID: cfg.ID, AllocID: cfg.AllocID, TaskName: cfg.Name, Namespace: job.namespace, JobID: job.id},
		Notify:    func(msg string) { d.emitEvent(cfg, msg, map[string]string{"image": tc.Image}) },
		ForcePull: tc.ForcePull,
	}
	if tc.Auth != nil {
		req.Auth = &image.Credentials{Username: tc.Auth.Username, Password: tc.Auth.Password}
	}
	events := &pullEvents{d: d, cfg: cfg, ref: tc.Image, start: time.Now()}
	req.Progress = events.progress
	img, err := s.Pull(ctx, tc.Image, req)
	if err != nil {
		logger.Warn("failed to pull the task's image", "image", tc.Image, "error", err)
		return nil, err
	}
	events.finish(img)
	logger.Info("image ready", "image", tc.Image, "digest", img.Digest)
	return img, nil
}

// pullEvents turns a pull's progress into a few task events: the first,
// then at most one each 5 seconds that says 10% more, then the end.
type pullEvents struct {
	d     *Driver
	cfg   *drivers.TaskConfig
	ref   string
	start time.Time

	mu       sync.Mutex
	sent     int
	last     time.Time
	lastFrac float64
	present  bool
	total    int64
}

func (p *pullEvents) progress(pr image.Progress) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pr.Present {
		p.present = true
		return
	}
	p.total = pr.Total
	frac := 1.0
	if pr.Total > 0 {
		frac = float64(pr.Done) / float64(pr.Total)
	}
	now := time.Now()
	if p.sent > 0 && (now.Sub(p.last) < 5*time.Second || frac-p.lastFrac < 0.1 || pr.Done >= pr.Total) {
		return
	}
	p.sent++
	p.last, p.lastFrac = now, frac
	p.d.emitEvent(p.cfg, fmt.Sprintf("Downloading image %s: %s of %s", p.ref, mib(pr.Done), mib(pr.Total)), map[string]string{"image": p.ref})
}

func (p *pullEvents) finish(img *image.Image) {
	p.mu.Lock()
	defer p.mu.Unlock()
	digest := img.Digest
	if len(digest) > 19 {
		digest = digest[:19]
	}
	if p.present && p.sent == 0 {
		p.d.emitEvent(p.cfg, fmt.Sprintf("Image %s is present (%s)", p.ref, digest), map[string]string{"image": p.ref, "digest": img.Digest})
		return
	}
	p.d.emitEvent(p.cfg, fmt.Sprintf("Pulled image %s (%s, %s) in %s", p.ref, digest, mib(p.total), time.Since(p.start).Round(100*time.Millisecond)),
		map[string]string{"image": p.ref, "digest": img.Digest})
}

// mib writes a byte count in MiB ("48 MiB"), smaller counts in KiB.
func mib(n int64) string {
	if n < 1<<20 {
		return fmt.Sprintf("%d KiB", (n+1023)>>10)
	}
	return strings.TrimSuffix(fmt.Sprintf("%.0f MiB", float64(n)/(1<<20)), ".0")
}

// releaseImage lets go of a task's image lease.
func (d *Driver) releaseImage(logger hclog.Logger, taskID string) {
	s, err := d.imageStore()
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Release(ctx, taskID); err != nil {
		logger.Warn("failed to release the task's image; GC lets it go once the task's state is gone", "error", err)
	}
}

// recoverImage takes the lease of a recovered task again (it is on disk
// already unless a GC let it go while the driver was down).
func (d *Driver) recoverImage(logger hclog.Logger, cfg *drivers.TaskConfig, digest string) {
	s, err := d.imageStore()
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	job := jobOf(cfg)
	if err := s.Acquire(ctx, image.Use{TaskID: cfg.ID, AllocID: cfg.AllocID, TaskName: cfg.Name, Namespace: job.namespace, JobID: job.id}, digest); err != nil {
		logger.Warn("failed to take back the task's image lease", "digest", digest, "error", err)
	}
}
