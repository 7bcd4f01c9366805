package driver

import (
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// A plugin back healthy after its process died is a new process: the
// repair the driver starts on its return is not held back by the relapses
// of the volumes that kept dying under the one before.
func TestOnPluginHealthy_endsTheRepairBackoff(t *testing.T) {
	n := startStopNode(t, "0s")
	mnt := n.d.mounter.(*mounter.Fake)
	m, err := n.d.volumes()
	must.NoError(t, err)
	target := m.TargetPath(n.work.ID, "data")
	published := func() int { return n.fp.vols.Count(csihook.MethodNodePublishVolume) }

	mnt.SetStale(target, true)
	n.d.repairStale("", 1)
	must.Eq(t, 2, published(), must.Sprint("the first death is repaired at once"))
	// Dead again before a check saw it alive: a relapse, held back.
	mnt.SetStale(target, true)
	n.d.repairStale("", 1)
	must.Eq(t, 2, published(), must.Sprint("a relapse is repaired at once"))

	n.d.onPluginHealthy("hp")
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return published() == 3 }),
		wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)))
}
