// Package atomicfile writes files so that a reader sees either the old
// content or the new, never a part: through a temporary file in the same
// directory, renamed over the target. It has no dependencies beyond the
// standard library, so that every layer may use it: the driver, the
// executor's contract with the supervisor (driver/executor/wire) and so
// the supervisor shim, and the debugging aids.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
)

// Write writes data to path with mode perm, through a temporary file in
// path's directory (which must exist) renamed over path. With sync set the
// data is on disk before the rename; without it a reader still sees the old
// file or the new one, but after a crash of the host the new one may be
// empty. On error path is untouched and no temporary file is left.
func Write(path string, data []byte, perm os.FileMode, sync bool) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("failed to write %q: %w", path, err)
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	if err := tmp.Chmod(perm); err != nil {
		_ = tmp.Close()
		return fmt.Errorf("failed to write %q: %w", path, err)
	}
	if _, err := tmp.Write(data); err != nil {
		_ = tmp.Close()
		return fmt.Errorf("failed to write %q: %w", path, err)
	}
	if sync {
		if err := tmp.Sync(); err != nil {
			_ = tmp.Close()
			return fmt.Errorf("failed to sync %q: %w", path, err)
		}
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("failed to write %q: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("failed to rename into %q: %w", path, err)
	}
	return nil
}
