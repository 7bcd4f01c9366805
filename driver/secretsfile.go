package driver

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

// secrets_file: a volume's secrets read from a file of the task's
// directory, rendered there by the task's template block (Vault, Nomad
// Variables) before the task starts, so that they are never written into
// the job. The file holds KEY=VALUE lines (the format of a template with
// env = true): blank lines and lines starting with '#' are skipped, the
// value is everything after the first '=' (no quotes, no escapes).
//
// What a hostile job could try, and why it fails:
//   - name a host file: the path must be relative to the task directory
//     without "..", and it is opened beneath the task directory with
//     openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS), so neither ".." nor a
//     symlink (which the task itself could plant in its secrets/ or local/
//     directory) leads out of it;
//   - a hard link to a host file: refused (more than one link); the task
//     cannot make one anyway, its directories being other mounts than
//     the host files it sees;
//   - a FIFO or device to hang or feed the driver: opened non-blocking and
//     refused unless it is a regular file;
//   - a huge file: at most maxSecretsFileBytes are read;
//   - learn the values through errors: errors name the file and the line
//     number, never a line's content.
// The secrets then go the way of inline secrets: sent to the plugin, never
// logged, kept in the journal only while a call needs them.

// maxSecretsFileBytes bounds a secrets file: the limit of the secrets
// map (csihook.MaxMapBytes) plus room for '=', newlines and comments.
const maxSecretsFileBytes = 2 * csihook.MaxMapBytes

// checkSecretsFile checks a volume's secrets_file before anything is read.
func checkSecretsFile(name string, v VolumeConfig) error {
	p := v.SecretsFile
	if p == "" {
		return nil
	}
	switch {
	case len(v.Secrets) > 0:
		return fmt.Errorf("volume %q: secrets and secrets_file are both set: give the secrets one way only", name)
	case filepath.IsAbs(p):
		return fmt.Errorf("volume %q: secrets_file %q must be relative to the task directory, such as \"secrets/volume.env\"", name, p)
	case strings.ContainsRune(p, 0) || len(p) > 4096:
		return fmt.Errorf("volume %q: secrets_file must be a path of at most 4096 bytes without NUL", name)
	case hasDotDotPart(p):
		return fmt.Errorf("volume %q: secrets_file %q must not contain '..': it must stay in the task directory", name, p)
	case filepath.Clean(p) == ".":
		return fmt.Errorf("volume %q: secrets_file must name a file in the task directory, such as \"secrets/volume.env\"", name)
	}
	return nil
}

func hasDotDotPart(p string) bool {
	for _, part := range strings.Split(p, "/") {
		if part == ".." {
			return true
		}
	}
	return false
}

// readSecretsFile reads the secrets of volume name from rel beneath the
// task directory taskDir.
func readSecretsFile(taskDir, name, rel string) (map[string]string, error) {
	dir, err := unix.Open(taskDir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("volume %q: secrets_file: cannot open the task directory %q: %w", name, taskDir, err)
	}
	defer unix.Close(dir)
	// An O_PATH handle first: what it names is checked before it is
	// opened for reading, so a device node is never opened at all.
	pfd, err := unix.Openat2(dir, filepath.Clean(rel), &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, fmt.Errorf("volume %q: secrets_file %q cannot be read in the task directory (it must be a file there, reached without symlinks; a template block with destination = %q renders it before the task starts): %w",
			name, rel, rel, err)
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		return nil, fmt.Errorf("volume %q: secrets_file %q: %w", name, rel, err)
	}
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFLNK:
		return nil, fmt.Errorf("volume %q: secrets_file %q is a symlink: it must be a regular file in the task directory, reached without symlinks", name, rel)
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return nil, fmt.Errorf("volume %q: secrets_file %q is not a regular file", name, rel)
	case st.Nlink > 1:
		return nil, fmt.Errorf("volume %q: secrets_file %q has %d hard links: it must be a file of its own", name, rel, st.Nlink)
	case st.Size > maxSecretsFileBytes:
		return nil, fmt.Errorf("volume %q: secrets_file %q is %d bytes: it must be at most %d", name, rel, st.Size, maxSecretsFileBytes)
	}
	// The very file checked, opened for reading through its handle.
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", pfd), unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("volume %q: secrets_file %q: %w", name, rel, err)
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxSecretsFileBytes+1))
	if err != nil {
		return nil, fmt.Errorf("volume %q: secrets_file %q: %w", name, rel, err)
	}
	if len(data) > maxSecretsFileBytes {
		return nil, fmt.Errorf("volume %q: secrets_file %q is over %d bytes", name, rel, maxSecretsFileBytes)
	}
	return parseSecrets(name, rel, data)
}

// parseSecrets reads KEY=VALUE lines. Errors never quote a line.
func parseSecrets(name, rel string, data []byte) (map[string]string, error) {
	out := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 4096), maxSecretsFileBytes+1)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSuffix(sc.Text(), "\r")
		trimmed := strings.TrimSpace(line)
		if trimmed == "" || strings.HasPrefix(trimmed, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		k = strings.TrimSpace(k)
		if !ok || k == "" || strings.ContainsAny(k, " \t") {
			return nil, fmt.Errorf("volume %q: secrets_file %q line %d is not KEY=VALUE (the line is not shown: it may hold a secret)", name, rel, n)
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("volume %q: secrets_file %q line %d sets a key an earlier line set (the key is not shown: a line may hold a secret)", name, rel, n)
		}
		out[k] = v
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("volume %q: secrets_file %q: %w", name, rel, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("volume %q: secrets_file %q holds no KEY=VALUE line", name, rel)
	}
	return out, nil
}
