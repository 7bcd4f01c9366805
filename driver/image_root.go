package driver

import (
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
	user, def := cfg.User, false
	if user == "" {
		user = img.Config.User
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
	default:
		if u, err = resolveImageUser(fs, user); err != nil {
			return fmt.Errorf("invalid task config: image %q: %w", img.Ref, err)
		}
	}
	if tc.Privileged {
		// A privileged task runs as root: the operator grants root, and
		// another user holds none of the powers a privileged task is for.
		if u.cred.UID != 0 {
			return fmt.Errorf("invalid task config: a privileged task runs as root, and image %q runs as user %q (uid %d): set user = \"root\" in the task", img.Ref, user, u.cred.UID)
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
	d.addMountLayer(spec)
	return nil
}

// addMountLayer puts below the image's layers the store's layer of the
// targets of the task's mounts (image.Store.MountLayer), so that the
// supervisor finds them in the image root instead of making each in the
// task's writable layer. It is a shortcut: without it (no store, the
// store's limit, an error) the targets are made at the start, as they are
// for the task's volumes, whose targets are left out.
func (d *Driver) addMountLayer(spec *executor.Spec) {
	points := mountPoints(spec.Mounts)
	if len(points) == 0 {
		return
	}
	s, err := d.imageStore()
	if err != nil {
		return
	}
	layer, err := s.MountLayer(points)
	if err != nil {
		d.logger.Debug("going without a mount-point layer", "error", err)
		return
	}
	if layer != "" {
		spec.Image.Layers = append([]string{layer}, spec.Image.Layers...)
	}
}

// mountPoints are the targets of mounts that a mount-point layer can
// hold: not in /dev, /proc or /sys (the host's, or the task's own), not
// inside another mount's target (made in that mount's source, on the
// host), and of a source the driver can see.
func mountPoints(mounts []executor.Mount) []image.MountPoint {
	var out []image.MountPoint
	for _, m := range mounts {
		target := filepath.Clean("/" + m.Target)
		if target == "/" || slices.ContainsFunc([]string{"/dev", "/proc", "/sys"}, func(k string) bool { return mounter.PathWithin(target, k) }) {
			continue
		}
		if slices.ContainsFunc(mounts, func(o executor.Mount) bool {
			other := filepath.Clean("/" + o.Target)
			return other != target && mounter.PathWithin(target, other)
		}) {
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
