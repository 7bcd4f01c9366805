//go:build e2e

package e2e

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// escMknodInVolume: a task running as root with CAP_MKNOD (Nomad's exec
// allows it by default) makes a node for a host block device in its volume,
// a host directory, and reads it. The volume is nodev in the task too
// (TestEscapeVolumeMountFlags), which says EACCES at open; the device
// filter (devices.deny on cgroup v1, the BPF device program on v2) says
// EPERM ("Operation not permitted"): at mknod (the filter allows no "m"),
// or else at open. mknod_block_device cannot tell the filter from the
// nodev of the task's /tmp; this case can, by the error.
func escMknodInVolume(t *testing.T, e *escEnv) {
	u := escUniq()
	marker := "ESCAPE-VOLBLK-" + u
	dev := escLoopDevice(t, marker)
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		t.Fatalf("%v", err)
	}
	script := fmt.Sprintf(`
try() {
  n=$1; shift
  if out=$("$@" 2>&1); then echo "RESULT $n OK $(printf '%%s' "$out" | tr '\n' ' ')"
  else echo "RESULT $n FAILED rc=$? $(printf '%%s' "$out" | tr '\n' ' ')"; return 1; fi
}
echo "uid=$(id -u) $(grep CapEff /proc/self/status)"
try mknod mknod /data/blk-%[3]s b %[1]d %[2]d
try read-node dd if=/data/blk-%[3]s bs=512 count=1 status=none
rm -f /data/blk-%[3]s
echo DONE
`, unix.Major(st.Rdev), unix.Minor(st.Rdev), u)
	job := e.a.RunVolJob(t, VolJob{Script: script,
		Volumes: []VolSpec{{Name: "data", Plugin: e.fx.ID, ID: "escape-devvol-" + u, Dest: "/data", Create: true, CreateType: "dir"}}})
	t.Cleanup(func() { e.a.stopJobs([]string{job.ID}, escTimeout) })
	al := e.a.WaitAlloc(t, job.ID, volTimeout, StatusComplete, StatusFailed)
	out := e.a.AllocLogs(t, al.ID, "t", false)
	t.Logf("block device %s; the task said:\n%s", dev, out)
	if strings.Contains(out, marker) {
		t.Fatalf("ESCAPED: the task read the device's content %q through a node in its volume", marker)
	}
	res := escParse(out)
	if !strings.Contains(out, "CapEff:") || !escHasCap(out, unix.CAP_MKNOD) {
		t.Fatalf("the task has no CAP_MKNOD: the case proves nothing about the device filter")
	}
	const eperm = "Operation not permitted"
	if r := res["mknod"]; !r.OK {
		if !strings.Contains(r.Why, eperm) {
			t.Errorf("mknod failed with %q, not the device filter's EPERM", r.Why)
		}
		t.Logf("contained: the device filter refused mknod: %s", r.Why)
		return
	}
	res.mustFail(t, "read-node")
	if why := res["read-node"].Why; !strings.Contains(why, eperm) {
		t.Errorf("read-node failed with %q, not the device filter's EPERM", why)
	}
}

// escHasCap reports whether the "CapEff:\t<hex>" a task printed has cap.
func escHasCap(out string, cap int) bool {
	_, rest, ok := strings.Cut(out, "CapEff:")
	if !ok {
		return false
	}
	f := strings.Fields(rest)
	if len(f) == 0 {
		return false
	}
	v, err := strconv.ParseUint(f[0], 16, 64)
	return err == nil && v&(1<<uint(cap)) != 0
}
