package wire

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/atomicfile"
)

// WriteJSONAtomic writes v as JSON to path through a temporary file in the
// same directory, synced and renamed over path.
func WriteJSONAtomic(path string, v any, perm os.FileMode) error {
	return WriteJSON(path, v, perm, true)
}

// WriteJSON is WriteJSONAtomic, with the fsync only when sync is set: a
// reader sees the old file or the new one either way, but after a crash of
// the host an unsynced file may be empty.
func WriteJSON(path string, v any, perm os.FileMode, sync bool) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("failed to encode %q: %w", path, err)
	}
	return atomicfile.Write(path, b, perm, sync)
}

// ReadJSON decodes the JSON file at path into v.
func ReadJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("failed to decode %q: %w", path, err)
	}
	return nil
}
