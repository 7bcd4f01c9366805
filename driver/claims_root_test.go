package driver

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/nomad/helper/uuid"
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

// A single-node-writer volume shared by the tasks of one allocation (an
// app and its backup sidecar), through real mounts: one NodePublishVolume,
// both tasks see each other's files, the publish outlives the task that
// made it while the other runs, and goes with the last.
func TestDriver_singleNodeWriterTasksOfOneAllocation_Root(t *testing.T) {
	requireRoot(t)
	parent := fmt.Sprintf("ncsi-allocshare-%d", os.Getpid())
	root := shortTempDir(t)
	work := shortTempDir(t)
	t.Cleanup(func() { unmountUnder(root) })
	h, d := harnessDriver(t, Config{RootDir: root, CgroupParent: parent, AllowPrivileged: true, PrivilegedGrants: grantAll})
	calls, _ := fixtureNode(t, h, d)
	dest := filepath.Join(work, "data")
	vol := func(create bool) map[string]VolumeConfig {
		v := VolumeConfig{PluginID: "fixture", VolumeID: "vol-snw-alloc", Destination: dest, AccessMode: "single-node-writer"}
		if create {
			v.Create = &VolumeCreateBlock{CapacityMin: "16MiB", Parameters: map[string]string{"type": "dir"}}
		}
		return map[string]VolumeConfig{"data": v}
	}

	app := realTask(t, "app", TaskConfig{Command: "/bin/sh", Args: []string{"-c", "echo app > " + dest + "/a && exec sleep 1000"}, Volumes: vol(true)})
	defer mkAllocDir(t, h, app, false)()
	startTask(t, h, app)
	// The sidecar of the same allocation: it reads the app's file and
	// writes its own. Exit 4: it did not see the app's file.
	sidecar := realTask(t, "backup", TaskConfig{Command: "/bin/sh", Args: []string{"-c",
		"while [ ! -e " + dest + "/a ]; do sleep 0.1; done; [ \"$(cat " + dest + "/a)\" = app ] || exit 4; " +
			"echo backup > " + dest + "/b && exec sleep 1000"}, Volumes: vol(false)})
	sidecar.AllocID = app.AllocID
	sidecar.ID = app.AllocID + "/backup/" + uuid.Short()
	defer mkAllocDir(t, h, sidecar, false)()
	startTask(t, h, sidecar)
	must.Eq(t, 1, calls("NodePublishVolume"))

	// Another allocation is still refused.
	other := realTask(t, "other", TaskConfig{Command: "/bin/true", Volumes: vol(false)})
	defer mkAllocDir(t, h, other, false)()
	_, _, err := h.StartTask(other)
	must.ErrorContains(t, err, fmt.Sprintf(`is single-node-writer and task %q of allocation %q already has it published writable on this node`, app.ID, app.AllocID))
	_ = h.DestroyTask(other.ID, true)

	m, err := d.volumes()
	must.NoError(t, err)
	must.SliceEmpty(t, m.TasksWithPrefix(other.AllocID))
	must.Eq(t, []string{app.ID, sidecar.ID}, m.TasksWithPrefix(app.AllocID))
	target := ""
	eventually(t, 15*time.Second, func() error {
		b, err := os.ReadFile(filepath.Join(m.TargetPath(app.ID, "data"), "b"))
		if err != nil {
			return err
		}
		if string(b) != "backup\n" {
			return fmt.Errorf("the app's volume holds %q", b)
		}
		target = m.TargetPath(app.ID, "data")
		return nil
	})

	// The app goes: the sidecar keeps the publish.
	must.NoError(t, h.StopTask(app.ID, 5*time.Second, "SIGKILL"))
	must.NoError(t, h.DestroyTask(app.ID, true))
	must.Eq(t, 0, calls("NodeUnpublishVolume"))
	must.Eq(t, []string{sidecar.ID}, m.TasksWithPrefix(app.AllocID))
	b, err := os.ReadFile(filepath.Join(target, "a"))
	must.NoError(t, err)
	must.Eq(t, "app\n", string(b))

	// The sidecar goes: unpublished and unstaged once each.
	must.NoError(t, h.StopTask(sidecar.ID, 5*time.Second, "SIGKILL"))
	must.NoError(t, h.DestroyTask(sidecar.ID, true))
	must.Eq(t, 1, calls("NodeUnpublishVolume"))
	must.Eq(t, 1, calls("NodeUnstageVolume"))
	must.SliceEmpty(t, m.TasksWithPrefix(app.AllocID))
	_, err = os.Stat(filepath.Dir(target))
	must.True(t, os.IsNotExist(err), must.Sprint("the publishing task's directory is left"))
}
