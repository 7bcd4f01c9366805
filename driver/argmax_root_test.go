package driver

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// A task whose arguments or environment the kernel would refuse to exec is
// refused at start with an error that names the field and the limit (or
// the NUL byte), not
// the kernel's "argument list too long" from the driver's own seccomp stage;
// and it leaves no state directory and no supervisor behind.
func TestDriver_argsPastArgMaxNamed(t *testing.T) {
	requireRoot(t)
	for _, tc := range []struct {
		name string
		tc   TaskConfig
		env  map[string]string
		want string
	}{
		{"one long arg", TaskConfig{Command: "/bin/true", Args: []string{"ok", strings.Repeat("a", 200<<10)}}, nil, "args[1] is 204800 bytes"},
		{"many args", TaskConfig{Command: "/bin/true", Args: repeated(60000, 40)}, nil, "args and env take"},
		{"one long env", TaskConfig{Command: "/bin/true"}, map[string]string{"BIG": strings.Repeat("a", 200<<10)}, `env "BIG" is 204804 bytes`},
		{"long command", TaskConfig{Command: "/bin/" + strings.Repeat("a", 200<<10)}, nil, "command is 204805 bytes"},
		// A NUL ends a C string: execve would fail with EINVAL.
		{"NUL in an arg", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "exit 0\x00rm -rf /"}}, nil, "args[1] holds a NUL byte"},
		{"NUL in the command", TaskConfig{Command: "/bin/s\x00h"}, nil, "command holds a NUL byte"},
		{"NUL in an env value", TaskConfig{Command: "/bin/true"}, map[string]string{"TOKEN": "a\x00b"}, `env "TOKEN" holds a NUL byte`},
		// chdir(2) takes no path with a NUL either.
		{"NUL in work_dir", TaskConfig{Command: "/bin/true", WorkDir: "/tm\x00p"}, nil, "work_dir holds a NUL byte"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, _ := harnessDriver(t, Config{})
			cfg := realTask(t, "argmax", tc.tc)
			cfg.Env = tc.env
			cleanup := mkAllocDir(t, h, cfg, true)
			defer cleanup()
			stateDir := TaskStateDir(h.Impl().currentConfig().RootDir, cfg.ID)
			_, _, err := h.StartTask(cfg)
			t.Log(err)
			if err == nil {
				// Refused it must be; started, it goes with its group.
				t.Cleanup(func() { _ = h.DestroyTask(cfg.ID, true) })
			}
			must.ErrorContains(t, err, tc.want)
			must.ErrorContains(t, err, "the kernel")
			must.StrNotContains(t, err.Error(), "/proc/self/fd")
			must.Eq(t, 0, processesNamed(t, stateDir))
			_, serr := os.Lstat(stateDir)
			must.True(t, os.IsNotExist(serr), must.Sprintf("state dir: %v", serr))
		})
	}
}

// What the kernel takes is not refused: the longest argument it copies,
// and a dozen of them (1.5 MiB, under the 2 MiB of the default 8 MiB stack
// limit).
func TestDriver_argsUnderArgMaxRun(t *testing.T) {
	requireRoot(t)
	var rl unix.Rlimit
	must.NoError(t, unix.Getrlimit(unix.RLIMIT_STACK, &rl))
	if rl.Cur < 8<<20 {
		t.Skipf("stack limit %d is under 8 MiB", rl.Cur)
	}
	h, _ := harnessDriver(t, Config{})
	cfg := realTask(t, "argmax-ok", TaskConfig{Command: "/bin/true", Args: repeated(12, 131071)})
	cfg.Env = map[string]string{"BIG": strings.Repeat("b", 131071-len("BIG="))}
	cleanup := mkAllocDir(t, h, cfg, true)
	defer cleanup()
	startTask(t, h, cfg)
	must.Eq(t, 0, waitExit(t, h, cfg.ID, 30*time.Second).ExitCode)
	must.NoError(t, h.DestroyTask(cfg.ID, false))
}

func repeated(n, l int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = strings.Repeat("x", l)
	}
	return out
}

// processesNamed counts the processes whose command line holds s.
func processesNamed(t *testing.T, s string) int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	must.NoError(t, err)
	n := 0
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(b), s) {
			n++
		}
	}
	return n
}
