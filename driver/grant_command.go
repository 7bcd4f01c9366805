package driver

import (
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
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

// pinnedEnvVars are environment variables that make a program load or
// run code the job names, or read a configuration that names some: the
// dynamic loader's, the C library's and OpenSSL's; the common shells' and
// interpreters' (exported bash functions, xtrace prompts, startup files,
// module paths and options); and the home and configuration directories
// and credential files whose formats name commands to run (git's hooks
// and ssh commands, the AWS SDK's credential_process, kubeconfig's exec
// plugins, Google's executable-sourced credentials, docker's credential
// helpers). A task whose grant pins its command or image must not set
// them, or the pinned program would run the job's code as root. An entry
// ending in '_' names every variable it begins. No list knows every
// program's variables: a grant pins programs that take no code from their
// environment.
var pinnedEnvVars = []string{
	"LD_", // LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, ... (every one of the loader's)
	"GCONV_PATH", "GLIBC_TUNABLES", "MALLOC_TRACE", "LOCPATH", "NLSPATH",
	"OPENSSL_CONF", "OPENSSL_ENGINES", "OPENSSL_MODULES", "KRB5_CONFIG", "SASL_PATH",
	"BASH_ENV", "ENV", "BASH_FUNC_", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "ZDOTDIR",
	"NODE_OPTIONS", "NODE_PATH",
	"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONWARNINGS", "PYTHONBREAKPOINT",
	"PYTHONINSPECT", "PYTHONPYCACHEPREFIX", "PYTHONPLATLIBDIR",
	"PERL5LIB", "PERL5OPT", "PERLLIB", "PERL5DB",
	"RUBYLIB", "RUBYOPT", "GEM_HOME", "GEM_PATH", "BUNDLE_GEMFILE",
	"LUA_", "TCLLIBPATH", "PHPRC", "PHP_INI_SCAN_DIR",
	"ERL_FLAGS", "ERL_AFLAGS", "ERL_ZFLAGS", "ERL_LIBS",
	"R_PROFILE", "R_PROFILE_USER", "R_ENVIRON", "R_ENVIRON_USER", "R_LIBS", "R_LIBS_USER",
	"JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "CLASSPATH",
	"DOTNET_STARTUP_HOOKS", "DOTNET_ADDITIONAL_DEPS", "CORECLR_",
	"HOME", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS", "GIT_", "SSH_ASKPASS",
	"AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "KUBECONFIG", "GOOGLE_APPLICATION_CREDENTIALS",
	"GOOGLE_EXTERNAL_ACCOUNT_ALLOW_EXECUTABLES", "DOCKER_CONFIG",
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

// envName is a variable's name as a message shows it: as it is when it is
// made of letters, digits and "_.%-" (BASH_FUNC_x%% included), quoted
// otherwise, so that a name from a job's template carries no terminal
// escapes into an event.
func envName(k string) string {
	for _, r := range k {
		if !(r >= 'A' && r <= 'Z' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || strings.ContainsRune("_.%-", r)) {
			return strconv.Quote(k)
		}
	}
	return k
}

// pinnedSystemDirs are where the loader and a program's libraries come
// from: a task whose grant pins its command or image cannot have a mount
// of the job's on, above or inside them.
var pinnedSystemDirs = []string{"/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr"}

// pinnedMountExceptions are files in pinnedSystemDirs that Nomad itself
// writes for a task (the group's dns block, its hosts file).
var pinnedMountExceptions = []string{"/etc/resolv.conf", "/etc/hosts"}

// pinnedMountReason says why a task whose grant pins its program cannot
// have a mount at target, or "": dirs are the directories beyond
// pinnedSystemDirs that the program loads or runs code from
// (pinnedLoadDirs, the entries of its PATH).
func pinnedMountReason(target string, dirs []string) string {
	t := filepath.Clean(target)
	if slices.Contains(pinnedMountExceptions, t) {
		return ""
	}
	for _, d := range append(slices.Clone(pinnedSystemDirs), dirs...) {
		if mounter.PathWithin(t, d) || mounter.PathWithin(d, t) {
			return fmt.Sprintf("a mount at %q would put the job's files into %s, from which the granted program loads or runs code", target, d)
		}
	}
	return ""
}

// pinnedPath is every directory of the PATH in env (all of its PATH
// variables, should there be more than one): a pinned program runs the
// programs it names by name from there (a CSI plugin's mount, mkfs.ext4,
// losetup, an interpreter's "#!/usr/bin/env x"), as root. An empty entry
// is kept: it stands for the working directory.
func pinnedPath(env []string) []string {
	var out []string
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			out = append(out, strings.Split(v, ":")...)
		}
	}
	return out
}

// checkPinnedDir checks a directory that a pinned program loads or runs
// code from: it must be absolute (a relative one, or "", is the task's
// working directory, which the job chooses), outside the task's mounts
// and, on the host (host: a command grant, whose program sees the host's
// files), outside the directories tasks write (forbidden) and one only
// root can change: its real path root's and writable by neither its
// group nor others (a sticky directory still lets anyone add a name), or,
// when it does not exist, its nearest existing parent likewise, as only
// that parent's writers can create it.
func checkPinnedDir(dir string, targets, forbidden []string, host bool) error {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("%q is relative: it names a directory of the task's working directory, which the job chooses", dir)
	}
	p := filepath.Clean(dir)
	if t := mountHolding(p, targets); t != "" {
		return fmt.Errorf("%q is inside the task's mount %q: the job's files, not the host's", dir, t)
	}
	if !host {
		return nil
	}
	if via, ok := throughProc(p); ok {
		return fmt.Errorf("%q goes through %q, in /proc, whose links (/proc/<pid>/root, /proc/self/fd) lead into other processes' views, which a job's task chooses", dir, via)
	}
	for {
		real, err := filepath.EvalSymlinks(p)
		switch {
		case err == nil:
			if t := mountHolding(real, targets); t != "" {
				return fmt.Errorf("%q resolves to %q, inside the task's mount %q: the job's files, not the host's", dir, real, t)
			}
			for _, f := range forbidden {
				if f != "" && mounter.PathWithin(real, f) {
					return fmt.Errorf("%q resolves to %q, inside %q, where tasks write", dir, real, f)
				}
			}
			if err := checkUnswappable(real); err != nil {
				if p != filepath.Clean(dir) {
					return fmt.Errorf("%q does not exist, and whoever can write %q can create it: %w", dir, real, err)
				}
				return fmt.Errorf("%q can be written by others than root: %w", dir, err)
			}
			return nil
		case errors.Is(err, fs.ErrNotExist), errors.Is(err, syscall.ENOTDIR):
			// Who can make it a directory is who can write its parent.
			p = filepath.Dir(p)
		default:
			return fmt.Errorf("%q: %w", dir, err)
		}
	}
}

// throughProc reports the first leading part of p (a clean absolute path)
// that is in /proc once its symlinks are resolved ("/dev/fd" is
// "/proc/self/fd"): from there on the path is not the host's, as
// /proc/<pid>/root leads into the root of any process, a task's too, and a
// look-up of p's real path (filepath.EvalSymlinks reads /proc's links as
// text, "/") says nothing of what a program finds there.
func throughProc(p string) (string, bool) {
	prefix := "/"
	for _, el := range strings.Split(strings.TrimPrefix(p, "/"), "/") {
		if el == "" {
			continue
		}
		prefix = filepath.Join(prefix, el)
		real, err := filepath.EvalSymlinks(prefix)
		if err != nil {
			return "", false
		}
		if mounter.PathWithin(real, "/proc") {
			return prefix, true
		}
	}
	return "", false
}

// maxInterpreters bounds the chain of "#!" interpreters followed, as the
// kernel bounds it.
const maxInterpreters = 4

// pinnedLoadDirs are the directories, beyond pinnedSystemDirs, from which
// the program at real (a command grant's resolved file) loads code before
// it runs: its own directory; for a script, the interpreter its "#!" line
// names (which must itself be a file only root can replace, outside the
// task's mounts, and is followed in turn); for an ELF program, its loader's
// directory and its RPATH and RUNPATH directories ($ORIGIN expanded; from
// another "$" on, the directory before it). Each passes checkPinnedDir.
func pinnedLoadDirs(real string, targets, forbidden []string) ([]string, error) {
	var dirs []string
	add := func(what, d string) error {
		if err := checkPinnedDir(d, targets, forbidden, true); err != nil {
			return fmt.Errorf("%s %w", what, err)
		}
		dirs = append(dirs, filepath.Clean(d))
		return nil
	}
	file := real
	for i := 0; ; i++ {
		if err := add(fmt.Sprintf("the directory of %q,", file), filepath.Dir(file)); err != nil {
			return nil, err
		}
		interp, err := scriptInterpreter(file)
		if err != nil {
			return nil, err
		}
		if interp == "" {
			break
		}
		if i == maxInterpreters {
			return nil, fmt.Errorf("%q: more than %d \"#!\" interpreters in a row", real, maxInterpreters)
		}
		if !filepath.IsAbs(interp) {
			return nil, fmt.Errorf("the interpreter %q that %q names on its \"#!\" line is relative: the kernel finds it from the task's working directory, which the job chooses", interp, file)
		}
		next, err := resolveGrantCommand(interp, "/", nil, targets, forbidden)
		if err != nil {
			return nil, fmt.Errorf("the interpreter that %q names on its \"#!\" line: %w", file, err)
		}
		file = next
	}
	elfDirs, err := elfLoadDirs(file)
	if err != nil {
		return nil, err
	}
	for _, d := range elfDirs {
		if err := add(fmt.Sprintf("%q loads libraries from", file), d); err != nil {
			return nil, err
		}
	}
	return dirs, nil
}

// scriptInterpreter is the interpreter a "#!" line names, "" for a file
// without one.
func scriptInterpreter(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	// The kernel reads at most this much of the line.
	buf := make([]byte, 256)
	n, err := io.ReadFull(f, buf)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("failed to read %q: %w", path, err)
	}
	line, ok := strings.CutPrefix(string(buf[:n]), "#!")
	if !ok {
		return "", nil
	}
	line, _, _ = strings.Cut(line, "\n")
	fields := strings.Fields(line)
	if len(fields) == 0 {
		return "", nil
	}
	return fields[0], nil
}

// elfLoadDirs are the directories an ELF program's loader finds code in
// by the program's own word: its PT_INTERP loader's directory and its
// DT_RPATH and DT_RUNPATH entries, with $ORIGIN the program's directory.
// A file that is not ELF has none.
func elfLoadDirs(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		var format *elf.FormatError
		if errors.As(err, &format) {
			return nil, nil
		}
		return nil, fmt.Errorf("failed to read %q: %w", path, err)
	}
	defer f.Close()
	var out []string
	for _, p := range f.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		b, err := io.ReadAll(p.Open())
		if err != nil {
			return nil, fmt.Errorf("failed to read the loader %q names: %w", path, err)
		}
		out = append(out, filepath.Dir(strings.TrimRight(string(b), "\x00")))
	}
	for _, tag := range []elf.DynTag{elf.DT_RPATH, elf.DT_RUNPATH} {
		vals, err := f.DynString(tag)
		if err != nil {
			// A static program has no dynamic section.
			continue
		}
		for _, v := range vals {
			for _, d := range strings.Split(v, ":") {
				out = append(out, expandOrigin(d, filepath.Dir(path)))
			}
		}
	}
	return out, nil
}

// expandOrigin expands $ORIGIN (and ${ORIGIN}) in an RPATH entry to
// origin. What another "$" token would make of the rest is not guessed:
// the entry becomes the directory before it, which holds all it could be.
func expandOrigin(entry, origin string) string {
	e := strings.ReplaceAll(strings.ReplaceAll(entry, "${ORIGIN}", origin), "$ORIGIN", origin)
	if i := strings.IndexByte(e, '$'); i >= 0 {
		e = filepath.Dir(e[:i] + "x")
	}
	return e
}
