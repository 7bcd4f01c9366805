//go:build e2e

package e2e

import (
	"strings"
	"testing"
)

// escBlockDevScript checks the block-device volume at $1: a block device,
// read, written (the byte $2 at offset 0, unless $2 is "-"), its first
// byte as the task reads it, and whether the task's /dev is writable.
const escBlockDevScript = `d=$1
test -b "$d" && echo BLOCK
if [ "$2" != - ]; then
  if printf "$2" | dd of="$d" bs=1 count=1 conv=notrunc 2>/dev/null; then echo WRITTEN; else echo WRITE-REFUSED; fi
fi
echo "FIRST $(dd if="$d" bs=1 count=1 2>/dev/null)"
if touch /dev/ncsi-new 2>/dev/null; then echo DEV-WRITABLE; else echo DEV-READ-ONLY; fi
echo DONE
`

// A block-device volume at /dev/xvdb (where the kubelet puts them too) in
// a task that is not privileged, through Nomad: the task starts, writes
// the device, and its /dev stays read-only; the same volume read_only at
// another path under /dev is read by a root task but not written.
func TestVolumeBlockDeviceUnderDev(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "blkdev", VolFixtureOptions{})
	id := "blkdev-" + escUniq()
	run := func(name, dest, write string, readOnly bool) string {
		t.Helper()
		v := VolSpec{Name: "dev", Plugin: fx.ID, ID: id, Dest: dest, Attach: "block-device", Create: true, CreateType: "ext4"}
		if readOnly {
			v.Access, v.ReadOnly = "single-node-reader-only", true
		}
		job := escRun(t, a, escJob{User: "root", Script: escBlockDevScript, Args: []string{dest, write}, Volumes: []VolSpec{v}})
		al := a.WaitAlloc(t, job.ID, volTimeout, StatusComplete, StatusFailed)
		out := escRead(t, a, al.ID, "t", false)
		t.Logf("%s: the task said:\n%s", name, out)
		if !strings.Contains(out, "DONE") {
			t.Fatalf("%s: the task did not finish its script:\n%s", name, al.Describe())
		}
		a.stopJobs([]string{job.ID}, volTimeout)
		return out
	}
	out := run("writer", "/dev/xvdb", "Q", false)
	for _, want := range []string{"BLOCK", "WRITTEN", "FIRST Q", "DEV-READ-ONLY"} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("writer: %q missing", want)
		}
	}
	out = run("reader", "/dev/disk/by-id/data", "Z", true)
	for _, want := range []string{"BLOCK", "WRITE-REFUSED", "FIRST Q", "DEV-READ-ONLY"} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("reader: %q missing", want)
		}
	}
}
