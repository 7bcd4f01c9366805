// Package cgroups places a task's processes in a control group of their own,
// applies the task's memory and CPU limits, reads usage back, and kills every
// process of the group. It supports cgroup v1 (one hierarchy per controller,
// as on hybrid hosts) and the cgroup v2 unified hierarchy.
package cgroups

// Limits are the resources a task asked for. Zero means "no limit".
type Limits struct {
	// MemoryBytes is the hard memory limit (v1 memory.limit_in_bytes,
	// v2 memory.max). Crossing it triggers the OOM killer for the group.
	MemoryBytes int64
	// MemoryReservationBytes is the soft limit (v1
	// memory.soft_limit_in_bytes, v2 memory.low). Used when Nomad passes
	// memory_max: MemoryBytes is memory_max and this is memory.
	MemoryReservationBytes int64
	// CPUShares is the relative CPU weight (v1 cpu.shares; v2 cpu.weight
	// converted from shares).
	CPUShares int64
	// CPUQuota and CPUPeriod, in microseconds, cap CPU time (v1
	// cpu.cfs_quota_us/cpu.cfs_period_us, v2 cpu.max).
	CPUQuota  int64
	CPUPeriod int64
	// CpusetCpus pins the group to these CPUs ("0-1,3").
	CpusetCpus string
	// CpusetCgroupPath is the group Nomad made for the task (Nomad's
	// LinuxResources.CpusetCgroupPath). On v1 it is a cpuset group: the
	// task joins it too, and CpusetCpus, when set, is written to it, as
	// Nomad's own executors do; it is Nomad's, so it is never created or
	// removed here. On v2 it is the group Nomad expects the task in, in
	// its share or reserve partition: the task's group is that one (see
	// Create).
	CpusetCgroupPath string
	// PidsMax caps the processes and threads in the group (v1 and v2
	// pids.max); 0 leaves them unlimited.
	PidsMax int64
	// Devices, when non-nil, restricts the group to these devices:
	// everything else is denied (open and mknod). nil means no filter
	// (privileged tasks). An empty, non-nil list denies every device.
	//
	// v1: the group is made in the devices hierarchy too, with "a" in
	// devices.deny and each rule in devices.allow. v2: a
	// BPF_PROG_TYPE_CGROUP_DEVICE program is attached to the group's
	// directory. nil leaves a filter an earlier Create set in place.
	Devices []DeviceRule
}

// Stats is one sample of a group's usage.
type Stats struct {
	CPUUserNanos     uint64
	CPUSystemNanos   uint64
	CPUTotalNanos    uint64
	ThrottledPeriods uint64
	ThrottledNanos   uint64

	MemoryRSS      uint64
	MemoryCache    uint64
	MemorySwap     uint64
	MemoryUsage    uint64
	MemoryMaxUsage uint64

	// CPUTotalNanos and MemoryUsage are always read (Stats fails without
	// them); the other fields are only meaningful when their name is in
	// the Measured lists.
	//
	// Measured lists which of the fields above the hierarchy reports, in
	// Nomad's spelling ("RSS", "Cache", "Swap", "Usage", "Max Usage",
	// "System Mode", "User Mode", "Throttled Periods", "Throttled Time").
	MemoryMeasured []string
	CPUMeasured    []string
}

// State is what a Group needs to be found again after the driver restarts.
// It is stored inside the task's driver state, so keep it small.
type State struct {
	// Version is 1 or 2.
	Version int `json:"version"`
	// Paths maps a controller name (v1) or "unified" (v2) to the group's
	// absolute directory.
	Paths map[string]string `json:"paths"`
	// CpusetCgroupPath is Limits.CpusetCgroupPath, kept so that Join still
	// joins Nomad's cpuset group after Load. It is never removed.
	CpusetCgroupPath string `json:"cpuset_cgroup_path,omitempty"`
}
