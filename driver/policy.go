package driver

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// taskImage is the image a task starts from: the reference as the job
// wrote it and the digest of the manifest it resolved to for the node's
// platform. Both are "" for a task that runs a host binary.
// taskImage is the image a task starts from: its reference as the job
// wrote it, the digest of its manifest for this node's platform and, when
// the reference named a multi-platform index, the index's digest.
type taskImage struct {
	Ref, Digest, IndexDigest string
	// Entrypoint and Cmd are the image's own (its configuration's).
	Entrypoint, Cmd []string
	// WorkingDir is the image's working directory ("" for none), Env its
	// environment.
	WorkingDir string
	Env        []string
	// ProgramFile is the file the image's program is, its symlinks in the
	// image followed (imageProgramFile); "" when not known.
	ProgramFile string
}

// authorize applies the operator's word to a task that is starting, before
// anything is set up for it:
//   - a csi_plugin id that a privileged_grant reserves (plugin_id) is
//     served only by a task one of those grants matches, privileged or
//     not, whether or not the granted task runs now;
//   - a privileged task needs allow_privileged, is a CSI plugin task
//     unless privileged_plugins_only is off, runs as root, and runs only
//     where a privileged_grant matches it. Under a grant that pins its
//     command, spec.Path is set to the resolved executable, so that the
//     task runs exactly what was matched; a grant that pins its command or
//     image keeps the job from making that program load the job's code.
//
// It returns the grant of a privileged task (nil for one that is not). Its
// errors name the key or the grant to add.
func authorize(conf *Config, cfg *drivers.TaskConfig, tc *TaskConfig, spec *executor.Spec, img taskImage) (*PrivilegedGrant, error) {
	job := jobOf(cfg)
	s := grantSubject{Namespace: job.namespace, Job: job.id, Parent: childOf(cfg), ImageRef: img.Ref, ImageDigest: img.Digest, ImageIndexDigest: img.IndexDigest}
	// Nomad registers the id of its own block from the task's socket
	// whatever this driver's block says: a task with both would have its
	// grants matched, and reservations checked, against the id Nomad does
	// not register.
	np, err := nomadPlugin(cfg)
	switch {
	case err != nil:
		return nil, err
	case np != nil && tc.CSIPlugin != nil:
		return nil, fmt.Errorf("the task has this driver's csi_plugin block (id %q, in config) and Nomad's csi_plugin block (id %q, in the task): a task serves one plugin; give each plugin its own task", tc.CSIPlugin.ID, np.id)
	case tc.CSIPlugin != nil:
		s.PluginID = tc.CSIPlugin.ID
	case np != nil:
		s.PluginID = np.id
	}
	targets := mountTargets(spec, tc)
	if slices.ContainsFunc(conf.PrivilegedGrants, func(g PrivilegedGrant) bool { return g.Command != "" }) {
		switch {
		case img.Digest != "":
			s.CommandErr = errors.New("the task runs from an image, whose programs a command grant does not name: pin the image instead")
		case !tc.Privileged:
			s.CommandErr = errors.New("the task is not privileged: its command is looked up in its own root, not the host's")
		default:
			s.Command, s.CommandErr = resolveGrantCommand(spec.Command, spec.Dir, spec.Env, targets,
				tasksWriteDirs(conf, cfg))
		}
	}

	if s.PluginID != "" {
		if res := reserving(conf.PrivilegedGrants, s.PluginID); len(res) > 0 {
			g, why := matchGrantWhere(conf.PrivilegedGrants, s, func(g PrivilegedGrant) bool { return g.PluginID == s.PluginID })
			if g == nil {
				names := make([]string, len(res))
				for i, r := range res {
					names[i] = fmt.Sprintf("privileged_grant[%d] %s", r.index, r.grant.body())
				}
				msg := fmt.Sprintf("csi_plugin id %q is reserved on this node by the operator for the tasks of %s, which do not match %s", s.PluginID, strings.Join(names, " and "), job)
				if len(why) > 0 {
					msg += " (" + strings.Join(why, "; ") + ")"
				}
				return nil, fmt.Errorf("%s%s: choose another id, or have the operator grant this job the id in the driver's plugin config", msg, childHint(s.Parent))
			}
		}
	}

	if !tc.Privileged {
		return nil, nil
	}
	// allow_privileged was checked by TaskConfig.validate.
	if conf.PrivilegedPluginsOnly && s.PluginID == "" {
		return nil, errors.New("privileged = true is only allowed for CSI plugin tasks on this node (privileged_plugins_only = true in the driver's plugin config): give the task a csi_plugin block (this driver's in config, or Nomad's in the task) if it is a CSI plugin, drop privileged = true otherwise, or have the operator set privileged_plugins_only = false")
	}
	if err := checkPrivilegedUser(cfg.User); err != nil {
		return nil, err
	}
	g, why := matchGrant(conf.PrivilegedGrants, s)
	if g == nil {
		msg := fmt.Sprintf("privileged = true needs the operator's grant on this node, and no privileged_grant in the driver's plugin config matches %s", job)
		if len(why) > 0 {
			msg += " (" + strings.Join(why, "; ") + ")"
		}
		return nil, fmt.Errorf("%s%s: if the operator trusts this job with root on the node, they add to the config block of plugin \"nomad-driver-csi\": %s", msg, childHint(s.Parent), suggestGrant(s))
	}
	if g.Command != "" {
		spec.Path = s.Command
	}
	if g.Command != "" || g.Image != "" {
		if err := checkPinned(conf, cfg, tc, spec, g, s.Command, targets); err != nil {
			return nil, err
		}
	}
	if g.Image != "" {
		if err := checkImageProgram(tc, img, g, jobMountTargets(conf, spec, tc)); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// checkImageProgram keeps a task under a grant that pins its image running
// the image's own program: its entrypoint, or, for an image with only a
// cmd, the cmd's program. A job's entrypoint, or a command or first arg
// that takes the place of the cmd's program (imageCommand), would run any
// program the image holds, a shell with the job's script among them, as
// root. The program's arguments stay the job's, as under a command grant.
//
// The program must also be the image's file where it runs: a relative one
// is found in the working directory, which the job's work_dir would move
// to its own files, and none of the job's mounts (targets) may go on,
// above or inside the program's directory or the image's working
// directory (an interpreted program's modules are there: democratic-csi's
// node_modules).
func checkImageProgram(tc *TaskConfig, img taskImage, g *PrivilegedGrant, targets []string) error {
	if err := checkImageProgramName(tc, img, g); err != nil {
		return err
	}
	prog := img.Cmd[:min(len(img.Cmd), 1)]
	if len(img.Entrypoint) > 0 {
		prog = img.Entrypoint[:1]
	}
	imageDir := filepath.Join("/", img.WorkingDir)
	if !filepath.IsAbs(prog[0]) && strings.Contains(prog[0], "/") && tc.WorkDir != "" && filepath.Clean(tc.WorkDir) != imageDir {
		return fmt.Errorf("work_dir %q is not allowed in this task: the image's program %q is relative to its working directory %q, and from another it would be a file the job chooses, run as root; drop work_dir (%s pins the image)", tc.WorkDir, prog[0], imageDir, g)
	}
	dir := imageDir
	if tc.WorkDir != "" {
		dir = filepath.Clean(tc.WorkDir)
	}
	path := inDir(dir, prog[0])
	places := []string{path, filepath.Dir(path), imageDir}
	if img.ProgramFile != "" {
		places = append(places, img.ProgramFile, filepath.Dir(img.ProgramFile))
	}
	// The image's PATH, where a name is found and the program finds the
	// programs it runs by name, unless the job's PATH (checkPinned's)
	// stands in for it.
	for _, d := range pinnedPath(img.Env) {
		places = append(places, inDir(dir, d))
	}
	var own []string
	for _, d := range places {
		if d != "/" {
			own = append(own, d)
		}
	}
	for _, t := range targets {
		if slices.Contains(pinnedMountExceptions, t) {
			continue
		}
		for _, d := range own {
			if !mounter.PathWithin(t, d) && !mounter.PathWithin(d, t) {
				continue
			}
			// The socket directory is the driver's mount, but not the
			// driver's files: it keeps what any task that served the
			// plugin id wrote in it, one that is not privileged too.
			if pc := tc.CSIPlugin; pc != nil && t == filepath.Clean(pc.MountDir) {
				return fmt.Errorf("the task runs under %s, and its csi_plugin mount_dir %q would put the plugin's socket directory in place of the image's program %q or the files it loads beside it (%s): that directory keeps what every task that served plugin %q wrote in it; set mount_dir to a path outside %q", g, t, prog[0], d, pc.ID, d)
			}
			return fmt.Errorf("the task runs under %s, and a mount at %q would put the job's files in place of the image's program %q or the files it loads beside it (%s); choose another destination", g, t, prog[0], d)
		}
	}
	return nil
}

// checkImageProgramName is checkImageProgram's check of the program's
// name: the image's entrypoint, or a cmd-only image's cmd's program.
func checkImageProgramName(tc *TaskConfig, img taskImage, g *PrivilegedGrant) error {
	const why = "it would run another program of the image than its own"
	hint := fmt.Sprintf("%s pins the image, whose own program runs: drop it and pass the program's arguments in args", g)
	if len(tc.Entrypoint) > 0 && !slices.Equal(tc.Entrypoint, img.Entrypoint) {
		if len(img.Entrypoint) == 0 {
			return fmt.Errorf("entrypoint %q is not allowed in this task: %s (the image has no entrypoint); %s", tc.Entrypoint, why, hint)
		}
		return fmt.Errorf("entrypoint %q is not allowed in this task: %s %q; %s", tc.Entrypoint, why, img.Entrypoint, hint)
	}
	if len(img.Entrypoint) > 0 {
		// command and args are the entrypoint's arguments.
		return nil
	}
	if len(img.Cmd) == 0 {
		return fmt.Errorf("the image names no program of its own (no entrypoint or cmd), so the job's command would be any program of it, run as root: %s; grant an image that names its program", g)
	}
	switch own := img.Cmd[0]; {
	case tc.Command != "" && tc.Command != own:
		return fmt.Errorf("command %q is not allowed in this task: %s %q; %s", tc.Command, why, own, hint)
	case tc.Command == "" && len(tc.Args) > 0 && tc.Args[0] != own:
		return fmt.Errorf("args' first element %q is not allowed in this task: %s %q (the image has only a cmd, which args replace); %s", tc.Args[0], why, own, hint)
	}
	return nil
}

// checkPinned keeps a task whose grant g pins its program (command, the
// resolved file of a command grant; "" for an image) from making that
// program run the job's code as root: through the loader's and
// interpreters' variables, the PATH it runs other programs from, the
// interpreters and libraries it loads, or a mount over any of those.
func checkPinned(conf *Config, cfg *drivers.TaskConfig, tc *TaskConfig, spec *executor.Spec, g *PrivilegedGrant, command string, targets []string) error {
	if v := pinnedEnvVar(spec.Env); v != "" {
		return fmt.Errorf("env %s is not allowed in this task: it would make the program that %s pins load code the job names, as root; drop it from the job", envName(v), g)
	}
	forbidden := tasksWriteDirs(conf, cfg)
	var dirs []string
	if command != "" {
		load, err := pinnedLoadDirs(command, targets, forbidden)
		if err != nil {
			return fmt.Errorf("the task runs under %s, and %w", g, err)
		}
		dirs = append(dirs, load...)
	}
	for _, d := range pinnedPath(spec.Env) {
		if err := checkPinnedDir(d, targets, forbidden, command != ""); err != nil {
			return fmt.Errorf("the task runs under %s, and its env PATH entry %w: the granted program would run what it finds there by name (mount, mkfs.ext4, ...) as root; drop PATH from the task's env (the driver's default is %s) or name only host directories that only root can write", g, err, defaultTaskPath)
		}
		dirs = append(dirs, filepath.Clean(d))
	}
	for _, t := range jobMountTargets(conf, spec, tc) {
		if reason := pinnedMountReason(t, dirs); reason != "" {
			return fmt.Errorf("the task runs under %s, and %s; choose another destination", g, reason)
		}
	}
	// A command grant's program sees the host's files, which the job's
	// mounts would stand in for. (An image's task sees its image, whose
	// system directories pinnedMountReason keeps: its other paths, a
	// plugin's state directory among them, take the job's mounts.)
	if command == "" {
		return nil
	}
	for _, t := range jobOwnMountTargets(cfg, tc) {
		if !mounter.WithinAny(t, pinnedTaskDirs) && !slices.Contains(pinnedMountExceptions, t) {
			return fmt.Errorf("the task runs under %s, and its mount at %q is outside %s: elsewhere the job's files would stand in for host files that the granted program reads as root on its own (its home's configuration and credentials, the device links it resolves, the sockets it talks to), and in /alloc the group's other tasks could turn the target into a symlink while it is mounted; mount it inside /local and pass its path in args", g, t, strings.Join(pinnedTaskDirs, " or "))
		}
	}
	return nil
}

// pinnedTaskDirs are where the job's own mounts go in a task whose grant
// pins its program: the task's own directories, which the program reads
// where its arguments say. Not /alloc: the group's other tasks (the job's,
// not privileged) write there while the task's mounts are made, and a
// target they turn into a symlink between its check and its bind would
// put the job's volume where the symlink points, in the host's view the
// program has.
var pinnedTaskDirs = []string{"/local", "/secrets"}

// jobOwnMountTargets are the targets of the mounts whose content the
// job chooses: its volume blocks' and volume_mounts' destinations (host
// volumes, Nomad's CSI volumes). Not the driver's (Nomad's task
// directories, the csi_plugin socket directory and stage root), not
// those of Nomad's plugin supervisor (the plugin's socket and staging
// directories and the host's /dev), not the devices Nomad's device
// plugins hand over.
func jobOwnMountTargets(cfg *drivers.TaskConfig, tc *TaskConfig) []string {
	var own []string
	if p, err := nomadPlugin(cfg); err == nil && p != nil {
		own = []string{p.socket, p.staging}
	}
	var out []string
	for _, m := range cfg.Mounts {
		if m == nil {
			continue
		}
		host, target := filepath.Clean(m.HostPath), filepath.Clean(m.TaskPath)
		if slices.Contains(own, host) || host == "/dev" && target == "/dev" {
			continue
		}
		out = append(out, target)
	}
	for _, v := range tc.Volumes {
		if v.Destination != "" {
			out = append(out, filepath.Clean(v.Destination))
		}
	}
	sort.Strings(out)
	return out
}

// checkPrivilegedUser refuses a privileged task that names a user other
// than root: it would run outside every isolation layer (the host's view,
// PID namespace and devices) as a uid an ordinary task has too, and reach
// other allocations' processes as their peer.
func checkPrivilegedUser(name string) error {
	cred, err := taskuser.Resolve(name)
	if err != nil {
		return fmt.Errorf("user %q: %w", name, err)
	}
	if cred.UID != 0 {
		userName, _, _ := strings.Cut(name, ":")
		return fmt.Errorf("user %q: a privileged task runs as root only: it has the host's view, processes and devices, and as another user it would reach other allocations' processes that run as that user; drop user, or drop privileged = true to run isolated as %q", name, userName)
	}
	return nil
}

// tasksWriteDirs are the host directories whose files tasks write, none of
// which a pinned program may run or load code from: the driver's root_dir
// (its tasks' volumes), Nomad's allocations, and, when those are at
// <data_dir>/alloc (Nomad's layout unless alloc_dir moves them), Nomad's
// whole data directory: its client state holds the staging and per-alloc
// directories of Nomad's CSI volumes, and host_volumes the dynamic host
// volumes, all of which tasks write.
func tasksWriteDirs(conf *Config, cfg *drivers.TaskConfig) []string {
	allocs := allocationsDir(cfg)
	out := []string{conf.RootDir, allocs}
	if allocs != "" && filepath.Base(allocs) == "alloc" {
		out = append(out, filepath.Dir(allocs))
	}
	return out
}

// allocationsDir is the directory of the node's allocations (Nomad's
// <data_dir>/alloc), "" when Nomad gave no allocation directory.
func allocationsDir(cfg *drivers.TaskConfig) string {
	if cfg.AllocDir == "" {
		return ""
	}
	return filepath.Dir(filepath.Clean(cfg.AllocDir))
}

// mountTargets are the paths in the task that its mounts cover: Nomad's
// and the driver's mounts, and its volumes' destinations.
func mountTargets(spec *executor.Spec, tc *TaskConfig) []string {
	var out []string
	for _, m := range append(append([]executor.Mount(nil), spec.Mounts...), spec.LateMounts...) {
		out = append(out, filepath.Clean(m.Target))
	}
	for _, v := range tc.Volumes {
		if v.Destination != "" {
			out = append(out, filepath.Clean(v.Destination))
		}
	}
	return out
}

// jobMountTargets are the mount targets of a task that its job chooses:
// mountTargets but the stage root, which the operator's root_dir places.
func jobMountTargets(conf *Config, spec *executor.Spec, tc *TaskConfig) []string {
	var out []string
	for _, t := range mountTargets(spec, tc) {
		if t != conf.stageRoot() {
			out = append(out, t)
		}
	}
	return out
}

// nomadPluginTask reports whether the task is a plugin task of Nomad's own
// task-level csi_plugin block. Nomad's client prepares such a task (its
// csi_plugin_supervisor hook) with, among others, two bidirectional mounts
// from its state directory: the plugin's socket directory,
// <state_dir>/csi/plugins/<alloc id>, and its staging directory,
// <state_dir>/csi/<type>/<plugin id>.
//
// Neither can be faked by a job: it can set env vars and ask for
// bidirectional propagation on host volumes, but a host volume's path is
// the operator's (or, for a dynamic host volume, named by the volume's
// id), and no job knows its allocation's id before it is placed. The
// state directory is not known to the driver (Nomad does not tell it), so
// it is taken from the socket mount, and the staging mount must be under
// the same one.
func nomadPluginTask(cfg *drivers.TaskConfig) bool {
	_, ok := nomadPluginID(cfg)
	return ok
}

// nomadPluginID is the plugin id of a plugin task of Nomad's own
// csi_plugin block (see nomadPluginTask), read from its staging mount;
// none when the task's mounts name more than one (nomadPlugin).
func nomadPluginID(cfg *drivers.TaskConfig) (string, bool) {
	p, err := nomadPlugin(cfg)
	if err != nil || p == nil {
		return "", false
	}
	return p.id, true
}

// nomadPluginInfo is what the mounts of Nomad's plugin supervisor say of a
// plugin task of Nomad's csi_plugin block: the plugin's id, and the host
// paths of the two mounts the supervisor made (the socket and staging
// directories, both in Nomad's state directory).
type nomadPluginInfo struct {
	id              string
	socket, staging string
}

// nomadPlugin reads a task's mounts for those of Nomad's plugin
// supervisor (see nomadPluginTask): nil when there are none. A job can
// add mounts of its own, and with ACLs off it can register a dynamic host
// volume at any host path, one in Nomad's state directory included, and
// mount it bidirectionally: then two staging directories of different
// plugin ids stand side by side, and the one the job chose could pass for
// the task's plugin while Nomad registers the other. That is an error:
// which id the task serves cannot be told.
func nomadPlugin(cfg *drivers.TaskConfig) (*nomadPluginInfo, error) {
	if cfg.AllocID == "" || strings.ContainsRune(cfg.AllocID, '/') {
		return nil, nil
	}
	suffix := "/" + filepath.Join("csi", "plugins", cfg.AllocID)
	bidirectional := func(m *drivers.MountConfig) bool {
		return m != nil && m.PropagationMode == executor.PropagationBidirectional
	}
	var found []nomadPluginInfo
	for _, sock := range cfg.Mounts {
		if !bidirectional(sock) {
			continue
		}
		socket := filepath.Clean(sock.HostPath)
		state, ok := strings.CutSuffix(socket, suffix)
		if !ok || state == "" || !filepath.IsAbs(state) {
			continue
		}
		for _, m := range cfg.Mounts {
			if !bidirectional(m) {
				continue
			}
			staging := filepath.Clean(m.HostPath)
			rel, err := filepath.Rel(filepath.Join(state, "csi"), staging)
			if err != nil {
				continue
			}
			typ, id, ok := strings.Cut(rel, "/")
			if !ok || id == "" || strings.ContainsRune(id, '/') || id == ".." {
				continue
			}
			switch typ {
			case PluginTypeNode, PluginTypeController, PluginTypeMonolith:
				found = append(found, nomadPluginInfo{id: id, socket: socket, staging: staging})
			}
		}
	}
	if len(found) == 0 {
		return nil, nil
	}
	var ids []string
	for _, f := range found {
		if !slices.Contains(ids, f.id) {
			ids = append(ids, f.id)
		}
	}
	if len(ids) > 1 {
		return nil, fmt.Errorf("the task has mounts of Nomad's csi_plugin staging directories of more than one plugin (%s): which one it serves cannot be told, as a volume mounted bidirectionally from Nomad's state directory can pass for Nomad's own; mount no volume from %s", strings.Join(quoteAll(ids), ", "), filepath.Dir(filepath.Dir(found[0].socket)))
	}
	return &found[0], nil
}

// quoteAll quotes each of ss with %q.
func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = strconv.Quote(s)
	}
	return out
}

// reservedFromJob says why job may not serve plugin id on this node ("" when
// it may): grants reserve the id, and none of them names job's namespace
// and job. A task taken back after a restart of the driver is checked so
// (its command is not known then): one started before the operator
// reserved the id, or before the driver had grants at all, does not keep
// the id from the job the operator named.
func reservedFromJob(grants []PrivilegedGrant, id string, job jobRef) string {
	res := reserving(grants, id)
	if len(res) == 0 {
		return ""
	}
	names := make([]string, len(res))
	for i, r := range res {
		if grantGlob(r.grant.Namespace, job.namespace) && grantGlob(r.grant.Job, job.id) {
			return ""
		}
		names[i] = fmt.Sprintf("privileged_grant[%d] %s", r.index, r.grant.body())
	}
	return fmt.Sprintf("csi_plugin id %q is reserved on this node by the operator for the tasks of %s, which do not match %s", id, strings.Join(names, " and "), job)
}

// grantsJob reports whether a grant names job's namespace and job.
func grantsJob(grants []PrivilegedGrant, job jobRef) bool {
	return slices.ContainsFunc(grants, func(g PrivilegedGrant) bool {
		return grantGlob(g.Namespace, job.namespace) && grantGlob(g.Job, job.id)
	})
}

// jobRef names a Nomad job: the owner of a plugin id.
type jobRef struct{ namespace, id string }

// jobOf is the job of a task ("default" namespace when Nomad gave none).
func jobOf(cfg *drivers.TaskConfig) jobRef {
	ns := cfg.Namespace
	if ns == "" {
		ns = "default"
	}
	return jobRef{namespace: ns, id: cfg.JobID}
}

// childOf is the id of the job whose dispatched or periodic child the
// task's job is ("backup" for "backup/dispatch-1700000000-ab12cd34" and
// "backup/periodic-1700000000"), "" for any other job. Such a child's id
// is its own, new at every run, and grants match it, not the parent's.
// The parent comes from NOMAD_JOB_PARENT_ID, which Nomad's client sets:
// the plugin SDK's TaskConfig.ParentJobID does not cross the gRPC
// boundary. It only words a refusal: a job that sets the variable itself
// is told of a glob its own id already falls under.
func childOf(cfg *drivers.TaskConfig) string {
	parent := cfg.ParentJobID
	if parent == "" {
		parent = cfg.Env["NOMAD_JOB_PARENT_ID"]
	}
	if parent == "" {
		return ""
	}
	// Nomad's PeriodicLaunchSuffix and DispatchLaunchSuffix.
	for _, launch := range []string{"/periodic-", "/dispatch-"} {
		if strings.HasPrefix(cfg.JobID, parent+launch) {
			return parent
		}
	}
	return ""
}

// String is how the job is named in messages and recorded with volumes
// as the server of their plugin (csihook.PluginInfo.Server).
func (j jobRef) String() string { return fmt.Sprintf("job %q in namespace %q", j.id, j.namespace) }

// socketServer is how a plugin served by a socket in plugin_socket_dirs is
// named as a volume's server.
func socketServer(socket string) string {
	return fmt.Sprintf("socket %q in plugin_socket_dirs", socket)
}

// socketCheckTimeout bounds how long a plugin task's start waits for
// sockets in plugin_socket_dirs to say which plugin ids they serve.
const socketCheckTimeout = 5 * time.Second

// claimPlugin reserves a plugin id for a task that is starting. The id is
// refused when another live task serves it; when a socket in
// plugin_socket_dirs serves it (unless the task's job held it before
// that socket came, as a recovered task or volumes still recorded here as
// set up through the job show: a socket appearing later does not take
// over a task's id); and when volumes recorded on this node were set up through
// another server of the id (another job, or a socket), until they are
// released. It reports whether the task takes back an id its job held
// (fingerprint.PluginSpec.Reclaim). On error nothing is claimed.
func (d *Driver) claimPlugin(cfg *drivers.TaskConfig, pc *PluginTaskConfig) (bool, error) {
	job := jobOf(cfg)
	reclaim, err := d.plugins.claim(cfg, *pc, job)
	if err != nil {
		return false, err
	}
	fail := func(err error) (bool, error) {
		d.plugins.drop(cfg.ID, pc.ID)
		return false, err
	}
	m, err := d.volumes()
	if err != nil {
		return fail(fmt.Errorf("csi_plugin id %q: cannot check the volumes recorded for it: %w", pc.ID, err))
	}
	servers := m.PluginServers(pc.ID)
	for _, server := range servers {
		if server != job.String() {
			return fail(fmt.Errorf("csi_plugin id %q cannot be served by %s on this node: volumes of the plugin here were set up through %s and are not released yet, and their calls would go to this task; run the plugin in that job again, or stop the tasks using volumes of plugin %q and wait for their teardown",
				pc.ID, job, server, pc.ID))
		}
	}
	if !reclaim && len(servers) > 0 {
		// Volumes held here were set up through this job: it held the id
		// before any socket that serves it now, and their calls wait for
		// it (csihook's pluginClients). It takes the id back, as a task of
		// the job recovered after a restart does; a dangling instance of
		// it that no new driver process recovered is not needed for that.
		reclaim = true
	}
	if !reclaim {
		if p := d.currentProber(); p != nil {
			ctx, cancel := context.WithTimeout(d.ctx, socketCheckTimeout)
			sock, served := p.SocketServing(ctx, pc.ID)
			cancel()
			if served {
				return fail(fmt.Errorf("csi_plugin id %q is already served on this node by the socket %q in plugin_socket_dirs: a task cannot take over the operator's plugin; choose another id", pc.ID, sock))
			}
		}
	}
	return reclaim, nil
}

// pluginServer says who serves a plugin id the prober knows: the job of a
// plugin task, or a socket in plugin_socket_dirs.
func (d *Driver) pluginServer(st fingerprint.PluginStatus) string {
	if st.Source == fingerprint.SourceSocketDir {
		return socketServer(st.Socket)
	}
	if job, ok := d.plugins.job(st.ID, st.TaskID); ok {
		return job.String()
	}
	return ""
}
