package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// runCLI runs the command line and returns its exit code and outputs.
func runCLI(args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	code := Main(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// shortDir is a temporary directory with a short path, so that plugin
// sockets under it fit in a unix socket path.
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ncli")
	must.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// escTask is a task ID holding terminal escapes: a string a job controls
// (as it controls volume ids and a plugin's answers) must reach the
// operator's terminal escaped.
const escTask = "task-\x1b]0;owned\x07\x1b[2J\u202e"

// fakeManager is the volume lifecycle of the journal under root, with a
// fake plugin behind every plugin id and a fake mounter, so the journal it
// writes is the real thing. It holds the journal's lock until closed.
func fakeManager(t *testing.T, root string) *csihook.Manager {
	t.Helper()
	fake := csihook.NewFakeClient(mounter.NewFake())
	m, err := csihook.New(csihook.Config{
		Root:       driver.StageRoot(root),
		JournalDir: driver.JournalDir(root),
		Lookup: func(id string) (csihook.PluginInfo, error) {
			return csihook.PluginInfo{ID: id, Socket: driver.PluginSocketPath(root, id), NodeID: "n1", Healthy: true, StageUnstage: true,
				CreateDelete: true}, nil
		},
		Dial:    fake.Dial,
		Mounter: mounter.NewFake(),
		Logger:  hclog.NewNullLogger(),
		Events:  func(string, string, map[string]string) {},
	})
	must.NoError(t, err)
	return m
}

// writeJournal sets up volumes (by id, of plugin "p") for tasks through
// fakeManager.
func writeJournal(t *testing.T, root string, tasks map[string][]string) *csihook.Manager {
	t.Helper()
	m := fakeManager(t, root)
	for task, vols := range tasks {
		var reqs []csihook.VolumeRequest
		for _, v := range vols {
			reqs = append(reqs, csihook.VolumeRequest{Name: "data", PluginID: "p", VolumeID: v, Destination: "/data",
				AccessMode: csihook.AccessMultiNodeMultiWriter, AttachmentMode: csihook.AttachmentFileSystem})
		}
		_, err := m.Setup(context.Background(), task, reqs)
		must.NoError(t, err)
	}
	return m
}

func TestMain_badInput(t *testing.T) {
	root := t.TempDir()
	file := filepath.Join(root, "file")
	must.NoError(t, os.WriteFile(file, nil, 0o600))
	cases := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"unknown command", []string{"resize", "v", "1G"}, 2, `unknown command "resize": use volumes, probe, stats, expand, cleanup or images`},
		{"expand without size", []string{"expand", "v", "-root-dir", root}, 2, "expand needs <volume> <size>"},
		{"expand bad size", []string{"expand", "v", "lots", "-root-dir", root}, 2, `expand: size "lots" is not a size above zero: write it as "10GiB" or "512MiB"`},
		{"expand zero size", []string{"expand", "v", "0", "-root-dir", root}, 2, `expand: size "0" is not a size above zero`},
		{"expand no such volume", []string{"expand", "vol9", "1GiB", "-root-dir", root}, 1, `no published volume "vol9" in the journal`},
		{"escaped command", []string{"\x1b[31m"}, 2, `unknown command "\x1b[31m"`},
		{"probe without argument", []string{"probe", "-root-dir", root}, 2, "probe needs <plugin id | socket path>"},
		{"stats without argument", []string{"stats", "-root-dir", root}, 2, "stats needs <volume>"},
		{"extra argument", []string{"volumes", "-root-dir", root, "x"}, 2, `volumes takes 0 argument(s), got unexpected "x"`},
		{"unknown flag", []string{"cleanup", "-force"}, 2, "cleanup: flag provided but not defined: -force"},
		{"relative root dir", []string{"volumes", "-root-dir", "var/lib"}, 2, `-root-dir must be an absolute path, got "var/lib"`},
		{"missing root dir", []string{"volumes", "-root-dir", root + "/nope"}, 1,
			fmt.Sprintf(`-root-dir %q is not usable (no such file or directory): give the root_dir of the driver's plugin config`, root+"/nope")},
		{"root dir is a file", []string{"volumes", "-root-dir", file}, 1, fmt.Sprintf(`-root-dir %q is not a directory`, file)},
		{"unknown plugin", []string{"probe", "nope", "-root-dir", root}, 1,
			fmt.Sprintf(`no plugin task "nope" on this node: its socket %q is not there`, driver.PluginSocketPath(root, "nope"))},
		{"not a socket", []string{"probe", file, "-root-dir", root}, 1, fmt.Sprintf("%q is not a unix socket", file)},
		{"no such volume", []string{"stats", "vol9", "-root-dir", root}, 1, `no published volume "vol9" in the journal`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := runCLI(tc.args...)
			must.Eq(t, tc.code, code)
			must.StrContains(t, errOut, tc.want)
			must.Eq(t, "", out)
			must.Eq(t, tc.code == 2, strings.Contains(errOut, "Usage:"))
		})
	}
	t.Run("no arguments prints usage", func(t *testing.T) {
		code, out, _ := runCLI()
		must.Eq(t, 0, code)
		must.StrHasPrefix(t, "Usage: nomad-driver-csi", out)
	})
}

func TestVolumes(t *testing.T) {
	root := t.TempDir()
	code, out, _ := runCLI("volumes", "-root-dir", root)
	must.Eq(t, 0, code)
	must.StrContains(t, out, "No volumes in the journal")

	m := writeJournal(t, root, map[string][]string{"task-a": {"vol1"}, escTask: {"vol1"}, "task-b": {"vol2"}})
	// The manager holds the journal's lock: volumes reads beside it.
	code, out, errOut := runCLI("volumes", "-root-dir", root)
	must.Eq(t, 0, code, must.Sprint(errOut))
	for _, want := range []string{"Volume vol1 (plugin p)", "Volume vol2 (plugin p)", "Stage", "staged",
		"task-a", "task-b", "published", "/data", `task-\x1b]0;owned\x07\x1b[2J\u202e`} {
		must.StrContains(t, out, want)
	}
	must.StrNotContains(t, out, "\x1b")
	must.StrNotContains(t, out, "\u202e")

	code, out, _ = runCLI("volumes", "-json", "-root-dir", root)
	must.Eq(t, 0, code)
	var v volumesView
	must.NoError(t, json.Unmarshal([]byte(out), &v))
	must.SliceLen(t, 2, v.Volumes)
	must.Eq(t, "vol1", v.Volumes[0].VolumeID)
	must.SliceLen(t, 2, v.Volumes[0].Tasks)
	must.Eq(t, escTask, v.Volumes[0].Tasks[0].TaskID)
	must.Eq(t, "published", v.Volumes[0].Tasks[1].State)
	must.StrNotContains(t, out, "\x1b")
	m.Close()

	// A torn tail (a batch cut short by a crash) is what a log ends in:
	// the records before it still show.
	f, err := os.OpenFile(filepath.Join(driver.JournalDir(root), "journal.log"), os.O_APPEND|os.O_WRONLY, 0)
	must.NoError(t, err)
	_, err = f.Write([]byte{0x00, 0x00, 0x10, 0x00, 'x'})
	must.NoError(t, err)
	must.NoError(t, f.Close())
	code, out, errOut = runCLI("volumes", "-root-dir", root)
	must.Eq(t, 0, code, must.Sprint(errOut))
	must.StrContains(t, out, "Volume vol2 (plugin p)")
}

// testPlugin is a CSI plugin whose answers a test chooses, as a hostile
// job running a plugin would.
type testPlugin struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedNodeServer
	name  string
	stats bool
	mu    sync.Mutex
	asked []*csi.NodeGetVolumeStatsRequest
}

func (p *testPlugin) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: p.name, VendorVersion: "1.0\x1b[31m", Manifest: map[string]string{"k\x1b": "v\r"}}, nil
}

func (p *testPlugin) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{}, nil
}

func (p *testPlugin) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

func (p *testPlugin) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: "n1\x1b[1A"}, nil
}

func (p *testPlugin) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	resp := &csi.NodeGetCapabilitiesResponse{}
	if p.stats {
		resp.Capabilities = append(resp.Capabilities, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{
			Rpc: &csi.NodeServiceCapability_RPC{Type: csi.NodeServiceCapability_RPC_GET_VOLUME_STATS}}})
	}
	return resp, nil
}

func (p *testPlugin) NodeGetVolumeStats(_ context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	p.mu.Lock()
	p.asked = append(p.asked, req)
	p.mu.Unlock()
	return &csi.NodeGetVolumeStatsResponse{
		Usage:           []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: 1000, Used: 400, Available: 600}},
		VolumeCondition: &csi.VolumeCondition{Abnormal: true, Message: "disk \x1b[5mon fire"},
	}, nil
}

// servePlugin serves p at the socket of plugin task id under root.
func servePlugin(t *testing.T, root, id string, p *testPlugin) string {
	t.Helper()
	sock := driver.PluginSocketPath(root, id)
	must.NoError(t, os.MkdirAll(filepath.Dir(sock), 0o700))
	l, err := net.Listen("unix", sock)
	must.NoError(t, err)
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, p)
	csi.RegisterNodeServer(srv, p)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return sock
}

func TestProbe_hostilePlugin(t *testing.T) {
	root := shortDir(t)
	sock := servePlugin(t, root, "p", &testPlugin{name: "evil\x1b]52;c;cm0gLXJmIC8K\x07"})
	for _, arg := range []string{"p", sock} {
		code, out, errOut := runCLI("probe", arg, "-root-dir", root)
		must.Eq(t, 0, code, must.Sprint(errOut))
		must.StrContains(t, out, `evil\x1b]52;c;cm0gLXJmIC8K\x07`)
		must.Eq(t, `n1\x1b[1A`, field(out, "Node ID"))
		must.Eq(t, "true", field(out, "Ready"))
		must.Eq(t, "none", field(out, "Node capabilities"))
		must.StrNotContains(t, out, "\x1b")
		must.StrNotContains(t, out, "\r")
	}
	code, out, _ := runCLI("probe", "-json", "p", "-root-dir", root)
	must.Eq(t, 0, code)
	var v probeView
	must.NoError(t, json.Unmarshal([]byte(out), &v))
	must.Eq(t, "evil\x1b]52;c;cm0gLXJmIC8K\x07", v.Info.Name)
	must.True(t, *v.Ready)
	must.StrNotContains(t, out, "\x1b")
}

// field returns the value of the first line of out starting with key.
func field(out, key string) string {
	for _, line := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

func TestStats(t *testing.T) {
	root := shortDir(t)
	m := writeJournal(t, root, map[string][]string{"task-a": {"vol1"}})
	defer m.Close()
	p := &testPlugin{name: "p"}
	servePlugin(t, root, "p", p)

	code, _, errOut := runCLI("stats", "vol1", "-root-dir", root)
	must.Eq(t, 1, code)
	must.StrContains(t, errOut, `plugin "p" does not offer volume stats (no GET_VOLUME_STATS node capability)`)

	p.stats = true
	code, out, errOut := runCLI("stats", "-root-dir", root, "data")
	must.Eq(t, 0, code, must.Sprint(errOut))
	must.StrContains(t, out, "Volume vol1 (plugin p), task task-a volume data")
	must.StrContains(t, out, "  bytes   1000   400        600")
	must.StrContains(t, out, `Condition ABNORMAL: disk \x1b[5mon fire`)
	must.StrNotContains(t, out, "\x1b")
	p.mu.Lock()
	must.SliceLen(t, 1, p.asked)
	must.Eq(t, "vol1", p.asked[0].GetVolumeId())
	must.Eq(t, filepath.Join(driver.StageRoot(root), "publish", csihook.ShortHash("task-a"), "data"), p.asked[0].GetVolumePath())
	must.StrHasPrefix(t, filepath.Join(driver.StageRoot(root), "staging"), p.asked[0].GetStagingTargetPath())
	p.mu.Unlock()
}

// TestVolumeNames: a volume a job created under its own volume_id is
// listed by that name next to the plugin's id, and stats and expand take
// the name. The same name in two plugins (and namespaces) is refused with
// the candidates listed, until -plugin or -namespace chooses one.
func TestVolumeNames(t *testing.T) {
	root := shortDir(t)
	m := fakeManager(t, root)
	defer m.Close()
	vol := func(plugin, id, ns string, create bool) csihook.VolumeRequest {
		r := csihook.VolumeRequest{Name: "data", PluginID: plugin, VolumeID: id, Destination: "/data", Namespace: ns,
			AccessMode: csihook.AccessSingleNodeWriter, AttachmentMode: csihook.AttachmentFileSystem}
		if create {
			r.Create = &csihook.CreateRequest{}
		}
		return r
	}
	for task, r := range map[string]csihook.VolumeRequest{
		"task-a": vol("p", "acc-hold-1", "default", true),
		"task-b": vol("q", "acc-hold-1", "team-b", true),
		"task-c": vol("p", "pg-data", "default", false),
	} {
		_, err := m.Setup(context.Background(), task, []csihook.VolumeRequest{r})
		must.NoError(t, err)
	}
	// The fake plugin answers CreateVolume with the id "id-<name>".
	code, out, errOut := runCLI("volumes", "-root-dir", root)
	must.Eq(t, 0, code, must.Sprint(errOut))
	for _, want := range []string{"Volume acc-hold-1 (plugin p, plugin's volume ID id-acc-hold-1)",
		"Volume acc-hold-1 (plugin q, plugin's volume ID id-acc-hold-1)", "Volume pg-data (plugin p)"} {
		must.StrContains(t, out, want)
	}
	code, out, _ = runCLI("volumes", "-json", "-root-dir", root)
	must.Eq(t, 0, code)
	var v volumesView
	must.NoError(t, json.Unmarshal([]byte(out), &v))
	must.SliceLen(t, 3, v.Volumes)
	must.Eq(t, []string{"acc-hold-1"}, v.Volumes[0].Names)
	must.Eq(t, "id-acc-hold-1", v.Volumes[0].VolumeID)
	must.Eq(t, "pg-data", v.Volumes[1].VolumeID)
	must.SliceEmpty(t, v.Volumes[1].Names)
	must.Eq(t, "q", v.Volumes[2].PluginID)

	// Ambiguous: both candidates, and how to choose.
	for _, args := range [][]string{{"stats", "acc-hold-1"}, {"expand", "acc-hold-1", "1GiB"}, {"stats", "id-acc-hold-1"}} {
		code, _, errOut = runCLI(append(args, "-root-dir", root)...)
		must.Eq(t, 1, code)
		must.StrContains(t, errOut, fmt.Sprintf(`%q names more than one published volume: `, args[1]))
		must.StrContains(t, errOut, `plugin "p" volume ID "id-acc-hold-1" (created as "acc-hold-1") in namespace "default", volume block "data" of task "task-a"`)
		must.StrContains(t, errOut, `plugin "q" volume ID "id-acc-hold-1" (created as "acc-hold-1") in namespace "team-b", volume block "data" of task "task-b"`)
		must.StrContains(t, errOut, "choose one with -plugin or -namespace")
	}

	q := &testPlugin{name: "q", stats: true}
	servePlugin(t, root, "q", q)
	for _, choose := range [][]string{{"-plugin", "q"}, {"-namespace", "team-b"}} {
		code, out, errOut = runCLI(append([]string{"stats", "acc-hold-1", "-root-dir", root}, choose...)...)
		must.Eq(t, 0, code, must.Sprint(errOut))
		must.StrContains(t, out, "Volume acc-hold-1 (plugin q, plugin's volume ID id-acc-hold-1), task task-b volume data")
	}
	code, out, _ = runCLI("stats", "acc-hold-1", "-plugin", "q", "-json", "-root-dir", root)
	must.Eq(t, 0, code)
	var sv statsView
	must.NoError(t, json.Unmarshal([]byte(out), &sv))
	must.Eq(t, []string{"acc-hold-1"}, sv.Names)
	must.Eq(t, "id-acc-hold-1", sv.VolumeID)
	q.mu.Lock()
	for _, req := range q.asked {
		must.Eq(t, "id-acc-hold-1", req.GetVolumeId()) // the plugin is asked by its own id
	}
	must.SliceLen(t, 3, q.asked)
	q.mu.Unlock()

	// expand resolves the name too (this plugin cannot expand).
	code, _, errOut = runCLI("expand", "acc-hold-1", "1GiB", "-plugin", "q", "-root-dir", root)
	must.Eq(t, 1, code)
	must.StrContains(t, errOut, `plugin "q" cannot expand volumes`)

	// A filter that matches nothing says so.
	code, _, errOut = runCLI("stats", "acc-hold-1", "-plugin", "x", "-namespace", "default", "-root-dir", root)
	must.Eq(t, 1, code)
	must.StrContains(t, errOut, `no published volume "acc-hold-1" of plugin "x" in namespace "default" in the journal`)
	// One name, one volume: no filter needed.
	code, _, errOut = runCLI("stats", "pg-data", "-root-dir", root)
	must.Eq(t, 1, code)
	must.StrContains(t, errOut, `plugin of volume "pg-data"`) // found, but no plugin serves "p" here
}

func TestPrintable(t *testing.T) {
	cases := map[string]string{
		"plain":           "plain",
		"tab\there":       `tab\there`,
		"\x1b[31mred":     `\x1b[31mred`,
		"del\x7f":         `del\x7f`,
		"c1\u009b":        `c1\u009b`,
		"bidi\u202e":      `bidi\u202e`,
		"bad\xffutf8":     `bad\xffutf8`,
		"ok \uFFFD":       "ok \uFFFD",
		"space ok, ünïcö": "space ok, ünïcö",
	}
	for in, want := range cases {
		must.Eq(t, want, Printable(in))
	}
}
