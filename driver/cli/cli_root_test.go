package cli

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// fixtureBin is the fixture plugin built by `make csi-tools`.
func fixtureBin(t *testing.T) string {
	bin, err := filepath.Abs(filepath.Join("..", "..", "build", "csi", "csi-fixture"))
	must.NoError(t, err)
	if _, err := os.Stat(bin); err != nil {
		t.Skip("needs the fixture plugin: run make csi-tools")
	}
	return bin
}

// TestCommands_realPlugin runs every command against the fixture plugin
// (e2e/csiplugin) serving at a plugin task's socket under a temporary
// root_dir, with volumes csihook really staged and published (bind mounts).
// It needs root.
func TestCommands_realPlugin(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the fixture plugin mounts volumes")
	}
	bin := fixtureBin(t)
	base := shortDir(t)
	root, state := filepath.Join(base, "root"), filepath.Join(base, "state")
	t.Cleanup(func() { unmountUnder(t, base) })
	sock := driver.PluginSocketPath(root, "fx")
	must.NoError(t, os.MkdirAll(filepath.Dir(sock), 0o700))
	cmd := exec.Command(bin, "--endpoint", "unix://"+sock, "--state-dir", state, "--node-id", "n-"+strconv.Itoa(os.Getpid()))
	out := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = out, out
	must.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Signal(unix.SIGTERM)
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("plugin output:\n%s", out.String())
		}
	})
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		_, err := os.Stat(sock)
		return err == nil
	}), wait.Timeout(10*time.Second), wait.Gap(20*time.Millisecond)))

	// A live task (handed to Nomad, as its state directory says) and one
	// whose start never finished.
	live, unfinished := "alloc1/web/1", "alloc2/web/1"
	writeTaskDir(t, root, live, true)
	writeTaskDir(t, root, unfinished, false)
	m := openManager(t, root, sock)
	for task, name := range map[string]string{live: "data", unfinished: "scratch"} {
		_, err := m.Setup(context.Background(), task, []csihook.VolumeRequest{{
			Name: name, PluginID: "fx", VolumeID: "cli-" + strconv.Itoa(os.Getpid()) + "-" + name,
			Destination: "/data", AccessMode: csihook.AccessSingleNodeWriter, AttachmentMode: csihook.AttachmentFileSystem,
			Create: &csihook.CreateRequest{Parameters: map[string]string{"type": "dir"}},
		}})
		must.NoError(t, err)
	}
	closed := false
	t.Cleanup(func() {
		if closed {
			m = openManager(t, root, sock)
		}
		for _, task := range []string{live, unfinished} {
			must.NoError(t, m.Teardown(context.Background(), task))
		}
		m.Close()
	})

	t.Run("probe", func(t *testing.T) {
		code, out, errOut := runCLI("probe", "fx", "-root-dir", root)
		must.Eq(t, 0, code, must.Sprint(errOut))
		must.Eq(t, "fixture.csi.nomad-driver-csi", field(out, "Name"))
		must.Eq(t, "true", field(out, "Ready"))
		must.Eq(t, "n-"+strconv.Itoa(os.Getpid()), field(out, "Node ID"))
		must.StrContains(t, field(out, "Node capabilities"), "GET_VOLUME_STATS")
		must.StrContains(t, field(out, "Controller capabilities"), "CREATE_DELETE_VOLUME")
	})
	t.Run("volumes", func(t *testing.T) {
		code, out, errOut := runCLI("volumes", "-json", "-root-dir", root)
		must.Eq(t, 0, code, must.Sprint(errOut))
		var v volumesView
		must.NoError(t, json.Unmarshal([]byte(out), &v))
		must.SliceLen(t, 2, v.Volumes)
		byTask := map[string]string{}
		for _, vol := range v.Volumes {
			must.Eq(t, "staged", vol.Stage)
			must.SliceLen(t, 1, vol.Tasks)
			must.Eq(t, "published", vol.Tasks[0].State)
			byTask[vol.Tasks[0].TaskID] = vol.Tasks[0].Name
		}
		must.Eq(t, map[string]string{live: "data", unfinished: "scratch"}, byTask)
	})
	t.Run("stats", func(t *testing.T) {
		code, out, errOut := runCLI("stats", "data", "-json", "-root-dir", root)
		must.Eq(t, 0, code, must.Sprint(errOut))
		var v statsView
		must.NoError(t, json.Unmarshal([]byte(out), &v))
		must.SliceLen(t, 2, v.Usage)
		must.Eq(t, "bytes", v.Usage[0].Unit)
		must.Positive(t, v.Usage[0].Total)
		must.False(t, *v.Abnormal)
	})

	// An orphan: a mount in the publish layout that no record names.
	orphan := filepath.Join(driver.StageRoot(root), "publish", "0123456789abcdef", "data")
	src := filepath.Join(base, "orphan-src")
	must.NoError(t, os.MkdirAll(orphan, 0o700))
	must.NoError(t, os.MkdirAll(src, 0o700))
	must.NoError(t, mounter.New().BindMount(src, orphan, false, false))
	mounted := func(path string) bool {
		ok, err := mounter.New().IsMountPoint(path)
		must.NoError(t, err)
		return ok
	}

	t.Run("cleanup beside a running driver", func(t *testing.T) {
		code, out, errOut := runCLI("cleanup", "-root-dir", root)
		must.Eq(t, 0, code, must.Sprint(errOut))
		must.StrContains(t, out, "The driver is running")
		must.StrContains(t, out, "would unmount "+orphan)
		must.StrContains(t, out, "task "+unfinished+" volume scratch")
		must.StrContains(t, out, "start never finished")
		must.StrNotContains(t, out, "task "+live)

		code, _, errOut = runCLI("cleanup", "-apply", "-root-dir", root)
		must.Eq(t, 1, code)
		must.StrContains(t, errOut, "the driver holds the volume journal's lock")
		must.True(t, mounted(orphan))
	})
	m.Close()
	closed = true
	t.Run("cleanup -apply", func(t *testing.T) {
		code, out, errOut := runCLI("cleanup", "-apply", "-json", "-root-dir", root)
		must.Eq(t, 0, code, must.Sprint(errOut))
		var v cleanupView
		must.NoError(t, json.Unmarshal([]byte(out), &v))
		must.Eq(t, []string{orphan}, v.Unmounted)
		must.SliceLen(t, 1, v.StaleRecords)
		must.False(t, mounted(orphan))
		// What the journal names stays mounted.
		st, err := csihook.ReadJournal(driver.JournalDir(root))
		must.NoError(t, err)
		for _, task := range st.Tasks {
			must.True(t, mounted(task.Target), must.Sprintf("%s was unmounted", task.Target))
		}
	})
}

func writeTaskDir(t *testing.T, root, taskID string, handed bool) {
	t.Helper()
	dir := filepath.Join(root, "tasks", csihook.ShortHash(taskID))
	must.NoError(t, os.MkdirAll(dir, 0o700))
	b, err := json.Marshal(map[string]string{"task_id": taskID, "alloc_id": filepath.Dir(filepath.Dir(taskID)), "task_name": "web"})
	must.NoError(t, err)
	must.NoError(t, os.WriteFile(filepath.Join(dir, "invocation.json"), b, 0o600))
	if handed {
		must.NoError(t, os.WriteFile(filepath.Join(dir, "handed"), nil, 0o600))
	}
}

func openManager(t *testing.T, root, sock string) *csihook.Manager {
	t.Helper()
	m, err := csihook.New(csihook.Config{
		Root:       driver.StageRoot(root),
		JournalDir: driver.JournalDir(root),
		Lookup: func(id string) (csihook.PluginInfo, error) {
			if id != "fx" {
				return csihook.PluginInfo{}, errors.New("unknown plugin")
			}
			return csihook.PluginInfo{ID: id, Socket: sock, NodeID: "n1", Healthy: true, StageUnstage: true, CreateDelete: true}, nil
		},
		Dial:       csihook.DialUnix,
		Mounter:    mounter.New(),
		Logger:     hclog.NewNullLogger(),
		Events:     func(string, string, map[string]string) {},
		RPCTimeout: 20 * time.Second,
	})
	must.NoError(t, err)
	return m
}

// unmountUnder unmounts whatever a failed test left under dir, deepest
// first.
func unmountUnder(t *testing.T, dir string) {
	mps, err := mounter.New().List()
	if err != nil {
		return
	}
	sort.Slice(mps, func(i, j int) bool { return len(mps[i].Path) > len(mps[j].Path) })
	for _, mp := range mps {
		if mounter.PathWithin(mp.Path, dir) {
			t.Logf("cleanup: unmounting leftover %s", mp.Path)
			_ = unix.Unmount(mp.Path, unix.MNT_DETACH)
		}
	}
}
