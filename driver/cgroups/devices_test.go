package cgroups

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	ocgroups "github.com/opencontainers/cgroups"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// devProbeEnv makes the test binary a helper that waits for a line on
// stdin (so that it can be moved into a group first), then does each try
// of the variable, one a line: "open PATH" opens PATH for reading, "mknod
// PATH" makes a character device node 1:3 there. It prints one line per
// try, the try and its result: "open /dev/null: ok", "open /x: EPERM".
const devProbeEnv = "CGROUPS_TEST_DEV_PROBE"

// attachDevicesEnv makes the test binary a helper that attaches the device
// program for DefaultDevices to the v2 group in the variable, and exits.
const attachDevicesEnv = "CGROUPS_TEST_ATTACH_DEVICES"

func devProbe(tries string) int {
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	for _, try := range strings.Split(tries, "\n") {
		op, path, _ := strings.Cut(try, " ")
		var err error
		switch op {
		case "open":
			var f *os.File
			if f, err = os.Open(path); err == nil {
				f.Close()
			}
		case "mknod":
			if err = unix.Mknod(path, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3))); err == nil {
				err = os.Remove(path)
			}
		default:
			fmt.Fprintf(os.Stderr, "unknown try %q\n", try)
			return 2
		}
		result := "ok"
		var errno unix.Errno
		if errors.As(err, &errno) {
			result = unix.ErrnoName(errno)
		} else if err != nil {
			result = err.Error()
		}
		fmt.Printf("%s: %s\n", try, result)
	}
	return 0
}

// probe runs the tries in a helper process, moved into g first unless g is
// nil, and returns each try's result.
func probe(t *testing.T, g *Group, tries ...string) map[string]string {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), devProbeEnv+"="+strings.Join(tries, "\n"))
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	w, err := cmd.StdinPipe()
	must.NoError(t, err)
	must.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	if g != nil {
		must.NoError(t, g.Join(cmd.Process.Pid))
	}
	_, err = w.Write([]byte("go\n"))
	must.NoError(t, err)
	must.NoError(t, cmd.Wait(), must.Sprintf("stderr: %s", errOut.String()))
	results := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		try, result, ok := strings.Cut(line, ": ")
		must.True(t, ok, must.Sprintf("bad probe line %q", line))
		results[try] = result
	}
	must.MapLen(t, len(tries), results, must.Sprintf("probe output: %s", out.String()))
	return results
}

// blockNode makes a block device node in a temporary directory with the
// numbers of a block device of this machine, which root can open from
// outside any device filter; the directory's cleanup removes it.
func blockNode(t *testing.T) string {
	t.Helper()
	for _, dev := range []string{"/dev/loop0", "/dev/vda", "/dev/sda", "/dev/nvme0n1", "/dev/xvda"} {
		r, err := DeviceRuleFor(dev, "r")
		if err != nil || r.Type != 'b' {
			continue
		}
		node := filepath.Join(t.TempDir(), "blk")
		must.NoError(t, unix.Mknod(node, unix.S_IFBLK|0o600, int(unix.Mkdev(uint32(r.Major), uint32(r.Minor)))))
		return node
	}
	t.Skip("no block device found to copy")
	return ""
}

// checkFilter proves that g lets its processes open /dev/null and nothing
// else, and make no device nodes, while the same tries work outside it.
func checkFilter(t *testing.T, g *Group) {
	t.Helper()
	node := blockNode(t)
	made := filepath.Join(filepath.Dir(node), "null")
	tries := []string{"open /dev/null", "open /dev/zero", "open " + node, "mknod " + made}
	outside := probe(t, nil, tries...)
	for _, try := range tries {
		must.Eq(t, "ok", outside[try], must.Sprintf("outside the group: %s", try))
	}
	inside := probe(t, g, tries...)
	must.Eq(t, map[string]string{
		"open /dev/null": "ok",
		"open /dev/zero": "ok",
		"open " + node:   "EPERM",
		"mknod " + made:  "EPERM",
	}, inside)
}

func TestDeviceRule_String(t *testing.T) {
	cases := []struct {
		r    DeviceRule
		want string
	}{
		{DeviceRule{Type: 'c', Major: 1, Minor: 3, Access: "rwm"}, "c 1:3 rwm"},
		{DeviceRule{Type: 'c', Major: 136, Minor: -1, Access: "rw"}, "c 136:* rw"},
		{DeviceRule{Type: 'b', Major: -1, Minor: -1, Access: "m"}, "b *:* m"},
		{DeviceRule{Type: 'b', Major: 259, Minor: 1048575, Access: "r"}, "b 259:1048575 r"},
		{DeviceRule{Type: 'a', Major: -1, Minor: -1, Access: "rwm"}, "a *:* rwm"},
	}
	for _, tc := range cases {
		t.Run(tc.want, func(t *testing.T) {
			must.Eq(t, tc.want, tc.r.String())
			must.NoError(t, tc.r.validate())
		})
	}
}

func TestDeviceRule_Invalid(t *testing.T) {
	cases := []struct {
		name string
		r    DeviceRule
		err  string
	}{
		{"type", DeviceRule{Type: 'p', Major: 1, Minor: 3, Access: "r"}, `type 'p' must be 'c', 'b' or 'a'`},
		{"no type", DeviceRule{Major: 1, Minor: 3, Access: "r"}, `must be 'c', 'b' or 'a'`},
		{"major", DeviceRule{Type: 'c', Major: -2, Minor: 3, Access: "r"}, "major -2 must be a device number or -1"},
		{"minor", DeviceRule{Type: 'c', Major: 1, Minor: 1 << 32, Access: "r"}, "minor 4294967296 must be"},
		{"no access", DeviceRule{Type: 'c', Major: 1, Minor: 3}, `access "" must be one or more of r, w and m`},
		{"bad access", DeviceRule{Type: 'c', Major: 1, Minor: 3, Access: "rx"}, `access "rx" must be`},
		{"repeated access", DeviceRule{Type: 'c', Major: 1, Minor: 3, Access: "rr"}, "each once"},
		{"long access", DeviceRule{Type: 'c', Major: 1, Minor: 3, Access: "rwmr"}, `access "rwmr"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			must.ErrorContains(t, tc.r.validate(), tc.err)
			// Create refuses it before it makes anything.
			h := fakeV1(t, append(allV1, "devices"))
			_, err := h.create("p", "t", Limits{Devices: []DeviceRule{DefaultDevices[0], tc.r}})
			must.ErrorContains(t, err, "cgroup limit Devices[1]")
			must.ErrorContains(t, err, tc.err)
			gone(t, filepath.Join(h.root, "memory", "p"), filepath.Join(h.root, "devices", "p"))
		})
	}
}

// DefaultDevices is exactly the minimal set, each valid; a change to it is
// a decision, not an accident.
func TestDefaultDevices(t *testing.T) {
	var got []string
	for _, r := range DefaultDevices {
		must.NoError(t, r.validate())
		got = append(got, r.String())
	}
	must.Eq(t, []string{
		"c 1:3 rw", "c 1:5 rw", "c 1:7 rw", "c 1:8 rw", "c 1:9 rw",
		"c 5:0 rw", "c 5:2 rw", "c 136:* rw",
	}, got)
}

func TestDeviceRuleFor(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(dir, "null-link")
	must.NoError(t, os.Symlink("/dev/null", link))
	file := filepath.Join(dir, "file")
	must.NoError(t, os.WriteFile(file, nil, 0o644))

	cases := []struct {
		name, path, access string
		want               DeviceRule
		err                string
	}{
		{name: "char", path: "/dev/null", access: "rwm", want: DeviceRule{Type: 'c', Major: 1, Minor: 3, Access: "rwm"}},
		{name: "read only", path: "/dev/zero", access: "r", want: DeviceRule{Type: 'c', Major: 1, Minor: 5, Access: "r"}},
		{name: "symlink followed", path: link, access: "rw", want: DeviceRule{Type: 'c', Major: 1, Minor: 3, Access: "rw"}},
		{name: "regular file", path: file, access: "rw", err: "must be a character or block device node"},
		{name: "directory", path: dir, access: "rw", err: "must be a character or block device node"},
		{name: "missing", path: filepath.Join(dir, "nope"), access: "rw", err: "failed to stat device"},
		{name: "bad access", path: "/dev/null", access: "rwx", err: `access "rwx" must be one or more of r, w and m`},
		{name: "no access", path: "/dev/null", access: "", err: "invalid rule for device /dev/null"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DeviceRuleFor(tc.path, tc.access)
			if tc.err != "" {
				must.ErrorContains(t, err, tc.err)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, got)
		})
	}

	t.Run("block", func(t *testing.T) {
		if os.Geteuid() != 0 {
			t.Skip("needs root to make a block device node")
		}
		node := filepath.Join(t.TempDir(), "blk")
		must.NoError(t, unix.Mknod(node, unix.S_IFBLK|0o600, int(unix.Mkdev(259, 70000))))
		got, err := DeviceRuleFor(node, "rw")
		must.NoError(t, err)
		must.Eq(t, DeviceRule{Type: 'b', Major: 259, Minor: 70000, Access: "rw"}, got)
	})
}

// On v1 a group with Devices is made in the devices hierarchy too, is
// found there by State and Load, and ends with the rules; one without is
// not.
func TestCreate_V1Devices(t *testing.T) {
	h := fakeV1(t, append(allV1, "devices"))
	g, err := h.create("p", "t", Limits{Devices: DefaultDevices})
	must.NoError(t, err)
	dir := filepath.Join(h.root, "devices", "p", "t")
	must.Eq(t, dir, g.State().Paths["devices"])
	must.Eq(t, "a", readFake(t, filepath.Join(dir, "devices.deny")))
	// The fake keeps the last write.
	must.Eq(t, "c 136:* rw", readFake(t, filepath.Join(dir, "devices.allow")))
	lg, err := Load(g.State())
	must.NoError(t, err)
	must.Eq(t, g.State(), lg.State())

	plain, err := h.create("p", "plain", Limits{})
	must.NoError(t, err)
	must.MapNotContainsKey(t, plain.State().Paths, "devices")
	gone(t, filepath.Join(h.root, "devices", "p", "plain"))

	// An empty list still denies everything.
	none, err := h.create("p", "none", Limits{Devices: []DeviceRule{}})
	must.NoError(t, err)
	must.Eq(t, "a", readFake(t, filepath.Join(none.State().Paths["devices"], "devices.deny")))
	must.Eq(t, "", readFake(t, filepath.Join(none.State().Paths["devices"], "devices.allow")))

	// Without a devices hierarchy a filtered group cannot be made, and
	// nothing is left.
	h = fakeV1(t, allV1)
	_, err = h.create("p", "t", Limits{Devices: DefaultDevices})
	must.ErrorContains(t, err, "the devices cgroup controller is not mounted")
	gone(t, filepath.Join(h.root, "memory", "p"))
}

// On v2 Create attaches the device program to the group's directory, and
// only when Devices is set; an error removes the group again.
func TestCreate_V2Devices(t *testing.T) {
	type call struct {
		dir   string
		rules []DeviceRule
	}
	var calls []call
	var fail error
	old := setV2Devices
	setV2Devices = func(dir string, rules []DeviceRule) error {
		calls = append(calls, call{dir, rules})
		return fail
	}
	t.Cleanup(func() { setV2Devices = old })

	h := fakeV2(t, "cpu memory pids")
	g, err := h.create("p", "t", Limits{Devices: DefaultDevices})
	must.NoError(t, err)
	must.Eq(t, []call{{g.UnifiedDir(), DefaultDevices}}, calls)
	must.Eq(t, map[string]string{unifiedKey: filepath.Join(h.root, "p", "t")}, g.State().Paths)

	calls = nil
	_, err = h.create("p", "plain", Limits{})
	must.NoError(t, err)
	must.SliceEmpty(t, calls)

	fail = errors.New("no bpf here")
	_, err = h.create("p", "bad", Limits{Devices: DefaultDevices})
	must.ErrorContains(t, err, "no bpf here")
	gone(t, filepath.Join(h.root, "p", "bad"))
}

// The device hierarchy is joined like the others, by Join and by
// JoinThread (see TestHost_JoinThread); a v1 group denies what the rules
// do not allow, and the kernel lists exactly the rules.
func TestHost_DevicesV1(t *testing.T) {
	h := needHost(t)
	if h.version != 1 {
		t.Skip("the devices hierarchy is cgroup v1's")
	}
	if _, err := h.v1Mount("devices"); err != nil {
		t.Skipf("no devices hierarchy: %v", err)
	}
	g := hostGroup(t, Limits{Devices: DefaultDevices})
	list, err := readString(filepath.Join(g.paths["devices"], "devices.list"))
	must.NoError(t, err)
	var want []string
	for _, r := range DefaultDevices {
		want = append(want, r.String())
	}
	got := strings.Split(list, "\n")
	slices.Sort(got)
	slices.Sort(want)
	must.Eq(t, want, got)

	checkFilter(t, g)
}

// The v2 device program, attached by a process that then exits (as the
// supervisor may), filters the group's processes. On a hybrid host it runs
// in the controller-less cgroup2 mount: device programs need no
// controller, and Create cannot be used there (it wants cpu and memory),
// so the group is made by hand and TestCreate_V2Devices covers Create.
func TestHost_DevicesV2(t *testing.T) {
	h := needHost(t)
	root := h.root
	if h.version == 1 {
		root = filepath.Join(h.root, "unified")
		if m, err := statfsMagic(root); err != nil || m != unix.CGROUP2_SUPER_MAGIC {
			t.Skipf("no cgroup v2 mount at %s", root)
		}
	}
	dir := filepath.Join(root, uniqueParent())
	must.NoError(t, os.Mkdir(dir, 0o755))
	t.Cleanup(func() { must.NoError(t, rmdir(dir)) })
	g, err := Load(State{Version: 2, Paths: map[string]string{unifiedKey: dir}})
	must.NoError(t, err)
	t.Cleanup(func() { must.NoError(t, g.Kill()) })

	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	must.NoError(t, err)
	defer unix.Close(fd)
	// attached checks that exactly one program is attached to the group,
	// and not through a bpf_link (which would go with the attaching
	// process's descriptor).
	attached := func() {
		t.Helper()
		q, err := link.QueryPrograms(link.QueryOptions{Target: fd, Attach: ebpf.AttachCGroupDevice})
		must.NoError(t, err)
		must.Len(t, 1, q.Programs)
		_, viaLink := q.Programs[0].LinkID()
		must.False(t, viaLink, must.Sprint("the program must not hang on a bpf_link of the attaching process"))
	}
	attach := func() {
		t.Helper()
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), attachDevicesEnv+"="+dir)
		out, err := cmd.CombinedOutput()
		must.NoError(t, err, must.Sprintf("%s", out))
		attached()
	}
	// Attaching leaves the attaching process's RLIMIT_MEMLOCK as it was
	// (the tasks it starts inherit it), though the library lifts it to
	// infinity. Lifting needs CAP_SYS_RESOURCE, which a test may not have
	// (the library ignores the error), so the library is wrapped to
	// change it the other way.
	var orig, lim unix.Rlimit
	must.NoError(t, unix.Getrlimit(unix.RLIMIT_MEMLOCK, &orig))
	t.Cleanup(func() { must.NoError(t, unix.Setrlimit(unix.RLIMIT_MEMLOCK, &orig)) })
	low := unix.Rlimit{Cur: 64 << 10, Max: orig.Max}
	must.NoError(t, unix.Setrlimit(unix.RLIMIT_MEMLOCK, &low))
	set := ocgroups.DevicesSetV2
	ocgroups.DevicesSetV2 = func(path string, r *ocgroups.Resources) error {
		if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{Cur: 16 << 10, Max: orig.Max}); err != nil {
			return err
		}
		return set(path, r)
	}
	err = setV2Devices(dir, DefaultDevices)
	ocgroups.DevicesSetV2 = set
	must.NoError(t, err)
	attached()
	must.NoError(t, unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim))
	must.Eq(t, low, lim)
	// Attaching again (Create on an existing group) replaces the program;
	// the one left is attached by a process that has exited.
	attach()
	attach()

	checkFilter(t, g)
}

func TestDeviceRuleForFile(t *testing.T) {
	f, err := os.Open("/dev/null")
	must.NoError(t, err)
	defer f.Close()
	r, ok, err := DeviceRuleForFile(f, "r")
	must.NoError(t, err)
	must.True(t, ok)
	must.Eq(t, "c 1:3 r", r.String())

	plain, err := os.Open(t.TempDir())
	must.NoError(t, err)
	defer plain.Close()
	_, ok, err = DeviceRuleForFile(plain, "rw")
	must.NoError(t, err)
	must.False(t, ok)
}
