//go:build e2e

package e2e

// Expansion: a service job with a 64 MiB ext4 fixture volume is redeployed
// with create.capacity_min = 128 MiB; the fixture's ControllerExpandVolume
// grows the image (truncate) and its NodeExpandVolume, called on the
// published volume before the task's process takes it, refreshes the loop
// device (losetup -c) and grows the file system with resize2fs (offline
// inside the fixture: this machine's root lacks CAP_SYS_RESOURCE, which
// online resize2fs needs); the new allocation's task sees the new size in
// df. Redeployed again with 64 MiB, the task is refused with an error
// naming the field. Then the operator CLI's expand grows a published
// volume beside the running driver.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

var dfSize = regexp.MustCompile(`SIZE (\d+)`)

// expandRedeploy renders j and submits it under the ID of an existing job,
// so that Nomad sees an update of that job.
func expandRedeploy(t *testing.T, a *Agent, jobID string, j VolJob) {
	t.Helper()
	job, err := a.RenderVolJob(j)
	must.NoError(t, err)
	text, err := os.ReadFile(job.File)
	must.NoError(t, err)
	file := filepath.Join(filepath.Dir(job.File), jobID+"-update.hcl")
	must.NoError(t, os.WriteFile(file, []byte(strings.ReplaceAll(string(text), job.ID, jobID)), 0o600))
	out, err := a.Nomad("job", "run", "-detach", file)
	must.NoError(t, err, must.Sprint(out))
}

// expandNewAlloc waits for an allocation of the job other than those in
// old to reach one of want, and returns it.
func expandNewAlloc(t *testing.T, a *Agent, jobID string, old map[string]bool, want ...string) *Allocation {
	t.Helper()
	deadline := time.Now().Add(volTimeout)
	for time.Now().Before(deadline) {
		allocs, err := a.JobAllocations(jobID)
		if err == nil {
			for _, al := range allocs {
				if !old[al.ID] && (IsTerminal(al.ClientStatus) || al.ClientStatus == StatusRunning) {
					full := a.Allocation(t, al.ID)
					for _, w := range want {
						if al.ClientStatus == w {
							return full
						}
					}
					t.Fatalf("new allocation %s is %s, wanted %v:\n%s", al.ID, al.ClientStatus, want, full.Describe())
				}
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("no new allocation of job %s within %v", jobID, volTimeout)
	return nil
}

func expandLoggedSize(t *testing.T, a *Agent, allocID string) int64 {
	t.Helper()
	out := a.WaitLogs(t, allocID, "t", "SIZE", volTimeout)
	m := dfSize.FindStringSubmatch(out)
	must.SliceLen(t, 2, m, must.Sprintf("no df size in %q", out))
	n, err := strconv.ParseInt(m[1], 10, 64)
	must.NoError(t, err)
	return n
}

func TestVolumeExpand(t *testing.T) {
	t.Parallel()
	a := volAgent(t, false)
	fx := a.StartVolFixture(t, "fxexp", VolFixtureOptions{})

	name := volUniq("expand")
	dest := filepath.Join(volDir(a, name), "data")
	job := func(size string) VolJob {
		return VolJob{Type: "service", Script: fmt.Sprintf("df -k %s | awk 'NR==2 {print \"SIZE\", $2}'; exec sleep 3600", dest),
			Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Access: "single-node-writer",
				Create: true, CreateType: "ext4", CapacityMin: size}}}
	}
	first := a.RunVolJob(t, job("64MiB"))
	al := a.WaitAlloc(t, first.ID, volTimeout, StatusRunning)
	before := expandLoggedSize(t, a, al.ID)
	id := fx.VolumeID(name)
	must.NotEq(t, "", id)

	old := map[string]bool{al.ID: true}
	expandRedeploy(t, a, first.ID, job("128MiB"))
	grown := expandNewAlloc(t, a, first.ID, old, StatusRunning)
	after := expandLoggedSize(t, a, grown.ID)
	t.Logf("df 1K-blocks before %d, after %d; calls: %v", before, after, fx.VolumeCalls(id))
	must.Greater(t, before*18/10, after, must.Sprintf("the task does not see the grown volume: %d then %d 1K-blocks", before, after))
	must.Eq(t, 1, fx.Count("ControllerExpandVolume", id))
	must.Eq(t, 1, fx.Count("NodeExpandVolume", id))
	must.Eq(t, 1, fx.Count("CreateVolume", "name="+name), must.Sprint("CreateVolume called again for the grown volume"))
	events := eventsText(grown, "t")
	must.StrContains(t, events, `Expanding volume "data" from 64 MiB to 128 MiB`)
	must.StrContains(t, events, `Expanded volume "data" to 128 MiB`)

	// Shrinking is refused, naming the field; the volume keeps its size.
	old[grown.ID] = true
	expandRedeploy(t, a, first.ID, job("64MiB"))
	refused := expandNewAlloc(t, a, first.ID, old, StatusFailed)
	must.StrContains(t, eventsText(refused, "t"), `create.capacity_min "64 MiB" (67108864 bytes) is smaller than the "128 MiB" (134217728 bytes) volume`)
	must.Eq(t, 1, fx.Count("ControllerExpandVolume", id))

	// The operator CLI grows a published volume beside the running driver
	// and task. A dir volume: this machine's root lacks CAP_SYS_RESOURCE,
	// so the fixture can grow ext4 only offline, which a running task's
	// mount of it prevents (EBUSY); the fixture's dir volumes record their
	// size.
	dirName := volUniq("expand-cli")
	dirDest := filepath.Join(volDir(a, dirName), "data")
	held := a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper, Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: dirName,
		Dest: dirDest, Access: "single-node-writer", Create: true, CreateType: "dir", CapacityMin: "64MiB"}}})
	a.WaitAlloc(t, held.ID, volTimeout, StatusRunning)
	dirID := fx.VolumeID(dirName)
	out, errOut, err := runDriverCLI(t, a, "expand", dirID, "192MiB", "-root-dir", a.DriverRoot)
	must.NoError(t, err, must.Sprint(errOut))
	t.Logf("expand:\n%s", out)
	must.StrContains(t, out, "Controller: expanded to 192 MiB (201326592 bytes)")
	must.StrContains(t, out, "Raise create.capacity_min of the job to 192 MiB")
	must.Eq(t, 1, fx.Count("ControllerExpandVolume", dirID))
	out, errOut, err = runDriverCLI(t, a, "expand", "-json", dirID, "256MiB", "-root-dir", a.DriverRoot)
	must.NoError(t, err, must.Sprint(errOut))
	var v struct {
		Controller int64 `json:"controller_capacity_bytes"`
	}
	must.NoError(t, json.Unmarshal([]byte(out), &v))
	must.Eq(t, int64(256<<20), v.Controller)
	_, errOut, err = runDriverCLI(t, a, "expand", dirID, "0", "-root-dir", a.DriverRoot)
	must.Error(t, err)
	must.StrContains(t, errOut, `expand: size "0" is not a size above zero`)
}

// The csi-test mock driver (controller EXPAND_VOLUME) takes the driver's
// ControllerExpandVolume for a raised capacity_min, and a smaller one is
// refused before any call. The mock creates no target path, so each task
// fails at publish, after the calls this case looks at.
func TestVolumeExpandK8sMock(t *testing.T) {
	t.Parallel()
	a := volAgent(t, false)
	m := &volMock{id: "k8s-mock-exp", bin: "csi-mock-driver", calls: k8sMockCalls}
	startVolMock(t, a, m)
	name := volUniq("mock-exp")
	dest := filepath.Join(volDir(a, name), "data")
	run := func(size string) *Allocation {
		job := a.RunVolJob(t, VolJob{Script: "echo SHOULD-NOT-RUN", Volumes: []VolSpec{{
			Name: "data", Plugin: m.id, ID: name, Dest: dest, Access: "single-node-writer", Create: true, CapacityMin: size}}})
		return a.WaitAlloc(t, job.ID, volTimeout, StatusFailed)
	}
	first := run("64MiB")
	var volID string
	for _, e := range first.Events("t") {
		if id := e.Details["volume_id"]; id != "" && id != name {
			volID = id
		}
	}
	must.NotEq(t, "", volID, must.Sprint(first.Describe()))

	grown := run("128MiB")
	must.StrContains(t, eventsText(grown, "t"), `Expanding volume "data" from 64 MiB to 128 MiB`, must.Sprint(grown.Describe()))
	calls := volMockMethods(volMockCallsOf(m.calls(t, a, m.allocID), name, volID))
	t.Logf("mock calls for %s: %v", volID, calls)
	must.SliceContains(t, calls, "ControllerExpandVolume")
	creates := 0
	for _, c := range calls {
		if c == "CreateVolume" {
			creates++
		}
	}
	must.Eq(t, 1, creates, must.Sprint("CreateVolume called again for the grown volume"))

	before := len(calls)
	shrunk := run("32MiB")
	must.StrContains(t, eventsText(shrunk, "t"), `create.capacity_min "32 MiB" (33554432 bytes) is smaller than the "128 MiB"`, must.Sprint(shrunk.Describe()))
	must.Eq(t, before, len(volMockCallsOf(m.calls(t, a, m.allocID), name, volID)), must.Sprint("a call was made for the refused shrink"))
}
