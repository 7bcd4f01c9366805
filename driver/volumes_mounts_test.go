package driver

import (
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// A non-privileged task's volumes are nosuid and nodev whatever the job's
// mount_flags asked the plugin for (a block-device volume keeps dev: it is
// the device node the task opens); a privileged task's keep what the
// plugin made.
func TestVolumeMounts_Flags(t *testing.T) {
	pubs := []csihook.Published{
		{Name: "dir", HostPath: "/h/dir", Destination: "/data", ReadOnly: true},
		{Name: "blk", HostPath: "/h/blk", Destination: "/dev/xvdb", Block: true},
	}
	for _, tc := range []struct {
		name     string
		isolated bool
		want     []executor.Mount
	}{
		{"isolated", true, []executor.Mount{
			{Source: "/h/dir", Target: "/data", ReadOnly: true, Propagation: executor.PropagationPrivate, NoSuid: true, NoDev: true},
			{Source: "/h/blk", Target: "/dev/xvdb", Propagation: executor.PropagationPrivate, NoSuid: true},
		}},
		{"privileged", false, []executor.Mount{
			{Source: "/h/dir", Target: "/data", ReadOnly: true, Propagation: executor.PropagationPrivate},
			{Source: "/h/blk", Target: "/dev/xvdb", Propagation: executor.PropagationPrivate},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			must.Eq(t, tc.want, volumeMounts(pubs, tc.isolated))
		})
	}
}
