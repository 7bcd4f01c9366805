// Package cli is the operator's command line of nomad-driver-csi, run from
// the driver's own binary on a client node: volumes, probe, stats, expand,
// cleanup and images. Every command is safe while the driver runs: it
// reads the journal without its lock and writes nothing, only cleanup
// -apply acts, and only when no driver holds the journal, and images rm
// and images pull take the image store's locks as the driver does.
package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"unicode/utf16"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/safetext"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
)

// Usage is printed for no command, help and bad input.
const Usage = `Usage: nomad-driver-csi <command> [flags] [arguments]

nomad-driver-csi is a Nomad task driver plugin: Nomad starts it from its
plugin_dir. Run by an operator on a client node, it inspects what the
driver keeps there. Each command is safe while the driver runs.

Commands:
  volumes                         volumes, their tasks, states and mounts, from the journal
  probe <plugin id | socket path> ask a CSI plugin who it is, what it can do and if it is ready
  stats <volume>                  NodeGetVolumeStats of a published volume
  expand <volume> <size>          grow a published volume (ControllerExpandVolume, then
                                  NodeExpandVolume online), such as expand pg-data 20GiB
  cleanup [-apply]                mounts and journal records no task owns; unmounts orphan
                                  mounts only with -apply, and only while the driver is stopped
  images                          the image store: reference, digest, size, last used, in use by
  images rm <reference | digest>  remove an image no task uses, and its layers no other image has
  images pull <reference>         pull an image into the store as the driver would (its registry
                                  CA, insecure registries, local image dirs and auth from the
                                  driver's options; -username with -password-stdin for a user),
                                  a tag asked of its registry again, as docker pull does

A <volume> is the volume_id a job wrote (the name it created the volume
under), the plugin's volume ID, or the name of a task's volume block.
stats and expand take -plugin ID and -namespace NS to choose among volumes
of one name, and -socket PATH for a plugin that is not a task of this
driver.

Flags of every command:
  -root-dir DIR   the driver's root_dir (default ` + driver.DefaultRootDir + `)
  -json           print JSON instead of text
`

// usageError is a mistake in the command line; Main prints the usage
// after it.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{msg: fmt.Sprintf(format, args...)} }

// env is what a command runs with.
type env struct {
	rootDir string
	json    bool
	out     io.Writer
}

// command is one subcommand: extra flags, the names of its arguments, and
// run with the arguments.
type command struct {
	flags func(fs *flag.FlagSet)
	args  []string
	run   func(e *env, args []string) error
}

// Main runs the command line args (without the program name) and returns
// the exit code: 0 done, 1 failed, 2 bad command line.
func Main(args []string, stdout, stderr io.Writer) int {
	return MainWithInput(args, os.Stdin, stdout, stderr)
}

// MainWithInput is Main reading stdin from in (images pull -password-stdin).
func MainWithInput(args []string, in io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "-help" || args[0] == "--help" {
		fmt.Fprint(stdout, Usage)
		return 0
	}
	err := run(args, in, stdout)
	if err == nil {
		return 0
	}
	// Errors quote what they name, but a wrapped error may carry a
	// plugin's own words.
	fmt.Fprintln(stderr, "error:", Printable(err.Error()))
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprint(stderr, "\n"+Usage)
		return 2
	}
	return 1
}

func run(args []string, stdin io.Reader, stdout io.Writer) error {
	name := args[0]
	// images has subcommands: "images rm" and "images pull" are commands
	// of their own.
	if name == "images" && len(args) > 1 && (args[1] == "rm" || args[1] == "pull") {
		name, args = "images "+args[1], args[1:]
	}
	var (
		apply  bool
		socket string
		filter volumeFilter
		pull   imagePullFlags
	)
	// The flags of the commands that take a <volume>.
	volumeFlags := func(fs *flag.FlagSet) {
		fs.StringVar(&socket, "socket", "", "the plugin's socket, when it is not a plugin task of this driver")
		fs.StringVar(&filter.plugin, "plugin", "", "only a volume of this plugin id")
		fs.StringVar(&filter.namespace, "namespace", "", "only a volume of this Nomad namespace")
	}
	commands := map[string]command{
		"volumes": {run: runVolumes},
		"probe":   {run: runProbe, args: []string{"<plugin id | socket path>"}},
		"stats": {
			args:  []string{"<volume>"},
			flags: volumeFlags,
			run:   func(e *env, args []string) error { return runStats(e, args, socket, filter) },
		},
		"expand": {
			args:  []string{"<volume>", "<size>"},
			flags: volumeFlags,
			run:   func(e *env, args []string) error { return runExpand(e, args, socket, filter) },
		},
		"cleanup": {
			flags: func(fs *flag.FlagSet) {
				fs.BoolVar(&apply, "apply", false, "unmount the orphan mounts (default: only show them)")
			},
			run: func(e *env, args []string) error { return runCleanup(e, args, apply) },
		},
		"images":    {run: runImages},
		"images rm": {run: runImagesRm, args: []string{"<reference | digest>"}},
		"images pull": {
			args:  []string{"<reference>"},
			flags: pull.register,
			run:   func(e *env, args []string) error { return runImagesPull(e, args, &pull, stdin) },
		},
	}
	cmd, ok := commands[name]
	if !ok {
		return usagef("unknown command %q: use volumes, probe, stats, expand, cleanup or images", name)
	}
	e := &env{out: stdout}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&e.rootDir, "root-dir", driver.DefaultRootDir, "the driver's root_dir")
	fs.BoolVar(&e.json, "json", false, "print JSON")
	if cmd.flags != nil {
		cmd.flags(fs)
	}
	// Flags may come before and after the arguments.
	var pos []string
	rest := args[1:]
	for {
		if err := fs.Parse(rest); err != nil {
			return usagef("%s: %s", name, err.Error())
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		rest = fs.Args()[1:]
	}
	if err := wantArgs(name, pos, cmd.args...); err != nil {
		return err
	}
	if err := checkRootDir(e.rootDir); err != nil {
		return err
	}
	return cmd.run(e, pos)
}

// checkRootDir says what is wrong with a -root-dir before anything reads it.
func checkRootDir(dir string) error {
	if !strings.HasPrefix(dir, "/") {
		return usagef("-root-dir must be an absolute path, got %q", dir)
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("-root-dir %q is not usable (%w): give the root_dir of the driver's plugin config", dir, errors.Unwrap(err))
	}
	if !fi.IsDir() {
		return fmt.Errorf("-root-dir %q is not a directory; give the root_dir of the driver's plugin config", dir)
	}
	return nil
}

// wantArgs checks the number of positional arguments of a command.
func wantArgs(cmd string, args []string, names ...string) error {
	if len(args) < len(names) {
		return usagef("%s needs %s", cmd, strings.Join(names, " "))
	}
	if len(args) > len(names) {
		return usagef("%s takes %d argument(s), got unexpected %q", cmd, len(names), args[len(names)])
	}
	return nil
}

// Printable returns s with every character that is not printable (control
// characters, terminal escapes, bidirectional overrides) written as a Go
// escape, so a string a task or plugin chose cannot drive the terminal it
// is printed on: the one cleaner, csihook/safetext.
func Printable(s string) string { return safetext.Clean(s) }

// writeJSON prints v indented. encoding/json escapes C0 controls but
// passes C1 controls (U+009B is an 8-bit CSI to some terminals), bidi
// overrides and other invisible runes through: every rune the one cleaner
// would escape (safetext.IsPrint), but the newlines of the indentation, is
// escaped too, in JSON's syntax, as \uXXXX
// (a surrogate pair beyond the BMP). Outside strings JSON holds only
// graphic ASCII, so only strings change, and stay the same strings.
func (e *env) writeJSON(v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return err
	}
	var b strings.Builder
	for _, r := range buf.String() {
		switch {
		case r == '\n' || safetext.IsPrint(r):
			b.WriteRune(r)
		case r < 0x10000:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			r1, r2 := utf16.EncodeRune(r)
			fmt.Fprintf(&b, `\u%04x\u%04x`, r1, r2)
		}
	}
	_, err := io.WriteString(e.out, b.String())
	return err
}
