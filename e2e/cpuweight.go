//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// TaskCPUWeight reads the CPU weight of an allocation's task from the
// cgroup of its first process: cpu.shares on cgroup v1 (the cpu
// controller's group), cpu.weight on v2. It names the file it read.
func TaskCPUWeight(allocID, task string) (file string, weight int64, err error) {
	pids := TaskPIDs(allocID, task)
	if len(pids) == 0 {
		return "", 0, fmt.Errorf("no process of task %s of allocation %s", task, allocID)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pids[0]))
	if err != nil {
		return "", 0, err
	}
	file = ""
	for _, line := range strings.Split(string(b), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[1] == "" && file == "" {
			file = filepath.Join("/sys/fs/cgroup", parts[2], "cpu.weight")
		}
		for _, ctrl := range strings.Split(parts[1], ",") {
			if ctrl == "cpu" {
				file = filepath.Join("/sys/fs/cgroup/cpu", parts[2], "cpu.shares")
			}
		}
	}
	if file == "" {
		return "", 0, fmt.Errorf("process %d is in no cpu cgroup: %q", pids[0], b)
	}
	v, err := os.ReadFile(file)
	if err != nil {
		return file, 0, err
	}
	weight, err = strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64)
	return file, weight, err
}
