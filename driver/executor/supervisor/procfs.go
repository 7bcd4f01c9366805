package supervisor

import (
	"fmt"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// hostProcStartTime is wire.ProcStartTime read in the host's /proc, through
// the supervisor's handle on the host's root (see openHostRoot).
func hostProcStartTime(pid int) (uint64, error) {
	b, err := readAt(hostRoot, fmt.Sprintf("proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("failed to read the start time of pid %d: %w", pid, err)
	}
	return wire.ParseStatStartTime(b)
}
