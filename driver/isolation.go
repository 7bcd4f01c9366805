package driver

import (
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// capAll in allow_caps, cap_add or cap_drop stands for every capability.
const capAll = "ALL"

// parseCapSet checks a list of capability names under key and returns them
// normalised ("NET_ADMIN"), "ALL" standing for every one.
func parseCapSet(key string, names []string) ([]string, error) {
	out := make([]string, 0, len(names))
	for _, name := range names {
		n := strings.TrimPrefix(strings.ToUpper(strings.TrimSpace(name)), "CAP_")
		if n != capAll {
			if _, err := executor.ParseCapabilities([]string{n}); err != nil {
				return nil, fmt.Errorf("%s: unknown capability %q: use names such as \"net_bind_service\" or \"all\"", key, name)
			}
		}
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out, nil
}

// allCapabilities lists every capability the executor knows, normalised.
func allCapabilities() []string {
	all := executor.KnownCapabilities()
	sort.Strings(all)
	return all
}

// taskCapabilities computes what a task that is not privileged may hold, as
// Nomad's exec driver does: the default set as far as allow_caps allows
// it, less cap_drop, plus cap_add, which must lie within allow_caps. It
// returns the set and the capabilities the task added itself (a task of
// another user than root holds those, and only those, after exec).
func taskCapabilities(allowCaps, capAdd, capDrop []string) (set, added []string, err error) {
	allow, err := parseCapSet("allow_caps", allowCaps)
	if err != nil {
		return nil, nil, err
	}
	adds, err := parseCapSet("cap_add", capAdd)
	if err != nil {
		return nil, nil, err
	}
	drops, err := parseCapSet("cap_drop", capDrop)
	if err != nil {
		return nil, nil, err
	}
	expand := func(list []string) []string {
		if slices.Contains(list, capAll) {
			return allCapabilities()
		}
		return list
	}
	allow, adds, drops = expand(allow), expand(adds), expand(drops)
	var missing []string
	for _, c := range adds {
		if !slices.Contains(allow, c) {
			missing = append(missing, strings.ToLower(c))
		}
	}
	if len(missing) > 0 {
		return nil, nil, fmt.Errorf("cap_add: %s not allowed on this node: the operator can add them to allow_caps in the driver's plugin config", strings.Join(missing, ", "))
	}
	defaults, _ := parseCapSet("", executor.DefaultCapabilities)
	for _, c := range defaults {
		if slices.Contains(allow, c) && !slices.Contains(drops, c) {
			set = append(set, c)
		}
	}
	for _, c := range adds {
		if !slices.Contains(set, c) {
			set = append(set, c)
		}
	}
	sort.Strings(set)
	sort.Strings(adds)
	return set, adds, nil
}

// idRange is an inclusive range of user or group ids.
type idRange struct{ lo, hi uint64 }

// parseIDRanges parses exec's "0,10-20" form of denied_host_uids and
// denied_host_gids.
func parseIDRanges(key, s string) ([]idRange, error) {
	var out []idRange
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.ParseUint(strings.TrimSpace(lo), 10, 32)
		if err != nil {
			return nil, fmt.Errorf("%s: %q is not an id or a range such as \"0-999\"", key, part)
		}
		b := a
		if isRange {
			if b, err = strconv.ParseUint(strings.TrimSpace(hi), 10, 32); err != nil {
				return nil, fmt.Errorf("%s: %q is not an id or a range such as \"0-999\"", key, part)
			}
		}
		if b < a {
			return nil, fmt.Errorf("%s: range %q has its lower bound above its upper one", key, part)
		}
		out = append(out, idRange{a, b})
	}
	return out, nil
}

func inRanges(ranges []idRange, id uint64) bool {
	for _, r := range ranges {
		if id >= r.lo && id <= r.hi {
			return true
		}
	}
	return false
}

// deniedIDs are denied_host_uids and denied_host_gids parsed.
func (c *Config) deniedIDs() (uids, gids []idRange, err error) {
	if uids, err = parseIDRanges("denied_host_uids", c.DeniedHostUIDs); err != nil {
		return nil, nil, err
	}
	if gids, err = parseIDRanges("denied_host_gids", c.DeniedHostGIDs); err != nil {
		return nil, nil, err
	}
	return uids, gids, nil
}

// checkHostIDs refuses a task user whose uid, or one of whose groups, the
// operator denied, as Nomad's exec driver does. name is a user name or
// uid, optionally with ":group".
func checkHostIDs(conf *Config, name string) error {
	uids, gids, err := conf.deniedIDs()
	if err != nil {
		return err
	}
	if len(uids) == 0 && len(gids) == 0 {
		return nil
	}
	userName, group, hasGroup := strings.Cut(name, ":")
	var u *user.User
	if _, err := strconv.ParseUint(userName, 10, 32); err == nil {
		u, err = user.LookupId(userName)
		if err != nil {
			u = &user.User{Uid: userName, Gid: userName}
		}
	} else if u, err = user.Lookup(userName); err != nil {
		return fmt.Errorf("user %q: %w", userName, err)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	if inRanges(uids, uid) {
		return fmt.Errorf("user %q: running as uid %d is denied on this node (denied_host_uids = %q)", name, uid, conf.DeniedHostUIDs)
	}
	groupIDs := []string{u.Gid}
	if more, err := u.GroupIds(); err == nil {
		groupIDs = append(groupIDs, more...)
	}
	if hasGroup {
		if _, err := strconv.ParseUint(group, 10, 32); err == nil {
			groupIDs = append(groupIDs, group)
		} else if g, err := user.LookupGroup(group); err == nil {
			groupIDs = append(groupIDs, g.Gid)
		} else {
			return fmt.Errorf("user %q: group %q: %w", name, group, err)
		}
	}
	for _, g := range groupIDs {
		gid, err := strconv.ParseUint(g, 10, 32)
		if err == nil && inRanges(gids, gid) {
			return fmt.Errorf("user %q: running with gid %d is denied on this node (denied_host_gids = %q)", name, gid, conf.DeniedHostGIDs)
		}
	}
	return nil
}

// checkUserGroup refuses user = "name:group" (or "uid:gid") when the user
// is not a member of the group in the host's group database (its primary
// group or a supplementary one; a uid without a passwd entry has the gid
// of the same number) and the operator did not list the group in
// allow_user_groups: a job could otherwise take any host group's files,
// such as "nobody:shadow" reading /etc/shadow through chroot_env's /etc.
func checkUserGroup(conf *Config, name string) error {
	userName, group, ok := strings.Cut(name, ":")
	if !ok {
		return nil
	}
	gid, err := taskuser.GroupID(group)
	if err != nil {
		return fmt.Errorf("user %q: %w", name, err)
	}
	for _, allowed := range conf.AllowUserGroups {
		if g, err := taskuser.GroupID(allowed); err == nil && g == gid {
			return nil
		}
	}
	own, err := taskuser.Resolve(userName)
	if err != nil {
		return fmt.Errorf("user %q: %w", name, err)
	}
	if own.GID == gid || slices.Contains(own.Groups, gid) {
		return nil
	}
	return fmt.Errorf("user %q: %q is not a member of group %q (gid %d) on this host, and a task may only take a group of its user's: use one of the user's groups, or the operator can list the group in allow_user_groups in the driver's plugin config", name, userName, group, gid)
}

// hostKernelFSTypes are the file systems through which a process reaches
// the kernel's view of the whole node rather than files: every process
// (proc, and in it /proc/sys and binfmt_misc), devices and control groups
// (sysfs, cgroup, cgroup2), namespaces (nsfs), and the kernel's debugging,
// tracing, security, BPF and firmware interfaces.
var hostKernelFSTypes = []string{"proc", "sysfs", "cgroup", "cgroup2", "nsfs", "binfmt_misc", "debugfs", "tracefs",
	"securityfs", "configfs", "bpf", "efivarfs", "pstore", "fusectl"}

// checkHostMountSources refuses, for a task that is not privileged, a
// mount whose host path holds one of the host's hostKernelFSTypes
// mounts (table, the host's mount table), or is inside one, or goes
// through /proc. Nomad hands the driver host volumes as the operator's,
// but with ACLs off any job registers a dynamic host volume at any
// existing host path: one of "/", bound with what is mounted below it,
// gave a nobody task the host's /proc, where it read another namespace's
// task's environment and wrote into its root (TestEscapeHostVolumeRegistered).
//
// Nor does it get a host path in others' directories (others, but where
// mine says a path is the task's own): the node's other allocations, with
// their tasks' /secrets, the driver's root_dir, and Nomad's client state,
// with the per-alloc directories of other allocations' CSI volumes.
func checkHostMountSources(mounts []executor.Mount, table []mounter.MountPoint, others []string, mine func(string) bool) error {
	for _, m := range mounts {
		src := filepath.Clean(m.Source)
		if via, ok := throughProc(src); ok {
			return fmt.Errorf("mount %q: its host path %q goes through %q, in the host's /proc, which leads into other processes' views; a task that is not privileged gets no host path there", m.Target, m.Source, via)
		}
		real, err := filepath.EvalSymlinks(src)
		if err != nil {
			// Not there (the executor says so) or not readable: judged
			// as written.
			real = src
		}
		var found []mounter.MountPoint
		for _, mp := range table {
			if slices.Contains(hostKernelFSTypes, mp.FSType) && (mounter.PathWithin(mp.Path, real) || mounter.PathWithin(real, mp.Path)) {
				found = append(found, mp)
			}
		}
		if len(found) > 0 {
			slices.SortFunc(found, func(a, b mounter.MountPoint) int { return strings.Compare(a.Path, b.Path) })
			return fmt.Errorf("mount %q: its host path %q is in or holds the host's %s file system at %q, which would give a task that is not privileged the node's processes, devices or control groups; mount a directory without it, or run the task privileged under the operator's grant", m.Target, m.Source, found[0].FSType, found[0].Path)
		}
		for _, o := range others {
			if o != "" && (mounter.PathWithin(real, o) || mounter.PathWithin(o, real)) && !mine(real) {
				return fmt.Errorf("mount %q: its host path %q is in or holds %q, the directories of other allocations or of the driver, with their tasks' secrets; a task that is not privileged gets no host path there", m.Target, m.Source, o)
			}
		}
	}
	return nil
}

// othersDirs are the host directories of other tasks than cfg's, and
// whether a path in them is cfg's own after all (checkHostMountSources):
// Nomad's allocations (the task's own allocation directory is its own),
// the driver's root_dir, and, when the allocations are at
// <data_dir>/alloc, Nomad's client state at <data_dir>/client, where
// only its CSI volumes' per-alloc directories of the task's allocation,
// csi/<type>/<plugin>/per-alloc/<alloc id>/..., are the task's.
func othersDirs(conf *Config, cfg *drivers.TaskConfig) ([]string, func(string) bool) {
	allocs := allocationsDir(cfg)
	others := []string{allocs, conf.RootDir}
	var state string
	if allocs != "" && filepath.Base(allocs) == "alloc" {
		state = filepath.Join(filepath.Dir(allocs), "client")
		others = append(others, state)
	}
	mine := func(p string) bool {
		if cfg.AllocDir != "" && mounter.PathWithin(p, filepath.Clean(cfg.AllocDir)) {
			return true
		}
		if state == "" || cfg.AllocID == "" {
			return false
		}
		rel, err := filepath.Rel(filepath.Join(state, "csi"), p)
		if err != nil {
			return false
		}
		parts := strings.Split(rel, "/")
		return len(parts) >= 4 && parts[2] == "per-alloc" && parts[3] == cfg.AllocID
	}
	return others, mine
}

// isolatedTargetReason says why a task that is not privileged cannot have
// a mount or a chroot_env entry at target, or "".
func isolatedTargetReason(target string) string { return executor.ReservedTarget(target) }

// allowCaps is the operator's allow_caps, or exec's default list when the
// configuration did not go through the schema (which has that default).
func (c *Config) allowCaps() []string {
	if c.AllowCaps == nil {
		return executor.DefaultCapabilities
	}
	return c.AllowCaps
}

// chrootEnv is the operator's chroot_env, or exec's default list.
func (c *Config) chrootEnv() map[string]string {
	if len(c.ChrootEnv) > 0 {
		return c.ChrootEnv
	}
	return executor.DefaultChrootEnv
}

// isolation is how a task that is not privileged is kept from the host.
func (c *Config) isolation(tc *TaskConfig) *executor.Isolation {
	mode := func(task, def string) bool {
		if task == "" {
			task = def
		}
		return task != IsolationModeHost
	}
	size, inodes, _ := c.tmpLimits()
	return &executor.Isolation{
		ChrootEnv:  c.chrootEnv(),
		PrivatePID: mode(tc.PIDMode, c.DefaultPIDMode),
		PrivateIPC: mode(tc.IPCMode, c.DefaultIPCMode),
		TmpSize:    size,
		TmpInodes:  inodes,
	}
}

// checkHostModes refuses a task that is not privileged and asks for
// pid_mode or ipc_mode "host" itself, unless the operator allowed it
// (allow_host_namespaces) or made it the node's default. In the host's PID
// namespace a root task sees, ptraces and reads (/proc/<pid>/root,
// environ, mem) every other task running as root with no more
// capabilities, of any allocation and Nomad namespace, and in the host's
// IPC namespace it attaches their System V shared memory: a job alone must
// not be able to step out of its allocation.
func (c *Config) checkHostModes(tc *TaskConfig) error {
	if c.AllowHostNamespaces {
		return nil
	}
	for _, m := range []struct{ key, task, def string }{
		{"pid_mode", tc.PIDMode, c.DefaultPIDMode},
		{"ipc_mode", tc.IPCMode, c.DefaultIPCMode},
	} {
		if m.task == IsolationModeHost && m.def != IsolationModeHost {
			return fmt.Errorf("%s = %q is not allowed on this node: it lets the task reach other allocations' processes; use %q, or the operator can set allow_host_namespaces = true in the driver's plugin config",
				m.key, IsolationModeHost, IsolationModePrivate)
		}
	}
	return nil
}

// defaultIsolation is what spare supervisors prepare for: a task that sets
// neither pid_mode nor ipc_mode.
func (c *Config) defaultIsolation() *executor.Isolation { return c.isolation(&TaskConfig{}) }

// nomadDirMounts binds the allocation's directories where Nomad's
// environment says they are for an image-based driver (/alloc, /local,
// /secrets) and, for an isolated task, the task's own tmp at /tmp (a
// privileged task sees the host's) unless tmpfsTmp says its /tmp is a
// tmpfs of bounded size (tmp_size).
func nomadDirMounts(cfg *drivers.TaskConfig, isolated, tmpfsTmp bool) []executor.Mount {
	if cfg.AllocDir == "" {
		return nil
	}
	td := cfg.TaskDir()
	dirs := [][2]string{
		{td.SharedAllocDir, "/alloc"},
		{td.LocalDir, "/local"},
		{td.SecretsDir, "/secrets"},
	}
	if isolated && !tmpfsTmp {
		dirs = append(dirs, [2]string{td.Dir + "/tmp", "/tmp"})
	}
	// Every source is taken without following a symlink below the
	// allocation's directory (Nomad's, root's): tasks write in it, and a
	// task of another driver in the allocation (exec, docker) can rename
	// alloc/logs away and put "logs -> /" in its place while no task of
	// this driver holds it as a mount point, to have the host's root
	// mounted at this task's /alloc/logs.
	beneath := filepath.Clean(cfg.AllocDir)
	out := make([]executor.Mount, 0, len(dirs)+1)
	for _, d := range dirs {
		out = append(out, executor.Mount{
			Source:      d[0],
			Target:      d[1],
			Propagation: executor.PropagationPrivate,
			NoSuid:      isolated,
			NoDev:       isolated,
			Beneath:     beneath,
		})
	}
	if isolated {
		// Nomad's logmon (root, on the host) opens the allocation's log
		// files by name in logs/, following symlinks, and writes the
		// task's output there: in a logs/ it could write, a task (even
		// as nobody: the directory is 0777) would plant
		// "t.stdout.1 -> /etc/cron.d/x" and have the next rotation create
		// that host file as root with whatever it printed. Read-only, and
		// a mount point the task cannot rename away; the task still reads
		// its logs, and its output still reaches them through the FIFOs
		// the supervisor opened on the host.
		out = append(out, executor.Mount{
			Source:      td.LogDir,
			Target:      "/alloc/logs",
			ReadOnly:    true,
			Propagation: executor.PropagationPrivate,
			NoSuid:      true,
			NoDev:       true,
			Beneath:     beneath,
		})
		// Nomad (root, on the host) writes the task's tokens into its
		// secrets directory before each run and at each renewal, with
		// os.WriteFile, os.Create and os.Chown, which follow symlinks
		// (nomadSecretsFiles lists them): a task that
		// replaced secrets/nomad_token with "-> /etc/shadow" in one run
		// had Nomad truncate and chown that host file on its restart.
		// Each token file is bound read-only over itself: a mount point
		// the task can neither remove nor replace, through which it still
		// reads what Nomad writes into the same file.
		for _, name := range nomadTokenFiles(td.SecretsDir) {
			out = append(out, executor.Mount{
				Source:      filepath.Join(td.SecretsDir, name),
				Target:      "/secrets/" + name,
				ReadOnly:    true,
				Propagation: executor.PropagationPrivate,
				NoSuid:      true,
				NoDev:       true,
				Beneath:     beneath,
			})
		}
	}
	return out
}

// nomadSecretsFiles are the files Nomad itself (re)writes in a task's
// secrets directory by name, as root and following symlinks, before a run
// or while it runs: the workload identity, Vault's and Consul's tokens,
// Consul's service identity token (sids hook), the Consul agent's TLS files
// copied for a Connect-native task before every run (connect native hook,
// os.Create), and a Connect sidecar's Envoy bootstrap files written before
// every run (envoy bootstrap hook). The alternate identities' nomad_<name>.jwt
// are matched by nomadSecretsFile.
var nomadSecretsFiles = map[string]bool{
	"nomad_token":          true,
	"vault_token":          true,
	"consul_token":         true,
	"si_token":             true,
	"consul_ca_file.pem":   true,
	"consul_cert_file.pem": true,
	"consul_key_file.pem":  true,
	"envoy_bootstrap.json": true,
	".envoy_bootstrap.env": true,
	".envoy_bootstrap.cmd": true,
}

// nomadSecretsFile reports whether Nomad writes the secrets directory's
// file name itself (nomadSecretsFiles, nomad_<identity>.jwt).
func nomadSecretsFile(name string) bool {
	return nomadSecretsFiles[name] || strings.HasPrefix(name, "nomad_") && strings.HasSuffix(name, ".jwt")
}

// nomadTokenFiles lists the files Nomad writes in a task's secrets
// directory (nomadSecretsFile) that are there now as regular files: a
// symlink, which only an older driver's task could have left, is never
// bound.
func nomadTokenFiles(secretsDir string) []string {
	entries, err := os.ReadDir(secretsDir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		n := e.Name()
		if nomadSecretsFile(n) && e.Type().IsRegular() {
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out
}
