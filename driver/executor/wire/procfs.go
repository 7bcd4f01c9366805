package wire

import (
	"fmt"
	"os"
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
	fields, ok := StatFields(stat)
	if !ok {
		return 0, fmt.Errorf("failed to parse stat %q: no command name", stat)
	}
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

// StatFields splits the text of /proc/PID/stat from field 3 (state) on:
// the command name (field 2) is in parentheses and may hold spaces and
// parentheses itself, so the fields resume after the last ')'. ok is false
// without one.
func StatFields(stat string) (fields []string, ok bool) {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return nil, false
	}
	return strings.Fields(stat[i+1:]), true
}
