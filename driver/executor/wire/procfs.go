package wire

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// ProcStartTime returns field 22 (starttime, clock ticks since boot) of
// /proc/PID/stat. Together with the PID it names one process for good.
func ProcStartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("failed to read the start time of pid %d: %w", pid, err)
	}
	return ParseStatStartTime(string(b))
}

// ParseStatStartTime reads the start time out of the text of /proc/PID/stat.
func ParseStatStartTime(stat string) (uint64, error) {
	// The command name (field 2) is in parentheses and may hold spaces
	// and parentheses itself: the fields resume after the last ')'.
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("failed to parse stat %q: no command name", stat)
	}
	fields := strings.Fields(stat[i+1:])
	// fields[0] is field 3 (state), so field 22 is fields[19].
	if len(fields) < 20 {
		return 0, fmt.Errorf("failed to parse stat %q: %d fields after the command name", stat, len(fields))
	}
	n, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("failed to parse start time %q: %w", fields[19], err)
	}
	return n, nil
}

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
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("failed to write %q: %w", path, err)
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	if err := tmp.Chmod(perm); err != nil {
		_ = tmp.Close()
		return fmt.Errorf("failed to write %q: %w", path, err)
	}
	if _, err := tmp.Write(b); err != nil {
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
