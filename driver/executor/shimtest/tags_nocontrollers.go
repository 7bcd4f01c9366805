//go:build cgroupv2_nocontrollers

package shimtest

// buildTags: the cgroup v2 run of a hybrid host (e2e/cgroup2/run.sh)
// builds its tests with this tag, and the shim they build must take the
// same cgroup code as the test binary that runs it as a supervisor.
const buildTags = "cgroupv2_nocontrollers"
