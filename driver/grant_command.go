package driver

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// resolveGrantCommand resolves a privileged task's command the way its
// start runs it, in the view the task has: the host's files, with the
// task's mounts at targets. command is found as the supervisor finds it
// (a path with a slash as it is, relative to the working directory dir;
// a name in the absolute directories of the environment's PATH), and its
// symlinks are resolved on the host. It returns the real path when that
// is a file no job can swap: a regular, executable file that root owns
// and that neither its group nor others can write, in directories
// likewise (a world-writable directory only with the sticky bit, in which
// no one but root can rename root's entry), outside every mount of the
// task and every directory of forbidden (the driver's root_dir, Nomad's
// allocations, which tasks write). Otherwise the error says why. The
// supervisor then runs exactly that path (executor.Spec.Path), so that
// nothing resolves it again.
func resolveGrantCommand(command, dir string, env, targets, forbidden []string) (string, error) {
	var candidates []string
	if strings.Contains(command, "/") {
		p := command
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		candidates = []string{filepath.Clean(p)}
	} else {
		path := defaultTaskPath
		for i := len(env) - 1; i >= 0; i-- {
			if v, ok := strings.CutPrefix(env[i], "PATH="); ok {
				path = v
				break
			}
		}
		for _, d := range filepath.SplitList(path) {
			// A relative PATH entry names a directory of the task's
			// working directory, which is the job's.
			if filepath.IsAbs(d) {
				candidates = append(candidates, filepath.Join(d, command))
			}
		}
	}
	for _, p := range candidates {
		if t := mountHolding(p, targets); t != "" {
			return "", fmt.Errorf("command %q is %q, inside the task's mount %q: a file of the job's, not the host's", command, p, t)
		}
		fi, err := os.Stat(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("command %q: %w", command, err)
		}
		if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
			// As the supervisor's search: it goes on past what it cannot
			// run.
			continue
		}
		real, err := filepath.EvalSymlinks(p)
		if err != nil {
			return "", fmt.Errorf("command %q: %w", command, err)
		}
		if t := mountHolding(real, targets); t != "" {
			return "", fmt.Errorf("command %q resolves to %q, inside the task's mount %q: a file of the job's, not the host's", command, real, t)
		}
		for _, f := range forbidden {
			if f != "" && mounter.PathWithin(real, f) {
				return "", fmt.Errorf("command %q resolves to %q, inside %q, where tasks write", command, real, f)
			}
		}
		if err := checkUnswappable(real); err != nil {
			return "", fmt.Errorf("command %q resolves to %q, which a job could swap: %w", command, real, err)
		}
		return real, nil
	}
	return "", fmt.Errorf("command %q is not an executable file on the host (PATH searched: its absolute directories)", command)
}

// mountHolding is the target of targets that holds p (p itself or a
// directory above it), or "".
func mountHolding(p string, targets []string) string {
	for _, t := range targets {
		if mounter.PathWithin(p, t) {
			return t
		}
	}
	return ""
}

// checkUnswappable checks that only root can replace real (a path with no
// symlinks) or anything on the way to it.
func checkUnswappable(real string) error {
	dirs := []string{"/"}
	for p := real; p != "/"; p = filepath.Dir(p) {
		dirs = append(dirs, p)
	}
	slices.Reverse(dirs[1:])
	for i, p := range dirs {
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("cannot read the owner of %q", p)
		}
		if st.Uid != 0 {
			return fmt.Errorf("%q is owned by uid %d, not root", p, st.Uid)
		}
		last := i == len(dirs)-1
		mode := fi.Mode()
		if mode&0o022 == 0 {
			continue
		}
		// A sticky directory's root-owned entries stay root's: only the
		// entry's or the directory's owner may rename or remove them.
		if !last && mode.IsDir() && mode&os.ModeSticky != 0 {
			continue
		}
		return fmt.Errorf("%q is writable by its group or by others (mode %04o)", p, mode.Perm())
	}
	return nil
}

// pinnedEnvVars are environment variables that make a program load code
// the job names: the dynamic loader's and the common interpreters'. A task
// whose grant pins its command or image must not set them, or the pinned
// program would run the job's code as root.
var pinnedEnvVars = []string{
	"LD_", // LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, ... (every one of the loader's)
	"GCONV_PATH", "GLIBC_TUNABLES", "MALLOC_TRACE", "LOCPATH", "NLSPATH",
	"NODE_OPTIONS", "NODE_PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE",
	"PERL5LIB", "PERL5OPT", "PERLLIB", "RUBYLIB", "RUBYOPT", "BASH_ENV", "ENV",
	"JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "CLASSPATH",
}

// pinnedEnvVar is the first variable of env in pinnedEnvVars, or "".
func pinnedEnvVar(env []string) string {
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		for _, v := range pinnedEnvVars {
			if k == v || strings.HasSuffix(v, "_") && strings.HasPrefix(k, v) {
				return k
			}
		}
	}
	return ""
}

// pinnedSystemDirs are where the loader and a program's libraries come
// from: a task whose grant pins its command or image cannot have a mount
// of the job's on, above or inside them.
var pinnedSystemDirs = []string{"/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr"}

// pinnedMountExceptions are files in pinnedSystemDirs that Nomad itself
// writes for a task (the group's dns block, its hosts file).
var pinnedMountExceptions = []string{"/etc/resolv.conf", "/etc/hosts"}

// pinnedMountReason says why a task whose grant pins command (the
// resolved path, "" for an image) cannot have a mount at target, or "".
func pinnedMountReason(target, command string) string {
	t := filepath.Clean(target)
	if slices.Contains(pinnedMountExceptions, t) {
		return ""
	}
	dirs := pinnedSystemDirs
	if command != "" {
		dirs = append(append([]string(nil), dirs...), filepath.Dir(command))
	}
	for _, d := range dirs {
		if mounter.PathWithin(t, d) || mounter.PathWithin(d, t) {
			return fmt.Sprintf("a mount at %q would put the job's files into %s, from which the granted program loads its code", target, d)
		}
	}
	return ""
}
