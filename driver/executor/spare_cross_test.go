package executor

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// groupSettings reads every setting of the v1 group taskName under parent,
// in every hierarchy it has a directory in: each file that holds a value a
// task's limits or the kernel's defaults set, keyed by hierarchy and name.
// What counts usage or lists members is left out: it differs between any
// two groups.
func groupSettings(t *testing.T, parent, name string) map[string]string {
	t.Helper()
	usage := []string{"usage", "stat", "failcnt", "current", "events", "procs", "tasks", "pressure", "max_usage",
		"self_freezing", "peak", "parent_freezing", "numa", "cgroup.event_control", "memory.force_empty", "memory.pressure_level",
		"memory.kmem.slabinfo", "memory.oom_control"}
	out := map[string]string{}
	seen := map[string]bool{}
	roots, err := filepath.Glob("/sys/fs/cgroup/*")
	must.NoError(t, err)
	for _, root := range roots {
		real, err := filepath.EvalSymlinks(root)
		if err != nil || seen[real] {
			continue
		}
		dir := filepath.Join(real, parent, name)
		entries, err := os.ReadDir(dir)
		if os.IsNotExist(err) {
			continue
		}
		must.NoError(t, err)
		seen[real] = true
		for _, e := range entries {
			if e.IsDir() || slices.ContainsFunc(usage, func(u string) bool { return strings.Contains(e.Name(), u) }) {
				continue
			}
			b, err := os.ReadFile(filepath.Join(dir, e.Name()))
			if err != nil {
				continue // write-only (devices.allow, cgroup.event_control)
			}
			out[filepath.Base(real)+"/"+e.Name()] = string(b)
		}
	}
	return out
}

// A hostile task A of one job teaches the spares its limits (memory, CPU,
// processes, and device rules that let in /dev/mem and every loop block
// device); the next task B, of another job, asks for none of them. The
// group B claims from the spare must have, in every v1 hierarchy and every
// setting, exactly what a group made fresh for B has: nothing of A's
// survives, B gets no memory limit it did not ask for and no device A was
// allowed.
func TestSpares_NoLimitOfTheLastTaskSurvives_Root(t *testing.T) {
	requireTaskRoot(t)
	if !cgroups.AheadAvailable() {
		t.Skip("groups are made ahead on cgroup v1 only")
	}
	first := isolatedSpec(t, `true`)
	parent := first.spec.CgroupParent
	s := &Spares{}
	s.SetDir(t.TempDir(), first.spec.Isolation)
	s.SetGroup(parent, cgroups.Limits{Devices: cgroups.DefaultDevices}, hclog.NewNullLogger())
	t.Cleanup(func() {
		s.Close()
		must.Eq(t, []string(nil), aheadGroups(t, parent), must.Sprint("groups made ahead left"))
	})
	s.Fill("", hclog.NewNullLogger())

	for _, tc := range []struct {
		name   string
		limits cgroups.Limits
	}{
		{"no limits", cgroups.Limits{Devices: cgroups.DefaultDevices}},
		{"small limits, no device A had", cgroups.Limits{MemoryBytes: 64 << 20, CPUShares: 100, CPUQuota: 10000, CPUPeriod: 50000,
			PidsMax: 16, Devices: cgroups.DefaultDevices}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := isolatedSpec(t, `true`)
			a.spec.CgroupParent = parent
			const huge = int64(1) << 40
			a.spec.Limits = cgroups.Limits{MemoryBytes: huge, MemoryReservationBytes: huge / 2, CPUShares: 262144, CPUQuota: 400000,
				CPUPeriod: 100000, PidsMax: 1 << 20, Devices: append(slices.Clone(cgroups.DefaultDevices),
					cgroups.DeviceRule{Type: 'c', Major: 1, Minor: 1, Access: "rwm"},
					cgroups.DeviceRule{Type: 'b', Major: 7, Minor: -1, Access: "rwm"})}
			vol := t.TempDir()
			late := func() ([]Mount, error) { return []Mount{{Source: vol, Target: "/data"}}, nil }
			a.spec.LateMounts = []Mount{{Target: "/data"}}
			// A takes the waiting spare: the next one is started after
			// A's start, with what A taught.
			waitSpare(t, s, "")
			pa, err := s.Start(hclog.NewNullLogger(), a.spec, late)
			must.NoError(t, err)
			t.Cleanup(func() { _ = pa.Kill(); _ = pa.Destroy() })
			must.Eq(t, 0, waitExit(t, pa).ExitCode, must.Sprintf("stderr: %s", readFile(t, a.stderr)))

			// The next spare's group has A's limits (the attack's premise): its
			// memory limit is A's, once written.
			waitSpare(t, s, "")
			waitFor(t, "the next spare's group with A's memory limit", func() bool {
				files, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup/memory", parent, wire.SpareGroupPrefix+"*", "memory.limit_in_bytes"))
				if len(files) != 1 {
					return false
				}
				b, err := os.ReadFile(files[0])
				return err == nil && string(b) == strconv.FormatInt(huge, 10)+"\n"
			})
			waitFor(t, "the next spare's group with A's device rules", func() bool {
				files, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup/devices", parent, wire.SpareGroupPrefix+"*", "devices.list"))
				if len(files) != 1 {
					return false
				}
				b, err := os.ReadFile(files[0])
				return err == nil && strings.Contains(string(b), "b 7:* rwm")
			})

			b := isolatedSpec(t, `exec sleep 1000`)
			b.spec.CgroupParent = parent
			b.spec.Limits = tc.limits
			b.spec.LateMounts = []Mount{{Target: "/data"}}
			pb, err := s.Start(hclog.NewNullLogger(), b.spec, late)
			must.NoError(t, err)
			t.Cleanup(func() { _ = pb.Kill(); waitExit(t, pb); _ = pb.Destroy() })
			must.StrContains(t, readFile(t, b.spec.StateDir+"/"+wire.SupervisorLogFile), "the task took the cgroup made ahead")

			fresh, err := cgroups.Create(parent, "fresh-"+b.spec.TaskID, b.spec.Limits)
			must.NoError(t, err)
			t.Cleanup(func() { must.NoError(t, fresh.Destroy()) })
			want := groupSettings(t, parent, "fresh-"+b.spec.TaskID)
			got := groupSettings(t, parent, b.spec.GroupName())
			must.Eq(t, slices.Sorted(maps.Keys(want)), slices.Sorted(maps.Keys(got)), must.Sprint("the settings files of B's group"))
			for _, k := range slices.Sorted(maps.Keys(want)) {
				must.Eq(t, want[k], got[k], must.Sprintf("%s of B's group claimed from a spare taught by A", k))
			}
		})
	}
}

// A spare waiting while the driver is configured again (SetConfig: another
// chroot_env, another pids_limit) serves the next task with nothing of the
// old configuration: not the root prepared with the old chroot_env (here
// the old one had /etc, the new one has not), not the old process limit in
// the group it made ahead.
func TestSpares_WaitingSpareOfAnOldConfig_Root(t *testing.T) {
	requireTaskRoot(t)
	old := isolatedSpec(t, `true`)
	parent := old.spec.CgroupParent
	s := &Spares{}
	dir := t.TempDir()
	s.SetDir(dir, old.spec.Isolation)
	s.SetGroup(parent, cgroups.Limits{Devices: cgroups.DefaultDevices, PidsMax: 100}, hclog.NewNullLogger())
	t.Cleanup(func() {
		s.Close()
		must.Eq(t, []string(nil), aheadGroups(t, parent), must.Sprint("groups made ahead left"))
	})
	s.Fill("", hclog.NewNullLogger())
	waitSpare(t, s, "")
	ahead := cgroups.AheadAvailable()
	if ahead {
		waitFor(t, "the spare's group with the old process limit", func() bool {
			files, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup/pids", parent, wire.SpareGroupPrefix+"*", "pids.max"))
			if len(files) != 1 {
				return false
			}
			b, err := os.ReadFile(files[0])
			return err == nil && string(b) == "100\n"
		})
	}

	env := maps.Clone(DefaultChrootEnv)
	delete(env, "/etc")
	iso := &Isolation{ChrootEnv: env, PrivatePID: true, PrivateIPC: true}
	s.SetDir(dir, iso)
	s.SetGroup(parent, cgroups.Limits{Devices: cgroups.DefaultDevices, PidsMax: 7}, hclog.NewNullLogger())

	b := isolatedSpec(t, `if [ -e /etc/passwd ]; then echo etc=seen; else echo etc=none; fi; exec sleep 1000`)
	b.spec.CgroupParent = parent
	b.spec.Isolation = iso
	b.spec.Limits = cgroups.Limits{Devices: cgroups.DefaultDevices, PidsMax: 7}
	vol := t.TempDir()
	b.spec.LateMounts = []Mount{{Target: "/data"}}
	pb, err := s.Start(hclog.NewNullLogger(), b.spec, func() ([]Mount, error) { return []Mount{{Source: vol, Target: "/data"}}, nil })
	must.NoError(t, err)
	t.Cleanup(func() { _ = pb.Kill(); waitExit(t, pb); _ = pb.Destroy() })
	waitFor(t, "the task's output", func() bool { return strings.Contains(readFile(t, b.stdout), "etc=") })
	must.Eq(t, "etc=none\n", readFile(t, b.stdout), must.Sprint("the task saw the old chroot_env's /etc"))
	// The supervisor logs why the root did not serve once the task runs,
	// so the task's output can come first.
	logFile := b.spec.StateDir + "/" + wire.SupervisorLogFile
	waitFor(t, "the supervisor's log of the root prepared ahead", func() bool {
		return strings.Contains(readFile(t, logFile), "the root prepared ahead did not serve")
	})
	log := readFile(t, logFile)
	if ahead {
		// cgroup v1: the group made ahead under the old limit took the new.
		must.StrContains(t, log, "the task took the cgroup made ahead")
		must.Eq(t, "7\n", readFile(t, filepath.Join("/sys/fs/cgroup/pids", parent, b.spec.GroupName(), "pids.max")))
	}
}

// A task a spare serves has only its own descriptors and environment: not
// a descriptor the driver held without close-on-exec when the spare was
// started, nor anything of the spare's environment (the driver's).
func TestSpares_TaskGetsNothingOfTheSpare_Root(t *testing.T) {
	requireTaskRoot(t)
	secret := t.TempDir()
	fd, err := unix.Open(secret, unix.O_RDONLY|unix.O_DIRECTORY, 0) // no O_CLOEXEC
	must.NoError(t, err)
	t.Cleanup(func() { _ = unix.Close(fd) })
	t.Setenv("NCSI_SPARE_TEST_SECRET", "driver-only")
	tt := isolatedSpec(t, `echo "fds=$(ls /proc/self/fd | tr '\n' ' ')"; echo "env=$(env | grep -c NCSI_SPARE_TEST_SECRET)"`)
	s := &Spares{}
	s.SetDir(t.TempDir(), tt.spec.Isolation)
	t.Cleanup(s.Close)
	s.Fill("", hclog.NewNullLogger())
	waitSpare(t, s, "")
	vol := t.TempDir()
	tt.spec.LateMounts = []Mount{{Target: "/data"}}
	p, err := s.Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) { return []Mount{{Source: vol, Target: "/data"}}, nil })
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	got := exitLines(t, tt, p)
	must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+wire.SupervisorLogFile), `root_prepared_ahead=true`)
	// 0-2, and the descriptor ls opens on /proc/self/fd itself.
	must.Eq(t, "0 1 2 3", strings.TrimSpace(got["fds"]), must.Sprintf("descriptor %d leaked into the task", fd))
	must.Eq(t, "0", got["env"], must.Sprint("the driver's environment reached the task"))
}
