package supervisor

import (
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

func TestSplitLate(t *testing.T) {
	mounts := []wire.Mount{{Target: "/alloc"}, {Target: "/data/sub"}, {Target: "/data"}, {Target: "/database"}}
	early, after := splitLate(mounts, []wire.Mount{{Target: "/data/"}})
	must.Eq(t, []wire.Mount{{Target: "/alloc"}, {Target: "/database"}}, early)
	must.Eq(t, []wire.Mount{{Target: "/data/sub"}, {Target: "/data"}}, after)
}
