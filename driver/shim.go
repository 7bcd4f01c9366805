package driver

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// shimFiles holds the supervisor shim when the build put it there (make
// dev); see shimbin/README.md.
//
//go:embed shimbin
var shimFiles embed.FS

// shimSource is where SetConfig looks for the shim. Unit tests empty it:
// the shim embedded in a test binary may be older than the code under
// test, so their tasks run from the test binary itself.
var shimSource fs.FS = shimFiles

const shimName = "nomad-driver-csi-shim"

// installShim writes the embedded supervisor shim to root/bin, named by its
// content hash, and returns its path; "" when the build embedded none (the
// executor then runs supervisors from the driver's own binary). Older
// shims are removed: supervisors still running them keep their (deleted)
// file.
func installShim(files fs.FS, root string) (string, error) {
	data, err := fs.ReadFile(files, "shimbin/"+shimName)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("failed to read the embedded supervisor shim: %w", err)
	}
	sum := sha256.Sum256(data)
	dir := filepath.Join(root, "bin")
	name := shimName + "-" + hex.EncodeToString(sum[:6])
	path := filepath.Join(dir, name)
	if fi, err := os.Stat(path); err != nil || fi.Size() != int64(len(data)) {
		if err := writeFileAtomic(path, data, 0o755); err != nil {
			return "", fmt.Errorf("failed to install the supervisor shim at %q: %w", path, err)
		}
	}
	if entries, err := os.ReadDir(dir); err == nil {
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), shimName+"-") && e.Name() != name {
				_ = os.Remove(filepath.Join(dir, e.Name()))
			}
		}
	}
	return path, nil
}
