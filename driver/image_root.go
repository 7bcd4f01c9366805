package driver

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// applyImageRoot makes the pulled image img the root of the task whose
// spec buildSpec made: the overlay of its layers (executor.ImageRoot), and
// the image's configuration as the defaults of the task's command,
// environment, working directory and user, overridden as Nomad's docker
// driver overrides them (imageCommand, imageEnv). The user is resolved in
// the image's /etc/passwd and /etc/group, and denied_host_uids and
// denied_host_gids apply to the ids it resolves to; a privileged task must
// resolve to root.
func (d *Driver) applyImageRoot(conf *Config, cfg *drivers.TaskConfig, tc *TaskConfig, spec *executor.Spec, img *image.Image) error {
	if len(img.Layers) == 0 {
		return fmt.Errorf("image %q has no layers to make a root of", img.Ref)
	}
	argv, err := imageCommand(img, tc)
	if err != nil {
		return fmt.Errorf("invalid task config: %w", err)
	}
	spec.Command, spec.Args = argv[0], argv[1:]

	fs := newLayeredFS(img.Layers)
	user, def, fromImage := cfg.User, false, false
	if user == "" {
		user, fromImage = img.Config.User, img.Config.User != ""
	}
	if user == "" {
		// Neither the job nor the image says: the driver's default
		// (buildSpec's), nobody for a task that is not privileged and no
		// plugin, root otherwise.
		user, def = spec.User, true
	}
	var u *imageUser
	switch {
	case user == "":
		u = &imageUser{home: "/root"}
	case def:
		if u, err = resolveImageUser(fs, user); err != nil {
			// An image without nobody: the id every distribution gives it.
			u = &imageUser{cred: executor.Credential{UID: 65534, GID: 65534}, home: "/"}
		}
	case fromImage:
		if u, err = resolveImageUser(fs, user); err != nil {
			return fmt.Errorf("invalid task config: image %q: its USER %q: %w; or set user in the task", img.Ref, user, err)
		}
	default:
		if u, err = resolveImageUser(fs, user); err != nil {
			return fmt.Errorf("invalid task config: image %q: the task's user %q: %w", img.Ref, user, err)
		}
	}
	if tc.Privileged {
		// A privileged task runs as root: the operator grants root, and
		// another user holds none of the powers a privileged task is for.
		if u.cred.UID != 0 {
			return fmt.Errorf("invalid task config: a privileged task runs as root, and image %q runs as user %q (uid %d): set user = %q in the task", img.Ref, user, u.cred.UID, rootUser(fs))
		}
	} else if err := checkDeniedIDs(conf, userOrRoot(user), u.cred); err != nil {
		return fmt.Errorf("invalid task config: %w", err)
	}
	spec.User = user
	cred := u.cred
	spec.Credential = &cred

	spec.Env = imageEnv(img.Config.Env, nomadEnv(cfg, spec.Env))
	if !hasEnv(spec.Env, "PATH") {
		spec.Env = append(spec.Env, "PATH="+defaultTaskPath)
	}
	if !hasEnv(spec.Env, "HOME") {
		spec.Env = append(spec.Env, "HOME="+u.home)
	}
	switch {
	case tc.WorkDir != "":
		spec.Dir = tc.WorkDir
	case img.Config.WorkingDir != "":
		spec.Dir = filepath.Join("/", img.Config.WorkingDir)
	}

	spec.Image = &executor.ImageRoot{Layers: img.Layers, ReadOnly: tc.ReadonlyRootfs, Ref: img.Ref, Digest: img.Digest}
	if spec.Isolation != nil {
		// The image is the task's whole view: none of the host's files.
		spec.Isolation.ChrootEnv = nil
	}
	// The host's resolver configuration and hosts file, read-only, as
	// Docker gives a container on the host's network (a task's own dns
	// block, or a mount of the job's, wins; an image whose file is a
	// symlink keeps its own).
	for _, f := range []string{hostResolvConf, hostHostsFile} {
		if slices.ContainsFunc(spec.Mounts, func(m executor.Mount) bool { return m.Target == f }) {
			continue
		}
		if _, err := os.Stat(f); err != nil {
			continue
		}
		// An image whose file is a symlink (to its own resolver's
		// configuration, say) keeps it: a mount never goes where an
		// image's symlink leads but inside the image.
		if link, err := fs.isSymlink(f); err != nil || link {
			continue
		}
		spec.Mounts = append(spec.Mounts, executor.Mount{Source: f, Target: f, ReadOnly: true,
			Propagation: executor.PropagationPrivate, NoSuid: spec.Isolation != nil, NoDev: spec.Isolation != nil})
	}
	d.addMountLayer(cfg, spec, fs)
	return nil
}

// rootUser is how a task names root in the image fs: "root" where its
// /etc/passwd has root as uid 0, "0" (which needs no entry) otherwise.
func rootUser(fs *layeredFS) string {
	if u, err := resolveImageUser(fs, "root"); err == nil && u.cred.UID == 0 {
		return "root"
	}
	return "0"
}

// addMountLayer puts below the image's layers the store's layer of the
// targets of the task's mounts that the image lacks (image.Store.MountLayer),
// so that the supervisor finds them in the root instead of making each in
// the task's writable layer. It is a shortcut: without it (no store, the
// store's limit, an image of overlay's most layers, an error) the targets
// are made at the start, as they are for the task's volumes and for the
// mounts whose targets the job chose (its host volumes and devices), which
// are left out.
func (d *Driver) addMountLayer(cfg *drivers.TaskConfig, spec *executor.Spec, fs *layeredFS) {
	if len(spec.Image.Layers) >= maxImageLayers {
		return
	}
	points := mountPoints(spec.Mounts, jobTargets(cfg), fs)
	if len(points) == 0 {
		return
	}
	s, err := d.imageStore()
	if err != nil {
		return
	}
	layer, err := s.MountLayer(points)
	switch {
	case errors.Is(err, image.ErrMountLayersFull):
		d.mountLayersFull.Do(func() {
			d.logger.Info("the image store keeps as many mount-point layers as it may; image tasks with other mounts make their mount targets at each start", "error", err)
		})
		return
	case err != nil:
		d.logger.Debug("going without a mount-point layer", "error", err)
		return
	}
	spec.Image.Layers = append([]string{layer}, spec.Image.Layers...)
}

// jobTargets are the targets of the task's mounts that its job chose:
// Nomad's host volumes (volume_mount's destination) and devices.
func jobTargets(cfg *drivers.TaskConfig) []string {
	var out []string
	for _, m := range cfg.Mounts {
		if m != nil {
			out = append(out, filepath.Clean("/"+m.TaskPath))
		}
	}
	for _, dev := range cfg.Devices {
		if dev != nil {
			out = append(out, filepath.Clean("/"+dev.TaskPath))
		}
	}
	return out
}

// mountPoints are the targets of mounts that a mount-point layer holds:
// a target the image has not (fs), below directories the image has or
// has not, never through a symlink or a file of the image. Left out are a
// target in /dev, /proc or /sys (the host's, or the task's own), one
// inside another mount's target (made in that mount's source, on the
// host), one the job chose (skip), and one whose source the driver cannot
// see. Each target in the layer is one the start would otherwise make in
// the task's writable layer, with the image's directories above it copied
// up: with the layer, those directories are merged with the layer's as
// they would have been with the copies.
func mountPoints(mounts []executor.Mount, skip []string, fs *layeredFS) []image.MountPoint {
	var out []image.MountPoint
	for _, m := range mounts {
		target := filepath.Clean("/" + m.Target)
		if target == "/" || slices.Contains(skip, target) || mounter.WithinAny(target, []string{"/dev", "/proc", "/sys"}) {
			continue
		}
		if slices.ContainsFunc(mounts, func(o executor.Mount) bool {
			other := filepath.Clean("/" + o.Target)
			return other != target && mounter.PathWithin(target, other)
		}) {
			continue
		}
		if !fs.lacks(target) {
			continue
		}
		fi, err := os.Stat(m.Source)
		if err != nil {
			continue
		}
		out = append(out, image.MountPoint{Path: target, Dir: fi.IsDir()})
	}
	return out
}

// hostHostsFile is the host's hosts file, an image task's /etc/hosts.
const hostHostsFile = "/etc/hosts"

// imageCommand is the task's command line from the image's entrypoint and
// cmd and the task's entrypoint, command and args, as Nomad's docker driver
// (and Docker under it) combines them:
//
//	task entrypoint  task command  task args   runs
//	-                -             -           image Entrypoint + image Cmd
//	-                -             A           image Entrypoint + A
//	-                C             (A)         image Entrypoint + C (+ A)
//	E                -             -           E   (the image's Cmd is dropped)
//	E                -             A           E + A
//	E                C             (A)         E + C (+ A)
func imageCommand(img *image.Image, tc *TaskConfig) ([]string, error) {
	var cmd []string
	switch {
	case tc.Command != "":
		cmd = append([]string{tc.Command}, tc.Args...)
	case len(tc.Args) > 0:
		cmd = tc.Args
	case len(tc.Entrypoint) == 0:
		cmd = img.Config.Cmd
	}
	entry := img.Config.Entrypoint
	if len(tc.Entrypoint) > 0 {
		entry = tc.Entrypoint
	}
	argv := append(append([]string(nil), entry...), cmd...)
	if len(argv) == 0 || argv[0] == "" {
		return nil, fmt.Errorf("image %q has no entrypoint or cmd to run: set command (or entrypoint) in the task's config", img.Ref)
	}
	return argv, nil
}

// nomadEnv is the part of env that Nomad gave the task (its env map and
// device env), with the PATH buildSpec adds when Nomad gives none left out:
// the image's PATH comes before that default.
func nomadEnv(cfg *drivers.TaskConfig, env []string) []string {
	_, nomadPath := cfg.Env["PATH"]
	if _, ok := cfg.DeviceEnv["PATH"]; ok {
		nomadPath = true
	}
	if nomadPath {
		return env
	}
	out := env[:0:0]
	for _, kv := range env {
		if kv != "PATH="+defaultTaskPath {
			out = append(out, kv)
		}
	}
	return out
}

// imageEnv is the image's environment under the task's: a variable the
// task has (from Nomad: the job's env, Nomad's NOMAD_*, the driver's
// CSI_ENDPOINT) replaces the image's of the same name.
func imageEnv(image, task []string) []string {
	keys := make(map[string]bool, len(task))
	for _, kv := range task {
		k, _, _ := strings.Cut(kv, "=")
		keys[k] = true
	}
	out := make([]string, 0, len(image)+len(task))
	for _, kv := range image {
		k, _, ok := strings.Cut(kv, "=")
		if !ok || k == "" || keys[k] {
			continue
		}
		keys[k] = true
		out = append(out, kv)
	}
	return append(out, task...)
}

// newTaskImage is what authorize is told of img.
func newTaskImage(img *image.Image) taskImage {
	ti := taskImage{Ref: img.Ref, Digest: img.Digest, IndexDigest: img.IndexDigest, Entrypoint: img.Config.Entrypoint,
		Cmd: img.Config.Cmd, WorkingDir: img.Config.WorkingDir, Env: img.Config.Env}
	if prog := append(slices.Clone(img.Config.Entrypoint), img.Config.Cmd...); len(prog) > 0 {
		ti.ProgramFile = imageProgramFile(newLayeredFS(img.Layers), prog[0], img.Config.WorkingDir, pinnedPath(img.Config.Env))
	}
	return ti
}

// imageProgramFile is the file that prog, an image's own program, is in
// the image: prog from the image's working directory dir or, for a name,
// from the first entry of path (the image's PATH) that has it, with the
// image's symlinks followed; "" when the image has no such file.
func imageProgramFile(fs *layeredFS, prog, dir string, path []string) string {
	var candidates []string
	switch {
	case filepath.IsAbs(prog):
		candidates = []string{prog}
	case strings.Contains(prog, "/"):
		candidates = []string{inDir(dir, prog)}
	default:
		for _, d := range path {
			candidates = append(candidates, filepath.Join(inDir(dir, d), prog))
		}
	}
	for _, c := range candidates {
		if e, err := fs.lookup(c); err == nil && e.mode.IsRegular() {
			return filepath.Join("/", e.rel)
		}
	}
	return ""
}

// inDir is p from the directory dir: p when it is absolute.
func inDir(dir, p string) string {
	if filepath.IsAbs(p) {
		return filepath.Clean(p)
	}
	return filepath.Join("/", dir, p)
}
