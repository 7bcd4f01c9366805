//go:build e2e

package e2e

// Third-party CSI plugins on the volume path: csi-test's mock driver
// (controller publish, stage and publish) and gocsi's mock (controller
// publish and publish, no stage), each run as a plugin task of the driver,
// give a workload task a driver-managed volume that they create. Both
// mocks answer every node call with success but mount nothing and make no
// target (they keep what they were asked in memory), so what the driver
// does with them is: create, attach, stage and publish with the arguments
// the CSI spec gives, find no target to bind into the task, refuse to
// start the task naming that target, and undo every step in reverse. The
// checks read the calls each mock logs (csi-test prints every call as
// JSON on stdout; gocsi logs requests on stderr with X_CSI_REQ_LOGGING),
// and check that nothing is left: no process, no mount, no directory, no
// journal record.

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// volMock is one third-party mock run as a plugin task.
type volMock struct {
	id      string // plugin id
	bin     string // build/csi/<bin>
	allocID string
	// calls parses what the mock logged of its calls.
	calls func(t *testing.T, a *Agent, allocID string) []volMockCall
}

// volMockCall is one call a mock logged: its method (without the service)
// and the request's volume id (or name, for CreateVolume) and paths.
type volMockCall struct {
	Method, Volume, Staging, Target, Device string
}

func (c volMockCall) String() string { return c.Method + " " + c.Volume }

// startVolMock runs a mock as a monolith plugin task (job volume_plugin,
// so that the final check stops it after the workloads) with request
// logging on, and waits until the node says it is healthy.
func startVolMock(t *testing.T, a *Agent, m *volMock) {
	t.Helper()
	job := a.RunJob(t, "volume_plugin", map[string]string{
		"PluginID":     m.id,
		"PluginType":   "monolith",
		"Command":      "/usr/bin/env",
		"Args":         volHCLList([]string{"X_CSI_REQ_LOGGING=true", csiBin(t, m.bin)}),
		"RestartDelay": "1s",
		"Memory":       "128",
	})
	m.allocID = a.WaitAlloc(t, job.ID, time.Minute, StatusRunning).ID
	a.WaitVolPluginHealthy(t, m.id, time.Minute)
}

// k8sMockCalls parses csi-test's mock driver's stdout: one
// "gRPCCall: {json}" line per call.
func k8sMockCalls(t *testing.T, a *Agent, allocID string) []volMockCall {
	t.Helper()
	var out []volMockCall
	for _, line := range strings.Split(a.AllocLogs(t, allocID, "plugin", false), "\n") {
		_, js, ok := strings.Cut(line, "gRPCCall: ")
		if !ok {
			continue
		}
		var c struct {
			Method  string
			Request struct {
				Name           string            `json:"name"`
				VolumeID       string            `json:"volume_id"`
				Staging        string            `json:"staging_target_path"`
				Target         string            `json:"target_path"`
				PublishContext map[string]string `json:"publish_context"`
			}
		}
		must.NoError(t, json.Unmarshal([]byte(js), &c), must.Sprintf("csi-test mock call line %q", line))
		vol := c.Request.VolumeID
		if vol == "" {
			vol = c.Request.Name
		}
		out = append(out, volMockCall{Method: c.Method[strings.LastIndex(c.Method, "/")+1:], Volume: vol,
			Staging: c.Request.Staging, Target: c.Request.Target, Device: c.Request.PublishContext["device"]})
	}
	return out
}

var (
	gocsiReqLine = regexp.MustCompile(`msg="/csi\.v1\.\w+/(\w+): REQ \d+(?:: (.*))?"`)
	gocsiField   = regexp.MustCompile(`(\w+)=([^,\s]*)`)
)

// gocsiMockCalls parses the request lines gocsi's mock logs on stderr:
// msg="/csi.v1.Node/NodePublishVolume: REQ 0011: VolumeId=4, ...".
func gocsiMockCalls(t *testing.T, a *Agent, allocID string) []volMockCall {
	t.Helper()
	var out []volMockCall
	for _, line := range strings.Split(a.AllocLogs(t, allocID, "plugin", true), "\n") {
		m := gocsiReqLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		f := map[string]string{}
		for _, kv := range gocsiField.FindAllStringSubmatch(m[2], -1) {
			if _, seen := f[kv[1]]; !seen {
				f[kv[1]] = kv[2]
			}
		}
		vol := f["VolumeId"]
		if vol == "" {
			vol = f["Name"]
		}
		dev := ""
		if i := strings.Index(m[2], "PublishContext=map[device:"); i >= 0 {
			dev, _, _ = strings.Cut(m[2][i+len("PublishContext=map[device:"):], "]")
		}
		out = append(out, volMockCall{Method: m[1], Volume: vol, Staging: f["StagingTargetPath"], Target: f["TargetPath"], Device: dev})
	}
	return out
}

// volMockCallsOf keeps the volume calls for a volume id (and
// CreateVolume for its name), without the identity and probe calls.
func volMockCallsOf(calls []volMockCall, name, volID string) []volMockCall {
	var out []volMockCall
	for _, c := range calls {
		if (c.Method == "CreateVolume" && c.Volume == name) || (c.Method != "CreateVolume" && c.Volume == volID) {
			out = append(out, c)
		}
	}
	return out
}

func volMockMethods(calls []volMockCall) []string {
	out := make([]string, len(calls))
	for i, c := range calls {
		out[i] = c.Method
	}
	return out
}

// testVolumeMock runs one mock and a workload with a volume it creates.
func testVolumeMock(t *testing.T, a *Agent, m *volMock, want []string) {
	start := time.Now()
	startVolMock(t, a, m)
	name := volUniq(m.id)
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{Script: "echo SHOULD-NOT-RUN", Volumes: []VolSpec{{
		Name: "data", Plugin: m.id, ID: name, Dest: dest, Access: "single-node-writer", Create: true}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusFailed)
	text := eventsText(al, "t")

	// The volume's id as the mock made it, from the driver's events.
	var volID string
	for _, e := range al.Events("t") {
		if id := e.Details["volume_id"]; id != "" && id != name {
			volID = id
		}
	}
	must.NotEq(t, "", volID, must.Sprintf("no event names the volume id %s gave the volume:\n%s", m.id, al.Describe()))

	// What the mock was asked, in order: the lifecycle forward, then in
	// reverse once the task could not start.
	calls := volMockCallsOf(m.calls(t, a, m.allocID), name, volID)
	must.Eq(t, want, volMockMethods(calls), must.Sprintf("calls of %s for volume %s: %v", m.id, volID, calls))
	stageRoot := filepath.Join(a.DriverRoot, "mnt")
	var target, staging string
	for _, c := range calls {
		switch c.Method {
		case "NodeStageVolume":
			staging = c.Staging
			must.Eq(t, "/dev/mock", c.Device, must.Sprint("NodeStageVolume without the publish context ControllerPublishVolume gave"))
		case "NodePublishVolume":
			target = c.Target
			must.Eq(t, staging, c.Staging, must.Sprint("NodePublishVolume names another staging path than NodeStageVolume"))
			must.Eq(t, "/dev/mock", c.Device, must.Sprint("NodePublishVolume without the publish context ControllerPublishVolume gave"))
		case "NodeUnpublishVolume":
			must.Eq(t, target, c.Target)
		case "NodeUnstageVolume":
			must.Eq(t, staging, c.Staging)
		}
	}
	must.True(t, strings.HasPrefix(target, stageRoot+"/publish/"), must.Sprintf("target %q is not below %s/publish", target, stageRoot))
	if staging != "" {
		must.True(t, strings.HasPrefix(staging, stageRoot+"/staging/"), must.Sprintf("staging path %q is not below %s/staging", staging, stageRoot))
	}

	// The mock made no target: the task never started, and its failure
	// says the plugin published nothing and names the target it was asked
	// to make.
	for _, e := range al.Events("t") {
		must.NotEq(t, "Started", e.Type, must.Sprintf("the task started without its volume:\n%s", text))
	}
	must.SliceEmpty(t, TaskPIDs(al.ID, "t"), must.Sprint("the refused task has processes"))
	must.StrContains(t, volDriverError(al), target, must.Sprintf("the failure does not name the target:\n%s", text))
	must.StrContains(t, volDriverError(al), "did not create the target path", must.Sprintf("the failure does not say the plugin published nothing:\n%s", text))

	// Nothing is left: no journal record, no mount, no directory of the
	// volume under root_dir.
	must.SliceEmpty(t, a.WaitVolJournalClear(10*time.Second, volID), must.Sprint("journal records left"))
	// Only the paths this volume had: an empty one (gocsi's mock does not
	// stage) would match every mount, other subtests' among them.
	paths := []string{target}
	if staging != "" {
		paths = append(paths, staging)
	}
	must.SliceEmpty(t, a.WaitVolMountsGone(10*time.Second, paths...), must.Sprint("mounts left"))
	for _, p := range []string{target, staging, filepath.Dir(target)} {
		if p == "" || p == "." {
			continue
		}
		must.False(t, volExists(t, p), must.Sprintf("%s is left on the host", p))
	}
	t.Logf("%s: %v; calls for volume %s: %v; task failure: %s", m.id, time.Since(start).Round(time.Millisecond), volID,
		volMockMethods(calls), volDriverError(al))
}

// volExists tells whether path exists; an error other than "does not
// exist" fails the test.
func volExists(t *testing.T, path string) bool {
	t.Helper()
	_, err := os.Lstat(path)
	if err == nil {
		return true
	}
	must.True(t, os.IsNotExist(err), must.Sprintf("stat %s: %v", path, err))
	return false
}

// csi-test's mock driver: attach (its node id), stage, publish.
func testVolumeK8sMock(t *testing.T, a *Agent) {
	testVolumeMock(t, a, &volMock{id: "k8s-mock", bin: "csi-mock-driver", calls: k8sMockCalls},
		[]string{"CreateVolume", "ControllerPublishVolume", "NodeStageVolume", "NodePublishVolume",
			"NodeUnpublishVolume", "NodeUnstageVolume", "ControllerUnpublishVolume"})
}

// gocsi's mock: attach, then publish with the device ControllerPublish
// gave (it has no stage).
func testVolumeGocsiMock(t *testing.T, a *Agent) {
	testVolumeMock(t, a, &volMock{id: "gocsi-mock", bin: "gocsi-mock", calls: gocsiMockCalls},
		[]string{"CreateVolume", "ControllerPublishVolume", "NodePublishVolume",
			"NodeUnpublishVolume", "ControllerUnpublishVolume"})
}
