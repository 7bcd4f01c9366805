//go:build e2e

package e2e

// The cases that need a production-shaped host: systemd as PID 1, the
// unified cgroup v2 hierarchy with Nomad's controllers (cpuset cpu io
// memory pids) and / shared. make e2e-vm boots one (a Debian 12 guest under
// qemu, e2e/vm/) and runs them there with E2E_VM=1, where a host of
// another shape fails them; elsewhere they are skipped, saying why.

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/nomad/api"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// nomadControllers are the controllers Nomad enables for its tasks on v2.
var nomadControllers = []string{"cpuset", "cpu", "io", "memory", "pids"}

// productionHost says what this host lacks of a production-shaped one
// (nothing when it is one).
func productionHost() []string {
	var missing []string
	if err := SystemdRunning(); err != nil {
		missing = append(missing, err.Error())
	}
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &st); err != nil || st.Type != unix.CGROUP2_SUPER_MAGIC {
		missing = append(missing, "/sys/fs/cgroup is not the unified cgroup v2 hierarchy")
	} else {
		b, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers")
		have := strings.Fields(string(b))
		for _, c := range nomadControllers {
			if err != nil || !slices.Contains(have, c) {
				missing = append(missing, fmt.Sprintf("the cgroup v2 root offers no %s controller (it offers %v)", c, have))
			}
		}
	}
	mounts, err := mounter.New().List()
	if err != nil {
		missing = append(missing, fmt.Sprintf("the mount table cannot be read: %v", err))
	} else if root, ok := mounter.FindMount(mounts, "/"); !ok || !root.Shared {
		missing = append(missing, "/ is not a shared mount")
	}
	return missing
}

// needProductionHost skips the case on a host of another shape, and fails
// it in make e2e-vm's guest (E2E_VM=1), which must be one.
func needProductionHost(t *testing.T) {
	t.Helper()
	requireCSI(t)
	missing := productionHost()
	if len(missing) == 0 {
		return
	}
	if os.Getenv("E2E_VM") != "" {
		t.Fatalf("the guest is not the host these cases need: %s", strings.Join(missing, "; "))
	}
	t.Skipf("needs a production-shaped host, which make e2e-vm boots: %s", strings.Join(missing, "; "))
}

// procCgroupV2 is the cgroup v2 path of a process ("/a/b.scope").
func procCgroupV2(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	must.NoError(t, err)
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			return p
		}
	}
	t.Fatalf("pid %d has no cgroup v2 line in /proc/%d/cgroup:\n%s", pid, pid, b)
	return ""
}

// cgroupFile reads a file of a v2 group (path as in /proc/PID/cgroup).
func cgroupFile(t *testing.T, group, file string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", group, file))
	must.NoError(t, err)
	return strings.TrimSpace(string(b))
}

// cpuList expands a cpuset list ("0-2,4") into its CPUs.
func cpuList(t *testing.T, s string) []int {
	t.Helper()
	var out []int
	for _, part := range strings.Split(s, ",") {
		if part == "" {
			continue
		}
		lo, hi, found := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		must.NoError(t, err, must.Sprintf("cpu list %q", s))
		b := a
		if found {
			b, err = strconv.Atoi(hi)
			must.NoError(t, err, must.Sprintf("cpu list %q", s))
		}
		for c := a; c <= b; c++ {
			out = append(out, c)
		}
	}
	return out
}

// TestVMHost checks the guest is what the other cases need, and that
// nothing had to be done to it for them: / was shared by systemd, not by
// a "mount --make-rshared /".
func TestVMHost(t *testing.T) {
	needProductionHost(t)
	var u unix.Utsname
	must.NoError(t, unix.Uname(&u))
	b, err := os.ReadFile("/proc/1/comm")
	must.NoError(t, err)
	t.Logf("Linux %s, PID 1 %s, controllers %s", unix.ByteSliceToString(u.Release[:]), strings.TrimSpace(string(b)),
		cgroupFile(t, "/", "cgroup.controllers"))
	must.Eq(t, "systemd", strings.TrimSpace(string(b)))
	must.NoError(t, mounter.KernelSupport())
}

// The agent as a systemd unit made from examples/systemd/nomad-client.service,
// restarted with "systemctl restart" while a task holds a volume from a
// plugin task: the task, its process and its volume's mounts stay, the
// driver takes them back, and nothing is left once they stop. The plugin's
// mounts reach the agent's view of the host through / as systemd shares
// it, and the driver says nothing about "mount --make-rshared".
func TestVMSystemdRestart(t *testing.T) {
	needProductionHost(t)
	t.Parallel()
	a := volAgentWith(t, AgentOptions{AllowPrivileged: true, Persistent: true, Systemd: true})
	unit := a.client.unit
	must.NotEq(t, "", unit, must.Sprint("the agent is not a systemd unit"))
	for prop, want := range map[string]string{"Delegate": "yes", "KillMode": "process", "KillSignal": strconv.Itoa(int(unix.SIGINT))} {
		must.Eq(t, want, unitProperty(unit, prop), must.Sprintf("%s of unit %s", prop, unit))
	}
	unitGroup := unitProperty(unit, "ControlGroup")
	must.NotEq(t, "", unitGroup)

	fx := a.StartVolFixture(t, "fixture", VolFixtureOptions{})
	name := volUniq("systemd")
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{Type: "service",
		Script:  fmt.Sprintf("echo before-%s > %s/f && %s", name, dest, volSleeper),
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Create: true, CreateType: "ext4"}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "started", volTimeout)
	pids := TaskPIDs(al.ID, "t")
	must.SliceNotEmpty(t, pids)

	// The task runs in the group Nomad laid out for it, outside the
	// agent's unit, where systemd's stop and restart do not reach.
	group := procCgroupV2(t, pids[0])
	must.Eq(t, NomadTaskCgroup(al.ID, "t", false), group)
	must.False(t, strings.HasPrefix(group, unitGroup+"/"), must.Sprintf("the task is in the agent's unit %s", unitGroup))

	// The plugin staged and published the volume in its own mount
	// namespace; the host sees both mounts.
	volID := fx.VolumeID(name)
	paths := a.VolJournalPaths(volID)
	must.SliceLen(t, 2, paths, must.Sprintf("journal paths of volume %s", volID))
	stageRoot := filepath.Join(a.DriverRoot, "mnt")
	before := volMountIDs(t, stageRoot)
	for _, p := range paths {
		must.MapContainsKey(t, before, p, must.Sprintf("the host does not see the plugin's mount %s", p))
	}

	old := a.PID()
	restartAt := time.Now()
	must.NoError(t, a.Restart())
	must.NotEq(t, old, a.PID(), must.Sprint("systemctl restart kept the agent's process"))
	t.Logf("systemctl restart %s: agent pid %d, then %d, ready in %v", unit, old, a.PID(), time.Since(restartAt).Round(time.Millisecond))
	volWaitRecovered(t, a, []string{al.ID}, volTimeout)
	al = a.WaitAllocID(t, al.ID, volTimeout, StatusRunning)
	must.Eq(t, uint64(0), al.Task("t").Restarts, must.Sprint(al.Describe()))
	must.Eq(t, pids, TaskPIDs(al.ID, "t"), must.Sprint("the task's processes changed across the restart"))
	must.StrContains(t, volExec(t, a, al.ID, "cat "+dest+"/f && echo after > "+dest+"/g && cat "+dest+"/g"), "before-"+name+"\nafter")
	must.Eq(t, before, volMountIDs(t, stageRoot), must.Sprint("the volume's mounts changed across the restart"))

	log, err := a.ReadLog()
	must.NoError(t, err)
	must.StrNotContains(t, log, "make-rshared", must.Sprint("the driver asked for mount --make-rshared on a host whose / systemd shares"))

	a.VolStopAndWait(t, job.ID, volTimeout)
	must.SliceEmpty(t, a.WaitVolMountsGone(Scaled(10*time.Second)), must.Sprint("mounted after the task stopped"))
	must.SliceEmpty(t, VolMountedAmong(paths))
}

// The resources of tasks on cgroup v2 with every controller, in the groups
// Nomad laid out: memory_max above memory (oversubscription) with memory.low
// at memory, CPU weight from cpu, the pids limit, reserved cores in
// Nomad's reserve partition and kept from the shared tasks, and the usage
// "nomad alloc status" shows.
//
// Not parallel: Nomad 1.11 lays out its tasks' groups in /nomad.slice
// whatever the client's cgroup_parent, so the agents of the other cases
// share its partitions, and a client that restores its allocations
// rewrites the reserve partition's CPUs as if its own tasks were all
// there is (ENOSPC while this case's task holds a reserved core). A node
// has one client; the cases run alone here, before the parallel ones.
func TestVMCgroupV2(t *testing.T) {
	needProductionHost(t)
	a := shared(t)
	out, err := a.Nomad("operator", "scheduler", "set-config", "-memory-oversubscription=true")
	must.NoError(t, err, must.Sprint(out))

	job := a.RunJob(t, "vm-resources", vars())
	t.Cleanup(func() { a.stopJobs([]string{job.ID}, Scaled(60*time.Second)) })
	al := a.WaitAlloc(t, job.ID, startTimeout, StatusRunning)
	for _, task := range []string{"over", "cores", "busy"} {
		a.WaitLogs(t, al.ID, task, "ready", 60*time.Second)
	}
	// Twice its memory (32 MB), under its memory_max (256 MB): alive.
	must.StrContains(t, a.AllocLogs(t, al.ID, "over", false), "ready holding 64000000 bytes")

	groups := map[string]string{}
	for _, task := range []string{"over", "cores", "busy"} {
		pid, err := TaskPIDByComm(al.ID, task, "sleep")
		if task == "busy" {
			pid, err = TaskPIDByComm(al.ID, task, "sh")
		}
		must.NoError(t, err)
		groups[task] = procCgroupV2(t, pid)
	}
	must.Eq(t, NomadTaskCgroup(al.ID, "over", false), groups["over"])
	must.Eq(t, NomadTaskCgroup(al.ID, "busy", false), groups["busy"])
	must.Eq(t, NomadTaskCgroup(al.ID, "cores", true), groups["cores"])

	over := groups["over"]
	must.Eq(t, strconv.Itoa(256<<20), cgroupFile(t, over, "memory.max"))
	must.Eq(t, strconv.Itoa(32<<20), cgroupFile(t, over, "memory.low"))
	current, err := strconv.ParseInt(cgroupFile(t, over, "memory.current"), 10, 64)
	must.NoError(t, err)
	must.Greater(t, 32<<20, current, must.Sprint("the task holds no more than its memory: memory_max is not what let it live"))
	must.Eq(t, "0", cgroupFile(t, over, "memory.swap.max"))
	// cpu = 500 is 500 shares, cpu.weight 58 (as Nomad 1.11 converts
	// them; 1024 is 100).
	must.Eq(t, "58", cgroupFile(t, over, "cpu.weight"))
	must.Eq(t, "4096", cgroupFile(t, over, "pids.max"))
	// Every controller Nomad's tasks get is there, cpuset and io too.
	have := strings.Fields(cgroupFile(t, over, "cgroup.controllers"))
	for _, c := range nomadControllers {
		must.SliceContains(t, have, c, must.Sprintf("controllers of %s", over))
	}

	// The reserved core is the task's alone: no shared task runs there.
	reserved := cpuList(t, cgroupFile(t, groups["cores"], "cpuset.cpus.effective"))
	must.SliceLen(t, 1, reserved, must.Sprintf("the cores task runs on %v", reserved))
	for _, task := range []string{"over", "busy"} {
		cpus := cpuList(t, cgroupFile(t, groups[task], "cpuset.cpus.effective"))
		must.SliceNotContains(t, cpus, reserved[0], must.Sprintf("task %s runs on %v, the reserved core %d among them", task, cpus, reserved[0]))
	}

	// Usage, as "nomad alloc status" reads it.
	var usage *api.TaskResourceUsage
	for deadline := time.Now().Add(Scaled(30 * time.Second)); ; time.Sleep(time.Second) {
		st, err := a.api.Allocations().Stats(&api.Allocation{ID: al.ID, NodeID: a.NodeID}, nil)
		if err == nil && st.Tasks["busy"] != nil {
			usage = st.Tasks["busy"]
			m, c := usage.ResourceUsage.MemoryStats, usage.ResourceUsage.CpuStats
			if m != nil && c != nil && m.RSS > 30<<20 && c.TotalTicks > 0 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no memory and CPU usage of the busy task within %v: %+v (err %v)", Scaled(30*time.Second), usage, err)
		}
	}
	m, c := usage.ResourceUsage.MemoryStats, usage.ResourceUsage.CpuStats
	t.Logf("busy: rss %d usage %d measured %v; cpu ticks %.0f percent %.1f measured %v", m.RSS, m.Usage, m.Measured, c.TotalTicks, c.Percent, c.Measured)
	must.SliceContains(t, m.Measured, "RSS")
	must.SliceContains(t, m.Measured, "Usage")
	// What "nomad alloc status -stats" prints as the CPU column.
	must.SliceContains(t, c.Measured, "Percent")
	must.Greater(t, m.RSS, m.Usage+1, must.Sprint("memory usage below RSS"))
	status, err := a.Nomad("alloc", "status", "-stats", al.ID)
	must.NoError(t, err, must.Sprint(status))
	t.Logf("nomad alloc status -stats:\n%s", status)
	must.StrContains(t, status, "Memory")
}

// On a kernel older than the README's 5.12 (make e2e-vm-oldkernel boots
// Debian 11's 5.10, the oldest Debian's archive offers), the driver never
// half-works: its fingerprint says, in one sentence, which call the kernel
// lacks, and Nomad places none of its tasks on the node.
func TestVMOldKernel(t *testing.T) {
	requireCSI(t)
	kerr := mounter.KernelSupport()
	if kerr == nil {
		if os.Getenv("E2E_VM") == "old-kernel" {
			t.Fatal("the old-kernel guest's kernel has every call the driver needs")
		}
		t.Skip("needs a kernel older than Linux 5.12, which make e2e-vm-oldkernel boots")
	}
	a := StartAgent(t, AgentOptions{Drivers: []string{}})
	var info *DriverInfo
	for deadline := time.Now().Add(Scaled(60 * time.Second)); ; time.Sleep(time.Second) {
		n, _, err := a.api.Nodes().Info(a.NodeID, nil)
		if err == nil && n.Drivers[DriverName] != nil && n.Drivers[DriverName].HealthDescription != "" {
			info = n.Drivers[DriverName]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no fingerprint of the csi driver within %v (last error %v)", Scaled(60*time.Second), err)
		}
	}
	t.Logf("csi driver: detected=%v healthy=%v: %s", info.Detected, info.Healthy, info.HealthDescription)
	must.False(t, info.Detected)
	must.False(t, info.Healthy)
	must.Eq(t, kerr.Error(), info.HealthDescription)
	must.StrContains(t, info.HealthDescription, "has no mount_setattr(2)")
	must.StrContains(t, info.HealthDescription, "Linux 5.12 or later")
	must.False(t, strings.Contains(strings.TrimSuffix(info.HealthDescription, "."), ". "), must.Sprint("not one sentence"))

	job := a.RunJob(t, "sleep", vars("Count", "1"))
	var why string
	for deadline := time.Now().Add(Scaled(60 * time.Second)); why == ""; time.Sleep(time.Second) {
		evals, _, err := a.api.Jobs().Evaluations(job.ID, nil)
		if err == nil {
			for _, ev := range evals {
				for _, m := range ev.FailedTGAllocs {
					why = fmt.Sprintf("%v", m.ConstraintFiltered)
				}
			}
		}
		if why == "" && time.Now().After(deadline) {
			t.Fatalf("no failed placement of job %s within %v (last error %v)", job.ID, Scaled(60*time.Second), err)
		}
	}
	t.Logf("placement of job %s failed: %s", job.ID, why)
	must.StrContains(t, why, "missing drivers")
	allocs, err := a.JobAllocations(job.ID)
	must.NoError(t, err)
	must.SliceEmpty(t, allocs, must.Sprint("a task was placed on a node whose csi driver refused the kernel"))
}
