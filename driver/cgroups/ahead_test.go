package cgroups

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

var allV1Devices = append(append([]string(nil), allV1...), "devices")

// groupFiles reads every file of g's directories, by controller and name.
func groupFiles(t *testing.T, g *Group) map[string]string {
	t.Helper()
	out := map[string]string{}
	for ctrl, dir := range g.paths {
		entries, err := os.ReadDir(dir)
		must.NoError(t, err)
		for _, e := range entries {
			if !e.IsDir() {
				out[ctrl+"/"+e.Name()] = readFake(t, filepath.Join(dir, e.Name()))
			}
		}
	}
	return out
}

// A group made ahead and claimed is the group Create makes for the task:
// the same directories under the task's name, the same files with the
// same limits; its own name is gone from every hierarchy.
func TestAhead_ClaimIsCreate(t *testing.T) {
	ahead := Limits{Devices: DefaultDevices, PidsMax: 100}
	cases := []struct {
		name string
		l    Limits
	}{
		{"the limits made ahead", ahead},
		{"every limit", Limits{MemoryBytes: 512 << 20, MemoryReservationBytes: 256 << 20, CPUShares: 500,
			CPUQuota: 20000, CPUPeriod: 50000, PidsMax: 7, Devices: append([]DeviceRule{{Type: 'b', Major: 8, Minor: 0, Access: "r"}}, DefaultDevices...)}},
		{"no pids limit", Limits{Devices: DefaultDevices, MemoryBytes: 1 << 30}},
		{"nomad's cpuset group", Limits{Devices: DefaultDevices, CpusetCpus: "1", CpusetCgroupPath: "/sys/fs/cgroup/cpuset/nomad/share"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := fakeV1(t, allV1Devices)
			if tc.l.CpusetCgroupPath != "" {
				// Nomad's group, outside the fake tree's parent.
				nomad := filepath.Join(h.root, "cpuset", "nomad", "share")
				must.NoError(t, os.MkdirAll(nomad, 0o755))
				writeFiles(t, nomad, map[string]string{"cpuset.cpus": "", "cpuset.mems": "0"})
				tc.l.CpusetCgroupPath = nomad
			}
			a, err := h.createAhead("nomad/csi", "spare-1", ahead)
			must.NoError(t, err)
			spareDirs := a.Dirs()
			g, err := a.Claim("nomad/csi", "task1", tc.l)
			must.NoError(t, err)
			want, err := h.create("nomad/csi", "task2", tc.l)
			must.NoError(t, err)

			must.Eq(t, len(want.paths), len(g.paths))
			for ctrl, dir := range want.paths {
				must.Eq(t, strings.TrimSuffix(dir, "task2")+"task1", g.paths[ctrl])
			}
			must.Eq(t, groupFiles(t, want), groupFiles(t, g))
			must.Eq(t, want.State().CpusetCgroupPath, g.State().CpusetCgroupPath)
			must.Eq(t, want.mounts, g.mounts)
			for _, dir := range spareDirs {
				_, err := os.Stat(dir)
				must.True(t, os.IsNotExist(err), must.Sprintf("%s is left", dir))
			}
			// Nothing is left for Destroy of the Ahead, and the group is the
			// task's now.
			must.NoError(t, a.Destroy())
			for _, dir := range g.dirs() {
				must.DirExists(t, dir)
			}
			must.NoError(t, g.Destroy())
			_, err = a.Claim("nomad/csi", "task3", tc.l)
			must.ErrorContains(t, err, "claimed already")
		})
	}
}

// A limit that is the same as the one made ahead is not written again: a
// claim writes only what differs.
func TestAhead_ClaimWritesWhatDiffers(t *testing.T) {
	h := fakeV1(t, allV1Devices)
	ahead := Limits{Devices: DefaultDevices, PidsMax: 100, CPUShares: 300}
	a, err := h.createAhead("p", "spare-1", ahead)
	must.NoError(t, err)
	// Marks where the kernel's value stands: a write would replace it.
	for _, f := range []string{"pids/pids.max", "cpu/cpu.shares", "memory/memory.limit_in_bytes", "devices/devices.allow"} {
		ctrl, name, _ := strings.Cut(f, "/")
		writeFiles(t, a.g.paths[ctrl], map[string]string{name: "unwritten"})
	}
	g, err := a.Claim("p", "task", Limits{Devices: DefaultDevices, PidsMax: 100, CPUShares: 300, MemoryBytes: 1 << 20})
	must.NoError(t, err)
	files := groupFiles(t, g)
	must.Eq(t, "unwritten", files["pids/pids.max"])
	must.Eq(t, "unwritten", files["cpu/cpu.shares"])
	must.Eq(t, "unwritten", files["devices/devices.allow"])
	must.Eq(t, "1048576", files["memory/memory.limit_in_bytes"])
}

// A task the group made ahead cannot serve gets ErrUnfit, and the group
// stays as it was, for Destroy.
func TestAhead_Unfit(t *testing.T) {
	cases := []struct {
		name   string
		parent string
		l      Limits
		setup  func(t *testing.T, h *hierarchy)
		why    string
	}{
		{name: "another parent", parent: "q", l: Limits{Devices: DefaultDevices}, why: `made under "p"`},
		{name: "no device filter", parent: "p", l: Limits{}, why: "device filter"},
		{name: "a cpuset of its own", parent: "p", l: Limits{Devices: DefaultDevices, CpusetCpus: "0"}, why: "cpuset group of its own"},
		{name: "a group of that name exists", parent: "p", l: Limits{Devices: DefaultDevices},
			setup: func(t *testing.T, h *hierarchy) {
				must.NoError(t, os.MkdirAll(filepath.Join(h.root, "pids", "p", "task"), 0o755))
			}, why: "exists"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := fakeV1(t, allV1Devices)
			a, err := h.createAhead("p", "spare-1", Limits{Devices: DefaultDevices})
			must.NoError(t, err)
			before := groupFiles(t, a.g)
			if tc.setup != nil {
				tc.setup(t, h)
			}
			_, err = a.Claim(tc.parent, "task", tc.l)
			must.ErrorIs(t, err, ErrUnfit)
			must.ErrorContains(t, err, tc.why)
			must.Eq(t, before, groupFiles(t, a.g))
			dirs := a.Dirs()
			must.NoError(t, a.Destroy())
			for _, dir := range dirs {
				_, err := os.Stat(dir)
				must.True(t, os.IsNotExist(err), must.Sprintf("%s is left", dir))
			}
		})
	}
}

// A claim that fails after the renames began (a limit the kernel refuses)
// leaves nothing: not the group made ahead, not the task's.
func TestAhead_ClaimFailsLeavesNothing(t *testing.T) {
	h := fakeV1(t, allV1Devices)
	a, err := h.createAhead("p", "spare-1", Limits{Devices: DefaultDevices})
	must.NoError(t, err)
	dirs := a.Dirs()
	// The memory limit cannot be written: its file is gone.
	must.NoError(t, os.Remove(filepath.Join(a.g.paths["memory"], "memory.limit_in_bytes")))
	_, err = a.Claim("p", "task", Limits{Devices: DefaultDevices, MemoryBytes: 1 << 20})
	must.ErrorContains(t, err, "memory.limit_in_bytes")
	must.False(t, errors.Is(err, ErrUnfit))
	for _, dir := range dirs {
		for _, d := range []string{dir, filepath.Join(filepath.Dir(dir), "task")} {
			_, err := os.Stat(d)
			must.True(t, os.IsNotExist(err), must.Sprintf("%s is left", d))
		}
	}
	must.NoError(t, a.Destroy())
}

// Controllers mounted together share one directory, renamed once.
func TestAhead_CoMounted(t *testing.T) {
	h, both := fakeV1CoMounted(t, "memory", "pids", "freezer", "devices")
	a, err := h.createAhead("p", "spare-1", Limits{Devices: DefaultDevices})
	must.NoError(t, err)
	g, err := a.Claim("p", "t", Limits{Devices: DefaultDevices, CPUShares: 100})
	must.NoError(t, err)
	must.Eq(t, "100", readFake(t, filepath.Join(both, "p", "t", "cpu.shares")))
	must.Eq(t, filepath.Join(h.root, "cpu", "p", "t"), g.paths["cpu"])
	must.Eq(t, filepath.Join(h.root, "cpuacct", "p", "t"), g.paths["cpuacct"])
	gone(t, filepath.Join(both, "p", "spare-1"))
	must.NoError(t, g.Destroy())
	gone(t, filepath.Join(both, "p", "t"), filepath.Join(h.root, "memory", "p", "t"))
}

// On cgroup v2 nothing is made ahead, and a cpuset is never made ahead.
func TestAhead_NotMade(t *testing.T) {
	_, err := fakeV2(t, "cpuset cpu io memory pids").createAhead("p", "spare-1", Limits{})
	must.ErrorContains(t, err, "cgroup v1 only")
	h := fakeV1(t, allV1Devices)
	_, err = h.createAhead("p", "spare-1", Limits{CpusetCpus: "0"})
	must.ErrorContains(t, err, "no cpuset")
	_, err = os.Stat(filepath.Join(h.root, "memory", "p", "spare-1"))
	must.True(t, os.IsNotExist(err))
}

// aheadPairs are groups made ahead with the limits of one task and claimed
// by another (a spare makes its group with the limits of the last task that
// started): every change of every limit, each way. A claim writes only the
// limits that differ, and must leave what Create writes for the task: no
// more memory, processes, devices or CPU time than the task's own.
var aheadPairs = func() []struct {
	name        string
	ahead, task Limits
} {
	blk := DeviceRule{Type: 'b', Major: 8, Minor: 0, Access: "rwm"}
	d := DefaultDevices
	every := Limits{MemoryBytes: 96 << 20, MemoryReservationBytes: 48 << 20, CPUShares: 300, CPUQuota: 50000, CPUPeriod: 100000,
		PidsMax: 50, Devices: append(slices.Clone(d), blk)}
	return []struct {
		name        string
		ahead, task Limits
	}{
		{"the same limits", every, every},
		{"every limit to none", every, Limits{Devices: d}},
		{"none to every limit", Limits{Devices: d}, every},
		{"memory raised", Limits{Devices: d, MemoryBytes: 64 << 20}, Limits{Devices: d, MemoryBytes: 128 << 20}},
		{"memory lowered", Limits{Devices: d, MemoryBytes: 128 << 20}, Limits{Devices: d, MemoryBytes: 64 << 20}},
		{"memory to none, the soft limit kept", Limits{Devices: d, MemoryBytes: 128 << 20, MemoryReservationBytes: 64 << 20},
			Limits{Devices: d, MemoryReservationBytes: 64 << 20}},
		{"the soft limit to none", Limits{Devices: d, MemoryBytes: 128 << 20, MemoryReservationBytes: 64 << 20},
			Limits{Devices: d, MemoryBytes: 128 << 20}},
		{"a soft limit", Limits{Devices: d, MemoryBytes: 128 << 20}, Limits{Devices: d, MemoryBytes: 128 << 20, MemoryReservationBytes: 32 << 20}},
		{"shares to none", Limits{Devices: d, CPUShares: 300}, Limits{Devices: d}},
		{"shares clamped alike", Limits{Devices: d, CPUShares: 1}, Limits{Devices: d, CPUShares: 2}},
		{"shares above the kernel's", Limits{Devices: d, CPUShares: 100}, Limits{Devices: d, CPUShares: 300000}},
		{"a quota to none", Limits{Devices: d, CPUQuota: 50000, CPUPeriod: 100000}, Limits{Devices: d}},
		{"a quota to none, the same period", Limits{Devices: d, CPUQuota: 50000, CPUPeriod: 100000}, Limits{Devices: d, CPUPeriod: 100000}},
		{"a quota raised, the same period", Limits{Devices: d, CPUQuota: 20000, CPUPeriod: 100000}, Limits{Devices: d, CPUQuota: 50000, CPUPeriod: 100000}},
		{"a quota where there was none", Limits{Devices: d}, Limits{Devices: d, CPUQuota: 50000}},
		{"a quota, the period left to the default", Limits{Devices: d, CPUQuota: 50000, CPUPeriod: 20000}, Limits{Devices: d, CPUQuota: 50000}},
		{"a looser quota over a shorter period", Limits{Devices: d, CPUQuota: 20000, CPUPeriod: 100000},
			Limits{Devices: d, CPUQuota: 10000, CPUPeriod: 10000}},
		{"a shorter period", Limits{Devices: d, CPUQuota: 200000, CPUPeriod: 100000}, Limits{Devices: d, CPUQuota: 10000, CPUPeriod: 10000}},
		{"a tighter quota over a longer period", Limits{Devices: d, CPUQuota: 10000, CPUPeriod: 10000},
			Limits{Devices: d, CPUQuota: 20000, CPUPeriod: 100000}},
		{"pids to none", Limits{Devices: d, PidsMax: 100}, Limits{Devices: d}},
		{"none to pids", Limits{Devices: d}, Limits{Devices: d, PidsMax: 100}},
		{"a device rule more than the task's", Limits{Devices: append(slices.Clone(d), blk)}, Limits{Devices: d}},
		{"a device rule the task has more", Limits{Devices: d}, Limits{Devices: append(slices.Clone(d), blk)}},
		{"device rules in another order", Limits{Devices: slices.Concat(d[4:], d[:4])}, Limits{Devices: d}},
		{"a device rule twice", Limits{Devices: append(slices.Clone(d), d[0])}, Limits{Devices: d}},
		{"a device's access wider", Limits{Devices: append(slices.Clone(d), DeviceRule{Type: 'b', Major: 8, Minor: 0, Access: "r"})},
			Limits{Devices: append(slices.Clone(d), blk)}},
		{"a device's access narrower", Limits{Devices: append(slices.Clone(d), blk)},
			Limits{Devices: append(slices.Clone(d), DeviceRule{Type: 'b', Major: 8, Minor: 0, Access: "r"})}},
		{"every device to none", Limits{Devices: d}, Limits{Devices: []DeviceRule{}}},
		{"no device to every default one", Limits{Devices: []DeviceRule{}}, Limits{Devices: d}},
	}
}()

// A group made ahead with one task's limits and claimed by another has the
// files a group Create makes for the second task has, with and without
// swap accounting. The fake tree keeps only the last rule written to
// devices.allow (the kernel adds each to devices.list, and a write of "a"
// to devices.deny clears it), so the device rules are checked as written:
// every one of the task's after a deny of every device, unless the group
// was made with the task's very rules (TestHost_AheadFromAnyLimits reads
// the kernel's list).
func TestAhead_ClaimIsCreateFromAnyLimits(t *testing.T) {
	for _, swap := range []bool{true, false} {
		for _, tc := range aheadPairs {
			t.Run(fmt.Sprintf("%s, swap accounted %t", tc.name, swap), func(t *testing.T) {
				var skip []string
				if !swap {
					skip = []string{"memory.memsw.limit_in_bytes"}
				}
				h := fakeV1(t, allV1Devices, skip...)
				a, err := h.createAhead("p", "spare-1", tc.ahead)
				must.NoError(t, err)
				writeFiles(t, a.g.paths["devices"], map[string]string{"devices.deny": "unwritten", "devices.allow": "unwritten"})
				g, err := a.Claim("p", "task", tc.task)
				must.NoError(t, err)
				want, err := h.create("p", "made", tc.task)
				must.NoError(t, err)
				got, exp := groupFiles(t, g), groupFiles(t, want)
				wantDeny, wantAllow := "unwritten", "unwritten"
				if !slices.Equal(tc.ahead.Devices, tc.task.Devices) {
					wantDeny = "a"
					if n := len(tc.task.Devices); n > 0 {
						wantAllow = tc.task.Devices[n-1].String()
					}
				}
				must.Eq(t, wantDeny, got["devices/devices.deny"], must.Sprint("devices.deny"))
				must.Eq(t, wantAllow, got["devices/devices.allow"], must.Sprint("devices.allow"))
				for _, f := range []string{"devices/devices.deny", "devices/devices.allow"} {
					delete(got, f)
					delete(exp, f)
				}
				must.Eq(t, exp, got)
			})
		}
	}
}
