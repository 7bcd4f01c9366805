package driver

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// A multi-node-single-writer volume on one node, through real mounts: a
// reader of another allocation reads what the writer wrote and cannot
// write; a second writing allocation (a hostile job, say) is refused at
// its start, naming the writer, and gets nothing mounted.
func TestDriver_multiNodeSingleWriter_Root(t *testing.T) {
	requireRoot(t)
	parent := fmt.Sprintf("ncsi-claims-%d", os.Getpid())
	root := shortTempDir(t)
	work := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })
	h, d := harnessDriver(t, Config{RootDir: root, CgroupParent: parent, AllowPrivileged: true, PrivilegedGrants: grantAll})
	fixtureNode(t, h, d)
	dest := filepath.Join(work, "data")
	vol := func(readOnly bool, create bool) map[string]VolumeConfig {
		v := VolumeConfig{PluginID: "fixture", VolumeID: "vol-mnsw", Destination: dest, AccessMode: "multi-node-single-writer", ReadOnly: readOnly}
		if create {
			v.Create = &VolumeCreateBlock{CapacityMin: "16MiB", Parameters: map[string]string{"type": "dir"}}
		}
		return map[string]VolumeConfig{"data": v}
	}

	writer := realTask(t, "writer", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "echo w > " + dest + "/f && exec sleep 1000"}, Volumes: vol(false, true)})
	defer mkAllocDir(t, h, writer, false)()
	startTask(t, h, writer)

	hostile := realTask(t, "hostile", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "echo x > " + dest + "/f"}, Volumes: vol(false, false)})
	defer mkAllocDir(t, h, hostile, false)()
	_, _, err := h.StartTask(hostile)
	must.ErrorContains(t, err, fmt.Sprintf(`is multi-node-single-writer and task %q of allocation %q has it published writable on this node`, writer.ID, writer.AllocID))
	_ = h.DestroyTask(hostile.ID, true)
	m, err := d.volumes()
	must.NoError(t, err)
	must.SliceEmpty(t, m.TasksWithPrefix(hostile.AllocID))

	// Exit 3: the reader could write; 4: it did not see the writer's file.
	reader := realTask(t, "reader", TaskConfig{Command: "/bin/sh", Args: []string{"-c",
		"while [ ! -e " + dest + "/f ]; do sleep 0.1; done; [ \"$(cat " + dest + "/f)\" = w ] || exit 4; " +
			"echo x > " + dest + "/g 2>/dev/null && exit 3; exit 0"}, Volumes: vol(true, false)})
	defer mkAllocDir(t, h, reader, false)()
	startTask(t, h, reader)
	res := waitExit(t, h, reader.ID, 30*time.Second)
	must.Eq(t, 0, res.ExitCode)
	must.NoError(t, h.DestroyTask(reader.ID, true))

	must.NoError(t, h.StopTask(writer.ID, 5*time.Second, "SIGKILL"))
	must.NoError(t, h.DestroyTask(writer.ID, true))
	must.Eq(t, 0, m.Users("fixture", "vol-mnsw"))
}
