//go:build cgroupv2_nocontrollers

package cgroups

// This file is built only with the tag cgroupv2_nocontrollers, for "make
// e2e-cgroup2": it lets the driver run in a cgroup v2 hierarchy that has
// none of the controllers it needs, as on a hybrid host whose controllers
// are all held by v1 hierarchies. Groups are still made, joined (with
// CLONE_INTO_CGROUP), frozen, killed with cgroup.kill and given a BPF
// device filter; memory and CPU limits, memory usage and OOM detection are
// skipped, so such a build must never be shipped.
func init() {
	v2Controllers = nil
	v2LimitsOptional = true
}
