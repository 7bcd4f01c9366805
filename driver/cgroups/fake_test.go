package cgroups

import (
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// The fake trees below hold the files the kernel would show, with the
// values a fresh group has. Writes replace a file's contents.

var fakeV1Files = map[string]map[string]string{
	"memory": {
		"memory.limit_in_bytes":       "9223372036854771712",
		"memory.memsw.limit_in_bytes": "9223372036854771712",
		"memory.soft_limit_in_bytes":  "9223372036854771712",
		"memory.usage_in_bytes":       "0",
		"memory.max_usage_in_bytes":   "0",
		"memory.stat":                 "cache 0\nrss 0\ntotal_cache 0\ntotal_rss 0\ntotal_swap 0\n",
		"memory.oom_control":          "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
	},
	"cpu": {
		"cpu.shares":        "1024",
		"cpu.cfs_period_us": "100000",
		"cpu.cfs_quota_us":  "-1",
		"cpu.stat":          "nr_periods 0\nnr_throttled 0\nthrottled_time 0\n",
	},
	"cpuacct": {
		"cpuacct.usage": "0",
		"cpuacct.stat":  "user 0\nsystem 0\n",
	},
	"pids":    {"pids.max": "max"},
	"freezer": {"freezer.state": "THAWED"},
	"cpuset":  {"cpuset.cpus": "", "cpuset.mems": ""},
	"devices": {"devices.allow": "", "devices.deny": "", "devices.list": "a *:* rwm"},
}

var fakeV2Files = map[string]string{
	"cgroup.controllers":     "cpuset cpu io memory pids",
	"cgroup.subtree_control": "",
	"cgroup.events":          "populated 0\nfrozen 0\n",
	"cgroup.freeze":          "0",
	"cgroup.kill":            "",
	"memory.max":             "max",
	"memory.low":             "0",
	"memory.swap.max":        "max",
	"memory.current":         "0",
	"memory.peak":            "0",
	"memory.swap.current":    "0",
	"memory.stat":            "anon 0\nfile 0\n",
	"memory.events":          "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
	"cpu.weight":             "100",
	"cpu.max":                "max 100000",
	"cpu.stat":               "usage_usec 0\nuser_usec 0\nsystem_usec 0\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n",
	"cpuset.cpus":            "",
}

// fakeRmdir removes a fake cgroup directory the way the kernel would: not
// while it has child groups or processes (EBUSY), its files regardless.
func fakeRmdir(t *testing.T) {
	old := rmdir
	rmdir = func(dir string) error {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range entries {
			if e.IsDir() {
				return unix.EBUSY
			}
		}
		if b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil && len(strings.TrimSpace(string(b))) > 0 {
			return unix.EBUSY
		}
		return os.RemoveAll(dir)
	}
	t.Cleanup(func() { rmdir = old })
}

func writeFiles(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for name, content := range files {
		must.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644))
	}
}

// fakeV1 builds a v1 tree with the given controllers mounted; skip names
// files the kernel would not have (e.g. "memory.memsw.limit_in_bytes"
// without swap accounting).
func fakeV1(t *testing.T, controllers []string, skip ...string) *hierarchy {
	t.Helper()
	fakeRmdir(t)
	root := t.TempDir()
	mounted := make(map[string]bool)
	files := func(ctrl string) map[string]string {
		out := map[string]string{"cgroup.procs": "", "tasks": ""}
		for k, v := range fakeV1Files[ctrl] {
			out[k] = v
		}
		for _, s := range skip {
			delete(out, s)
		}
		return out
	}
	for _, c := range controllers {
		dir := filepath.Join(root, c)
		must.NoError(t, os.Mkdir(dir, 0o755))
		writeFiles(t, dir, files(c))
		mounted[dir] = true
	}
	// The root cpuset has CPUs and memory nodes.
	if mounted[filepath.Join(root, "cpuset")] {
		writeFiles(t, filepath.Join(root, "cpuset"), map[string]string{"cpuset.cpus": "0-3", "cpuset.mems": "0"})
	}
	return &hierarchy{
		root:    root,
		version: 1,
		magic: func(p string) (int64, error) {
			if mounted[p] {
				return unix.CGROUP_SUPER_MAGIC, nil
			}
			if _, err := os.Stat(p); err != nil {
				return 0, err
			}
			return unix.TMPFS_MAGIC, nil
		},
		newDir: func(dir string) error {
			rel, err := filepath.Rel(root, dir)
			if err != nil {
				return err
			}
			ctrl, _, _ := strings.Cut(rel, "/")
			writeFiles(t, dir, files(ctrl))
			return nil
		},
	}
}

var allV1 = []string{"memory", "cpu", "cpuacct", "pids", "freezer", "cpuset"}

// fakeV2 builds a unified tree whose root offers controllers.
func fakeV2(t *testing.T, controllers string, skip ...string) *hierarchy {
	t.Helper()
	fakeRmdir(t)
	root := t.TempDir()
	files := map[string]string{"cgroup.procs": ""}
	for k, v := range fakeV2Files {
		files[k] = v
	}
	for _, s := range skip {
		delete(files, s)
	}
	writeFiles(t, root, files)
	writeFiles(t, root, map[string]string{"cgroup.controllers": controllers})
	return &hierarchy{
		root:    root,
		version: 2,
		magic:   func(string) (int64, error) { return unix.CGROUP2_SUPER_MAGIC, nil },
		newDir: func(dir string) error {
			writeFiles(t, dir, files)
			return nil
		},
	}
}

func readFake(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	must.NoError(t, err)
	return strings.TrimSpace(string(b))
}

func TestDetect(t *testing.T) {
	cases := []struct {
		name    string
		magic   int64
		err     error
		version int
	}{
		{name: "unified", magic: unix.CGROUP2_SUPER_MAGIC, version: 2},
		{name: "hybrid or legacy", magic: unix.TMPFS_MAGIC, version: 1},
		{name: "missing", err: os.ErrNotExist},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h, err := detect("/x", func(string) (int64, error) { return tc.magic, tc.err })
			if tc.err != nil {
				must.ErrorIs(t, err, tc.err)
				must.ErrorContains(t, err, "/x")
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.version, h.version)
		})
	}
}

func TestAvailable_Fake(t *testing.T) {
	cases := []struct {
		name string
		h    func(t *testing.T) *hierarchy
		err  string
	}{
		{name: "v1 all", h: func(t *testing.T) *hierarchy { return fakeV1(t, allV1) }},
		{name: "v1 without cpuset", h: func(t *testing.T) *hierarchy { return fakeV1(t, v1Controllers) }},
		{
			name: "v1 without memory",
			h:    func(t *testing.T) *hierarchy { return fakeV1(t, []string{"cpu", "cpuacct", "pids", "freezer"}) },
			err:  "the memory cgroup controller is not mounted",
		},
		{
			name: "v1 without freezer",
			h:    func(t *testing.T) *hierarchy { return fakeV1(t, []string{"memory", "cpu", "cpuacct", "pids"}) },
			err:  "the freezer cgroup controller is not mounted",
		},
		{name: "v2", h: func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory pids") }},
		{
			name: "v2 without memory",
			h:    func(t *testing.T) *hierarchy { return fakeV2(t, "cpu io pids") },
			err:  "the memory controller is not available in the cgroup v2 hierarchy",
		},
		{
			name: "v2 hybrid-like, no controllers",
			h:    func(t *testing.T) *hierarchy { return fakeV2(t, "") },
			err:  "the cpu controller is not available",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.h(t).available()
			if tc.err == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, tc.err)
		})
	}
}

func TestCreate_V1Limits(t *testing.T) {
	cases := []struct {
		name string
		l    Limits
		skip []string
		want map[string]string // path under the group, per controller
		none []string          // controllers without a group dir
	}{
		{
			name: "no limits writes the defaults",
			want: map[string]string{
				"memory/memory.limit_in_bytes":       "-1",
				"memory/memory.memsw.limit_in_bytes": "-1",
				"memory/memory.soft_limit_in_bytes":  "-1",
				"cpu/cpu.shares":                     "1024",
				"cpu/cpu.cfs_period_us":              "100000",
				"cpu/cpu.cfs_quota_us":               "-1",
			},
			none: []string{"cpuset"},
		},
		{
			name: "all limits",
			l: Limits{
				MemoryBytes: 512 << 20, MemoryReservationBytes: 256 << 20,
				CPUShares: 500, CPUQuota: 20000, CPUPeriod: 50000, CpusetCpus: "1-2",
			},
			want: map[string]string{
				"memory/memory.limit_in_bytes":       "536870912",
				"memory/memory.memsw.limit_in_bytes": "536870912",
				"memory/memory.soft_limit_in_bytes":  "268435456",
				"cpu/cpu.shares":                     "500",
				"cpu/cpu.cfs_period_us":              "50000",
				"cpu/cpu.cfs_quota_us":               "20000",
				"cpuset/cpuset.cpus":                 "1-2",
				"cpuset/cpuset.mems":                 "0",
			},
		},
		{
			name: "no swap accounting",
			l:    Limits{MemoryBytes: 1 << 30},
			skip: []string{"memory.memsw.limit_in_bytes"},
			want: map[string]string{"memory/memory.limit_in_bytes": "1073741824"},
		},
		{
			name: "shares clamped low",
			l:    Limits{CPUShares: 1},
			want: map[string]string{"cpu/cpu.shares": "2"},
		},
		{
			name: "shares clamped high",
			l:    Limits{CPUShares: 1 << 20},
			want: map[string]string{"cpu/cpu.shares": "262144"},
		},
		{
			name: "quota with default period",
			l:    Limits{CPUQuota: 150000},
			want: map[string]string{"cpu/cpu.cfs_period_us": "100000", "cpu/cpu.cfs_quota_us": "150000"},
		},
		{
			name: "nomad cpuset group without pinning",
			l:    Limits{CpusetCgroupPath: "/sys/fs/cgroup/cpuset/nomad/share"},
			none: []string{"cpuset"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := fakeV1(t, allV1, tc.skip...)
			g, err := h.create("nomad/csi", "task1", tc.l)
			must.NoError(t, err)
			for file, want := range tc.want {
				ctrl, name, _ := strings.Cut(file, "/")
				must.Eq(t, filepath.Join(h.root, ctrl, "nomad/csi/task1"), g.paths[ctrl])
				must.Eq(t, want, readFake(t, filepath.Join(g.paths[ctrl], name)), must.Sprintf("%s", file))
			}
			for _, ctrl := range tc.none {
				must.MapNotContainsKey(t, g.paths, ctrl)
				_, err := os.Stat(filepath.Join(h.root, ctrl, "nomad"))
				must.True(t, os.IsNotExist(err), must.Sprintf("%s dir was made", ctrl))
			}
			for _, ctrl := range v1Controllers {
				must.MapContainsKey(t, g.paths, ctrl)
			}
			st := g.State()
			must.Eq(t, 1, st.Version)
			must.Eq(t, h.v1CpusetPath(tc.l.CpusetCgroupPath), st.CpusetCgroupPath)
		})
	}
}

func TestCreate_V1CpusetParents(t *testing.T) {
	h := fakeV1(t, allV1)
	g, err := h.create("a/b", "t", Limits{CpusetCpus: "3"})
	must.NoError(t, err)
	// The parents made on the way got the root's CPUs and memory nodes,
	// the group its own CPUs and the parent's memory nodes.
	for _, dir := range []string{"cpuset/a", "cpuset/a/b"} {
		must.Eq(t, "0-3", readFake(t, filepath.Join(h.root, dir, "cpuset.cpus")))
		must.Eq(t, "0", readFake(t, filepath.Join(h.root, dir, "cpuset.mems")))
	}
	must.Eq(t, "3", readFake(t, filepath.Join(g.paths["cpuset"], "cpuset.cpus")))
	must.Eq(t, "0", readFake(t, filepath.Join(g.paths["cpuset"], "cpuset.mems")))
}

func TestCreate_V2Limits(t *testing.T) {
	cases := []struct {
		name        string
		controllers string
		l           Limits
		skip        []string
		want        map[string]string
		subtree     string
	}{
		{
			name:        "no limits writes the defaults",
			controllers: "cpuset cpu io memory pids",
			want: map[string]string{
				"memory.max":      "max",
				"memory.swap.max": "max",
				"memory.low":      "0",
				"cpu.weight":      "100",
				"cpu.max":         "max 100000",
				"cpuset.cpus":     "",
			},
			// Nomad's set: a task under this parent can be pinned and
			// given io limits later.
			subtree: "+cpu +cpuset +io +memory +pids",
		},
		{
			name:        "all limits",
			controllers: "cpuset cpu io memory pids",
			l: Limits{
				MemoryBytes: 512 << 20, MemoryReservationBytes: 256 << 20,
				CPUShares: 1024, CPUQuota: 20000, CPUPeriod: 50000, CpusetCpus: "0,2",
			},
			want: map[string]string{
				"memory.max":      "536870912",
				"memory.swap.max": "0",
				"memory.low":      "268435456",
				"cpu.weight":      "100",
				"cpu.max":         "20000 50000",
				"cpuset.cpus":     "0,2",
			},
			subtree: "+cpu +cpuset +io +memory +pids",
		},
		{
			name:        "no pids controller, no swap accounting",
			controllers: "cpu memory",
			l:           Limits{MemoryBytes: 64 << 20},
			skip:        []string{"memory.swap.max"},
			want:        map[string]string{"memory.max": "67108864"},
			subtree:     "+cpu +memory",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := fakeV2(t, tc.controllers, tc.skip...)
			g, err := h.create("nomad.slice", "task1.scope", tc.l)
			must.NoError(t, err)
			dir := filepath.Join(h.root, "nomad.slice", "task1.scope")
			must.Eq(t, State{Version: 2, Paths: map[string]string{"unified": dir}}, g.State())
			for file, want := range tc.want {
				must.Eq(t, want, readFake(t, filepath.Join(dir, file)), must.Sprintf("%s", file))
			}
			for _, s := range tc.skip {
				_, err := os.Stat(filepath.Join(dir, s))
				must.True(t, os.IsNotExist(err), must.Sprintf("%s was created", s))
			}
			must.Eq(t, tc.subtree, readFake(t, filepath.Join(h.root, "cgroup.subtree_control")))
			must.Eq(t, tc.subtree, readFake(t, filepath.Join(h.root, "nomad.slice", "cgroup.subtree_control")))
			// The group's own subtree_control is left alone.
			must.Eq(t, "", readFake(t, filepath.Join(dir, "cgroup.subtree_control")))
		})
	}
}

func TestCreate_V2KeepsEnabledControllers(t *testing.T) {
	h := fakeV2(t, "cpuset cpu io memory pids")
	sub := filepath.Join(h.root, "cgroup.subtree_control")
	must.NoError(t, os.WriteFile(sub, []byte("cpuset cpu io memory pids\n"), 0o644))
	_, err := h.create("", "t", Limits{})
	must.NoError(t, err)
	// Nothing was missing, so nothing was written.
	must.Eq(t, "cpuset cpu io memory pids", readFake(t, sub))

	// Only what is missing is written.
	must.NoError(t, os.WriteFile(sub, []byte("cpu memory\n"), 0o644))
	_, err = h.create("", "t2", Limits{})
	must.NoError(t, err)
	must.Eq(t, "+cpuset +io +pids", readFake(t, sub))
}

// On v2 a task goes in the group Nomad laid out for it (share.slice, or
// reserve.slice for reserved cores), when Nomad made the partition; the
// driver's own parent otherwise.
func TestCreate_V2NomadGroup(t *testing.T) {
	h := fakeV2(t, "cpuset cpu io memory pids")
	for _, dir := range []string{"nomad.slice", "nomad.slice/share.slice", "nomad.slice/reserve.slice"} {
		must.NoError(t, os.Mkdir(filepath.Join(h.root, dir), 0o755))
		must.NoError(t, h.newDir(filepath.Join(h.root, dir)))
	}
	share := filepath.Join(h.root, "nomad.slice/share.slice/a1.web.scope")
	reserve := filepath.Join(h.root, "nomad.slice/reserve.slice/a1.db.scope")
	cases := []struct {
		name string
		l    Limits
		want string
	}{
		{"share", Limits{CpusetCgroupPath: share}, share},
		{"reserved cores", Limits{CpusetCgroupPath: reserve, CpusetCpus: "1"}, reserve},
		{"no partition: Nomad's cgroups are off", Limits{CpusetCgroupPath: filepath.Join(h.root, "other.slice/share.slice/a1.x.scope")}, filepath.Join(h.root, "nomad-csi/x")},
		{"outside the hierarchy", Limits{CpusetCgroupPath: "/elsewhere/nomad.slice/share.slice/a1.x.scope"}, filepath.Join(h.root, "nomad-csi/x")},
		{"not a scope", Limits{CpusetCgroupPath: filepath.Join(h.root, "nomad.slice/share.slice")}, filepath.Join(h.root, "nomad-csi/x")},
		{"not clean", Limits{CpusetCgroupPath: filepath.Join(h.root, "nomad.slice/share.slice") + "/../share.slice/a1.x.scope"}, filepath.Join(h.root, "nomad-csi/x")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g, err := h.create("nomad-csi", "x", tc.l)
			must.NoError(t, err)
			must.Eq(t, tc.want, g.UnifiedDir())
			if tc.l.CpusetCpus != "" {
				must.Eq(t, tc.l.CpusetCpus, readFake(t, filepath.Join(tc.want, "cpuset.cpus")))
			}
			found, err := h.find("nomad-csi", "x", tc.l)
			must.NoError(t, err)
			must.Eq(t, g.State(), found.State())
			must.NoError(t, g.Destroy())
			_, err = os.Stat(tc.want)
			must.True(t, os.IsNotExist(err), must.Sprintf("%s is left", tc.want))
		})
	}
	// Nomad's partitions are never removed.
	for _, dir := range []string{"nomad.slice/share.slice", "nomad.slice/reserve.slice"} {
		_, err := os.Stat(filepath.Join(h.root, dir))
		must.NoError(t, err)
	}
}

func TestCreate_Idempotent(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    func(t *testing.T) *hierarchy
	}{
		{"v1", func(t *testing.T) *hierarchy { return fakeV1(t, allV1) }},
		{"v2", func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory pids cpuset") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := tc.h(t)
			g1, err := h.create("p", "t", Limits{MemoryBytes: 1 << 20, CpusetCpus: "0"})
			must.NoError(t, err)
			g2, err := h.create("p", "t", Limits{MemoryBytes: 2 << 20, CpusetCpus: "0"})
			must.NoError(t, err)
			must.Eq(t, g1.State(), g2.State())
			mem := filepath.Join(g2.paths["memory"], "memory.limit_in_bytes")
			if h.version == 2 {
				mem = filepath.Join(g2.paths[unifiedKey], "memory.max")
			}
			must.Eq(t, "2097152", readFake(t, mem))
		})
	}
}

func TestCreate_UndoOnError(t *testing.T) {
	cases := []struct {
		name string
		h    func(t *testing.T) *hierarchy
		l    Limits
		err  string
		left []string // directories that must still exist
		gone []string
	}{
		{
			name: "v1 limit file missing",
			h:    func(t *testing.T) *hierarchy { return fakeV1(t, allV1, "cpu.shares") },
			err:  "cpu.shares",
			left: []string{"memory", "cpu"},
			gone: []string{"memory/p", "cpu/p", "cpuacct/p", "pids/p", "freezer/p"},
		},
		{
			name: "v1 cpuset not mounted",
			h:    func(t *testing.T) *hierarchy { return fakeV1(t, v1Controllers) },
			l:    Limits{CpusetCpus: "0"},
			err:  "the cpuset cgroup controller is not mounted",
			gone: []string{"memory/p"},
		},
		{
			name: "v2 limit file missing",
			h:    func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory", "cpu.max") },
			err:  "cpu.max",
			gone: []string{"p"},
		},
		{
			name: "v2 cpuset not available",
			h:    func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory") },
			l:    Limits{CpusetCpus: "0"},
			err:  "the cpuset controller is not available",
			gone: []string{"p"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := tc.h(t)
			_, err := h.create("p", "t", tc.l)
			must.ErrorContains(t, err, tc.err)
			for _, d := range tc.left {
				must.DirExists(t, filepath.Join(h.root, d))
			}
			for _, d := range tc.gone {
				_, err := os.Stat(filepath.Join(h.root, d))
				must.True(t, os.IsNotExist(err), must.Sprintf("%s left behind", d))
			}
		})
	}
}

func TestCreate_UndoKeepsExisting(t *testing.T) {
	h := fakeV1(t, allV1, "cpu.shares")
	// The parent exists already in memory: it must survive the failure.
	must.NoError(t, os.Mkdir(filepath.Join(h.root, "memory", "p"), 0o755))
	_, err := h.create("p", "t", Limits{})
	must.Error(t, err)
	must.DirExists(t, filepath.Join(h.root, "memory", "p"))
	_, err = os.Stat(filepath.Join(h.root, "memory", "p", "t"))
	must.True(t, os.IsNotExist(err))
}

func TestCreate_Invalid(t *testing.T) {
	cases := []struct {
		name, parent, group string
		l                   Limits
		err                 string
	}{
		{name: "empty name", parent: "p", err: "cgroup name must not be empty"},
		{name: "slash in name", parent: "p", group: "a/b", err: "must not contain a slash"},
		{name: "dot dot name", parent: "p", group: "..", err: `must not contain ".."`},
		{name: "absolute parent", parent: "/p", group: "t", err: "must be a clean relative path"},
		{name: "escaping parent", parent: "../p", group: "t", err: `must not contain ".."`},
		{name: "unclean parent", parent: "a//b", group: "t", err: "must be a clean relative path"},
		{name: "negative memory", group: "t", l: Limits{MemoryBytes: -1}, err: "MemoryBytes must not be negative"},
		{name: "negative quota", group: "t", l: Limits{CPUQuota: -5}, err: "CPUQuota must not be negative"},
		{
			name: "reservation above limit", group: "t",
			l:   Limits{MemoryBytes: 10, MemoryReservationBytes: 20},
			err: "MemoryReservationBytes (20) must not be above MemoryBytes (10)",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := fakeV1(t, allV1)
			_, err := h.create(tc.parent, tc.group, tc.l)
			must.ErrorContains(t, err, tc.err)
			entries, err := os.ReadDir(filepath.Join(h.root, "memory"))
			must.NoError(t, err)
			for _, e := range entries {
				must.False(t, e.IsDir(), must.Sprintf("%s was made", e.Name()))
			}
		})
	}
}

func TestCPUWeight(t *testing.T) {
	cases := []struct{ shares, weight int64 }{
		{0, 100},
		{2, 1},
		{1, 1},
		{20, 6},
		{100, 17},
		{500, 58},
		{1024, 100},
		{2000, 170},
		{262143, 10000},
		{262144, 10000},
		{1 << 30, 10000},
	}
	for _, tc := range cases {
		must.Eq(t, tc.weight, cpuWeight(tc.shares), must.Sprintf("shares %d", tc.shares))
	}
}

func TestStats_V1(t *testing.T) {
	cases := []struct {
		name     string
		files    map[string]string // under the controller mounts; "-" removes
		want     Stats
		wantErr  string
		measured bool
	}{
		{
			name: "all",
			files: map[string]string{
				"cpuacct/cpuacct.usage":            "123456789\n",
				"cpuacct/cpuacct.stat":             "user 150\nsystem 50\n",
				"cpu/cpu.stat":                     "nr_periods 10\nnr_throttled 3\nthrottled_time 4000\n",
				"memory/memory.stat":               "cache 1\nrss 2\nswap 3\ntotal_cache 4096\ntotal_rss 8192\ntotal_swap 512\n",
				"memory/memory.usage_in_bytes":     "16384\n",
				"memory/memory.max_usage_in_bytes": "32768\n",
			},
			want: Stats{
				CPUTotalNanos: 123456789, CPUUserNanos: 1_500_000_000, CPUSystemNanos: 500_000_000,
				ThrottledPeriods: 3, ThrottledNanos: 4000,
				MemoryRSS: 8192, MemoryCache: 4096, MemorySwap: 512, MemoryUsage: 16384, MemoryMaxUsage: 32768,
				MemoryMeasured: []string{"RSS", "Cache", "Swap", "Usage", "Max Usage"},
				CPUMeasured:    []string{"User Mode", "System Mode", "Throttled Periods", "Throttled Time"},
			},
		},
		{
			name: "no swap accounting, no cpuacct.stat, no max usage",
			files: map[string]string{
				"cpuacct/cpuacct.usage":            "5",
				"cpuacct/cpuacct.stat":             "-",
				"cpu/cpu.stat":                     "nr_periods 0\n",
				"memory/memory.stat":               "total_cache 1\ntotal_rss 2\n",
				"memory/memory.usage_in_bytes":     "3",
				"memory/memory.max_usage_in_bytes": "-",
			},
			want: Stats{
				CPUTotalNanos: 5, MemoryRSS: 2, MemoryCache: 1, MemoryUsage: 3,
				MemoryMeasured: []string{"RSS", "Cache", "Usage"},
			},
		},
		{
			name:    "usage missing",
			files:   map[string]string{"cpuacct/cpuacct.usage": "-"},
			wantErr: "cpuacct.usage",
		},
		{
			name:    "usage garbled",
			files:   map[string]string{"memory/memory.usage_in_bytes": "lots"},
			wantErr: `failed to parse "lots"`,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := fakeV1(t, allV1)
			g, err := h.create("", "t", Limits{})
			must.NoError(t, err)
			for file, content := range tc.files {
				ctrl, name, _ := strings.Cut(file, "/")
				path := filepath.Join(g.paths[ctrl], name)
				if content == "-" {
					must.NoError(t, os.Remove(path))
					continue
				}
				must.NoError(t, os.WriteFile(path, []byte(content), 0o644))
			}
			st, err := g.Stats()
			if tc.wantErr != "" {
				must.ErrorContains(t, err, tc.wantErr)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, *st)
		})
	}
}

func TestStats_V2(t *testing.T) {
	cases := []struct {
		name    string
		files   map[string]string // "-" removes
		want    Stats
		wantErr string
	}{
		{
			name: "all",
			files: map[string]string{
				"cpu.stat":            "usage_usec 3000\nuser_usec 2000\nsystem_usec 1000\nnr_periods 9\nnr_throttled 4\nthrottled_usec 70\n",
				"memory.stat":         "anon 8192\nfile 4096\nkernel 100\n",
				"memory.current":      "20000",
				"memory.peak":         "40000",
				"memory.swap.current": "512",
			},
			want: Stats{
				CPUTotalNanos: 3_000_000, CPUUserNanos: 2_000_000, CPUSystemNanos: 1_000_000,
				ThrottledPeriods: 4, ThrottledNanos: 70_000,
				MemoryRSS: 8192, MemoryCache: 4096, MemorySwap: 512, MemoryUsage: 20000, MemoryMaxUsage: 40000,
				MemoryMeasured: []string{"RSS", "Cache", "Swap", "Usage", "Max Usage"},
				CPUMeasured:    []string{"User Mode", "System Mode", "Throttled Periods", "Throttled Time"},
			},
		},
		{
			name: "old kernel: no peak, no swap, cpu controller off",
			files: map[string]string{
				"cpu.stat":            "usage_usec 7\nuser_usec 5\nsystem_usec 2\n",
				"memory.current":      "1",
				"memory.peak":         "-",
				"memory.swap.current": "-",
			},
			want: Stats{
				CPUTotalNanos: 7000, CPUUserNanos: 5000, CPUSystemNanos: 2000, MemoryUsage: 1,
				MemoryMeasured: []string{"RSS", "Cache", "Usage"},
				CPUMeasured:    []string{"User Mode", "System Mode"},
			},
		},
		{
			name:    "no usage_usec",
			files:   map[string]string{"cpu.stat": "nr_periods 1\n"},
			wantErr: "no usage_usec",
		},
		{
			name:    "memory.current missing",
			files:   map[string]string{"memory.current": "-"},
			wantErr: "memory.current",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := fakeV2(t, "cpu memory")
			g, err := h.create("", "t", Limits{})
			must.NoError(t, err)
			for name, content := range tc.files {
				path := filepath.Join(g.paths[unifiedKey], name)
				if content == "-" {
					must.NoError(t, os.Remove(path))
					continue
				}
				must.NoError(t, os.WriteFile(path, []byte(content), 0o644))
			}
			st, err := g.Stats()
			if tc.wantErr != "" {
				must.ErrorContains(t, err, tc.wantErr)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, *st)
		})
	}
}

func TestOOMKilled(t *testing.T) {
	cases := []struct {
		name    string
		version int
		content string // of memory.oom_control or memory.events; "-" removes
		want    bool
		wantErr bool
	}{
		{"v1 none", 1, "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n", false, false},
		{"v1 killed", 1, "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n", true, false},
		{"v1 old kernel without counter", 1, "oom_kill_disable 0\nunder_oom 1\n", false, false},
		{"v1 group gone", 1, "-", false, true},
		{"v2 none", 2, "low 0\nhigh 0\nmax 4\noom 1\noom_kill 0\n", false, false},
		{"v2 killed", 2, "low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\noom_group_kill 0\n", true, false},
		{"v2 group gone", 2, "-", false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var path string
			var g *Group
			var err error
			if tc.version == 1 {
				g, err = fakeV1(t, allV1).create("", "t", Limits{})
				must.NoError(t, err)
				path = filepath.Join(g.paths["memory"], "memory.oom_control")
			} else {
				g, err = fakeV2(t, "cpu memory").create("", "t", Limits{})
				must.NoError(t, err)
				path = filepath.Join(g.paths[unifiedKey], "memory.events")
			}
			if tc.content == "-" {
				must.NoError(t, os.Remove(path))
			} else {
				must.NoError(t, os.WriteFile(path, []byte(tc.content), 0o644))
			}
			got, err := g.OOMKilled()
			if tc.wantErr {
				must.ErrorIs(t, err, os.ErrNotExist)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, got)
		})
	}
}

func TestLoad(t *testing.T) {
	h := fakeV1(t, allV1)
	g, err := h.create("p", "t", Limits{CpusetCgroupPath: "/nomad/cpuset"})
	must.NoError(t, err)
	good := g.State()
	v2 := fakeV2(t, "cpu memory")
	g2, err := v2.create("p", "t", Limits{})
	must.NoError(t, err)

	gone := g.State()
	gone.Paths = with(good.Paths, "memory", filepath.Join(h.root, "memory", "p", "other"))

	cases := []struct {
		name string
		st   State
		err  string
		// dirs: the error is Load's look for the directories, which
		// Reported does not make.
		dirs bool
	}{
		{name: "v1", st: good},
		{name: "v2", st: g2.State()},
		{name: "bad version", st: State{Version: 3, Paths: good.Paths}, err: "version 3 is not 1 or 2"},
		{name: "no memory path", st: State{Version: 1, Paths: map[string]string{"cpu": good.Paths["cpu"]}}, err: "no memory path"},
		{name: "no freezer path", st: State{Version: 1, Paths: without(good.Paths, "freezer")}, err: "no freezer path"},
		{name: "v2 with v1 paths", st: State{Version: 2, Paths: map[string]string{"unified": good.Paths["cpu"], "memory": good.Paths["memory"]}}, err: `unexpected "memory" path in a v2 state`},
		{name: "v1 with unified path", st: State{Version: 1, Paths: with(good.Paths, "unified", good.Paths["cpu"])}, err: `unexpected "unified" path`},
		{name: "relative", st: State{Version: 2, Paths: map[string]string{"unified": "p/t"}}, err: "not a clean absolute path"},
		{name: "gone", st: gone, err: "no such file", dirs: true},
		{name: "not a cgroup", st: State{Version: 2, Paths: map[string]string{"unified": t.TempDir()}}, err: "cgroup.procs", dirs: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			lg, err := Load(tc.st)
			if tc.err != "" {
				must.ErrorContains(t, err, tc.err)
			} else {
				must.NoError(t, err)
				must.Eq(t, tc.st, lg.State())
			}
			// A supervisor's report is checked the same, but for the
			// directories, which are not looked for.
			rg, err := Reported(tc.st)
			if tc.err != "" && !tc.dirs {
				must.ErrorContains(t, err, tc.err)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.st, rg.State())
		})
	}
}

func TestJoinAndPids_Fake(t *testing.T) {
	h := fakeV1(t, allV1)
	nomadCpuset := filepath.Join(h.root, "cpuset", "nomad")
	must.NoError(t, os.Mkdir(nomadCpuset, 0o755))
	writeFiles(t, nomadCpuset, map[string]string{"cgroup.procs": ""})
	g, err := h.create("p", "t", Limits{CpusetCgroupPath: nomadCpuset})
	must.NoError(t, err)

	must.NoError(t, g.Join(4242))
	for _, ctrl := range v1Controllers {
		must.Eq(t, "4242", readFake(t, filepath.Join(g.paths[ctrl], "cgroup.procs")))
	}
	must.Eq(t, "4242", readFake(t, filepath.Join(nomadCpuset, "cgroup.procs")))

	must.NoError(t, g.Join(0))
	must.Eq(t, strconv.Itoa(os.Getpid()), readFake(t, filepath.Join(g.paths["memory"], "cgroup.procs")))

	must.ErrorContains(t, g.Join(-1), "invalid pid -1")

	// Pids is the union over the hierarchies.
	writeFiles(t, g.paths["memory"], map[string]string{"cgroup.procs": "30\n10\n"})
	writeFiles(t, g.paths["cpu"], map[string]string{"cgroup.procs": "20\n10\n"})
	for _, ctrl := range []string{"cpuacct", "pids", "freezer"} {
		writeFiles(t, g.paths[ctrl], map[string]string{"cgroup.procs": "10\n"})
	}
	pids, err := g.Pids()
	must.NoError(t, err)
	must.Eq(t, []int{10, 20, 30}, pids)

	writeFiles(t, g.paths["pids"], map[string]string{"cgroup.procs": "x\n"})
	_, err = g.Pids()
	must.ErrorContains(t, err, `failed to parse pid "x"`)
}

func TestJoin_V2IgnoresNomadCpuset(t *testing.T) {
	g, err := fakeV2(t, "cpu memory").create("p", "t", Limits{CpusetCgroupPath: "/nowhere"})
	must.NoError(t, err)
	must.Eq(t, "", g.State().CpusetCgroupPath)
	must.NoError(t, g.Join(7))
	must.Eq(t, "7", readFake(t, filepath.Join(g.paths[unifiedKey], "cgroup.procs")))
}

func TestKill_Fake(t *testing.T) {
	old := killTimeout
	killTimeout = 200 * time.Millisecond
	t.Cleanup(func() { killTimeout = old })

	cases := []struct {
		name  string
		h     func(t *testing.T) *hierarchy
		procs string
		err   string
	}{
		{name: "v1 empty", h: func(t *testing.T) *hierarchy { return fakeV1(t, allV1) }},
		{name: "v2 empty", h: func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory") }},
		{
			// The fake never empties, so Kill must give up in time.
			name:  "v1 never empties",
			h:     func(t *testing.T) *hierarchy { return fakeV1(t, allV1) },
			procs: "2147483600",
			err:   "1 processes left after 200ms (pids [2147483600])",
		},
		{
			name:  "v2 never empties",
			h:     func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory") },
			procs: "2147483600",
			err:   "1 processes left after 200ms",
		},
		{
			name:  "v2 without cgroup.kill",
			h:     func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory", "cgroup.kill") },
			procs: "2147483600",
			err:   "1 processes left",
		},
		{
			name:  "refuses to kill itself",
			h:     func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory") },
			procs: "self",
			err:   "it holds the calling process",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := tc.h(t)
			g, err := h.create("", "t", Limits{})
			must.NoError(t, err)
			procs := tc.procs
			if procs == "self" {
				procs = strconv.Itoa(os.Getpid())
			}
			for _, dir := range g.dirs() {
				writeFiles(t, dir, map[string]string{"cgroup.procs": procs})
			}
			// A fake v2 freeze completes at once.
			if h.version == 2 {
				writeFiles(t, g.paths[unifiedKey], map[string]string{"cgroup.events": "populated 1\nfrozen 1\n"})
			}
			err = g.Kill()
			if tc.err == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, tc.err)
			if h.version == 1 && tc.procs != "self" {
				// Thawed again.
				must.Eq(t, "THAWED", readFake(t, filepath.Join(g.paths["freezer"], "freezer.state")))
			}
		})
	}
}

func TestDestroy_Fake(t *testing.T) {
	oldTimeout := destroyTimeout
	destroyTimeout = 100 * time.Millisecond
	t.Cleanup(func() { destroyTimeout = oldTimeout })

	cases := []struct {
		name  string
		h     func(t *testing.T) *hierarchy
		setup func(t *testing.T, g *Group)
		err   string
	}{
		{name: "v1", h: func(t *testing.T) *hierarchy { return fakeV1(t, allV1) }},
		{name: "v2", h: func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory") }},
		{
			name: "already gone",
			h:    func(t *testing.T) *hierarchy { return fakeV1(t, allV1) },
			setup: func(t *testing.T, g *Group) {
				must.NoError(t, os.RemoveAll(g.paths["cpu"]))
			},
		},
		{
			name: "busy until the process leaves",
			h:    func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory") },
			setup: func(t *testing.T, g *Group) {
				procs := filepath.Join(g.paths[unifiedKey], "cgroup.procs")
				writeFiles(t, g.paths[unifiedKey], map[string]string{"cgroup.procs": "99"})
				go func() {
					time.Sleep(30 * time.Millisecond)
					_ = os.WriteFile(procs, nil, 0o644)
				}()
			},
		},
		{
			name: "busy for good",
			h:    func(t *testing.T) *hierarchy { return fakeV1(t, allV1) },
			setup: func(t *testing.T, g *Group) {
				writeFiles(t, g.paths["memory"], map[string]string{"cgroup.procs": "99"})
			},
			err: "failed to remove cgroup",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := tc.h(t)
			g, err := h.create("p", "t", Limits{})
			must.NoError(t, err)
			if tc.setup != nil {
				tc.setup(t, g)
			}
			err = g.Destroy()
			if tc.err != "" {
				must.ErrorContains(t, err, tc.err)
				must.ErrorIs(t, err, unix.EBUSY)
				must.DirExists(t, g.paths["memory"])
				return
			}
			must.NoError(t, err)
			for _, dir := range g.dirs() {
				_, err := os.Stat(dir)
				must.True(t, os.IsNotExist(err), must.Sprintf("%s left", dir))
				// The parent stays: other tasks share it.
				must.DirExists(t, filepath.Dir(dir))
			}
		})
	}
}

func with(m map[string]string, k, v string) map[string]string {
	out := make(map[string]string, len(m)+1)
	for k, v := range m {
		out[k] = v
	}
	out[k] = v
	return out
}

func without(m map[string]string, k string) map[string]string {
	out := with(m, k, "")
	delete(out, k)
	return out
}

// On many v1 hosts cpu and cpuacct share one hierarchy, mounted at
// cpu,cpuacct with cpu and cpuacct as symlinks to it.
// fakeV1CoMounted is fakeV1 with cpu and cpuacct mounted together at
// "cpu,cpuacct", a symlink for each, as systemd mounts them; it returns
// the hierarchy and the shared mount.
func fakeV1CoMounted(t *testing.T, controllers ...string) (*hierarchy, string) {
	t.Helper()
	h := fakeV1(t, append(controllers, "cpu,cpuacct"))
	both := filepath.Join(h.root, "cpu,cpuacct")
	writeFiles(t, both, fakeV1Files["cpuacct"])
	for _, link := range []string{"cpu", "cpuacct"} {
		must.NoError(t, os.Symlink("cpu,cpuacct", filepath.Join(h.root, link)))
	}
	magic := h.magic
	h.magic = func(p string) (int64, error) {
		if r, err := filepath.EvalSymlinks(p); err == nil {
			p = r
		}
		return magic(p)
	}
	newDir := h.newDir
	h.newDir = func(dir string) error {
		if err := newDir(dir); err != nil {
			return err
		}
		if r, err := filepath.EvalSymlinks(dir); err == nil && strings.HasPrefix(r, both+"/") {
			writeFiles(t, dir, fakeV1Files["cpu"])
			writeFiles(t, dir, fakeV1Files["cpuacct"])
		}
		return nil
	}
	return h, both
}

func TestCreate_V1CoMounted(t *testing.T) {
	h, both := fakeV1CoMounted(t, "memory", "pids", "freezer")
	g, err := h.create("p", "t", Limits{CPUShares: 100})
	must.NoError(t, err)
	must.Eq(t, "100", readFake(t, filepath.Join(both, "p", "t", "cpu.shares")))
	must.NoError(t, g.Join(5))
	pids, err := g.Pids()
	must.NoError(t, err)
	must.Eq(t, []int{5}, pids)
	_, err = g.Stats()
	must.NoError(t, err)
	for _, dir := range g.dirs() {
		writeFiles(t, dir, map[string]string{"cgroup.procs": ""}) // pid 5 left
	}
	must.NoError(t, g.Destroy())
	gone(t, filepath.Join(both, "p", "t"), filepath.Join(h.root, "memory", "p", "t"))
}

func TestPids_PartlyGone(t *testing.T) {
	g, err := fakeV1(t, allV1).create("p", "t", Limits{})
	must.NoError(t, err)
	writeFiles(t, g.paths["memory"], map[string]string{"cgroup.procs": "8\n"})
	must.NoError(t, os.RemoveAll(g.paths["cpu"]))
	pids, err := g.Pids()
	must.NoError(t, err)
	must.Eq(t, []int{8}, pids)

	for _, dir := range g.dirs() {
		must.NoError(t, os.RemoveAll(dir))
	}
	_, err = g.Pids()
	must.ErrorIs(t, err, os.ErrNotExist)
	// Nothing left to kill.
	must.NoError(t, g.Kill())
}

// With Nomad's cpuset group and reserved cores, no cpuset group of ours is
// made and the cores are written to Nomad's group, which Nomad makes
// without CPUs.
func TestCreate_V1NomadCpusetReserved(t *testing.T) {
	h := fakeV1(t, allV1)
	nomad := filepath.Join(h.root, "cpuset", "nomad", "reserve", "x")
	must.NoError(t, os.MkdirAll(nomad, 0o755))
	writeFiles(t, nomad, map[string]string{"cgroup.procs": "", "cpuset.cpus": "", "cpuset.mems": "0"})
	// Relative paths are taken under the cpuset mount.
	for _, path := range []string{nomad, "nomad/reserve/x"} {
		g, err := h.create("nomad/csi", "task1", Limits{CpusetCpus: "1", CpusetCgroupPath: path})
		must.NoError(t, err)
		must.MapNotContainsKey(t, g.paths, "cpuset")
		must.Eq(t, nomad, g.State().CpusetCgroupPath)
		must.Eq(t, "1", readFake(t, filepath.Join(nomad, "cpuset.cpus")))
		gone(t, filepath.Join(h.root, "cpuset", "nomad", "csi"))
		writeFiles(t, nomad, map[string]string{"cpuset.cpus": ""})
	}
}

func TestFind(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    func(t *testing.T) *hierarchy
	}{
		{"v1", func(t *testing.T) *hierarchy { return fakeV1(t, allV1) }},
		{"v2", func(t *testing.T) *hierarchy { return fakeV2(t, "cpu memory pids cpuset") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := tc.h(t)
			made, err := h.create("p", "t", Limits{MemoryBytes: 1 << 20, CpusetCpus: "0"})
			must.NoError(t, err)
			// A group of the same parent with another name is not found.
			_, err = h.create("p", "other", Limits{})
			must.NoError(t, err)

			found, err := h.find("p", "t", Limits{})
			must.NoError(t, err)
			must.Eq(t, made.State().Paths, found.State().Paths)

			must.NoError(t, found.Destroy())
			_, err = h.find("p", "t", Limits{})
			must.ErrorIs(t, err, fs.ErrNotExist)
			_, err = h.find("p", "../t", Limits{})
			must.Error(t, err)
		})
	}
}
