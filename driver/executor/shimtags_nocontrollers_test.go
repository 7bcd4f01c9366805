//go:build cgroupv2_nocontrollers

package executor

// This test binary is built for "make unit-cgroup2" (a cgroup v2 hierarchy
// without controllers): the shim the image tests run as the supervisor must
// be built the same way, or it asks for controllers the hierarchy lacks.
func init() { shimBuildTags = "cgroupv2_nocontrollers" }
