package driver

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

func TestConfig_tmpLimits(t *testing.T) {
	for _, tc := range []struct {
		size          string
		inodes        int
		wantSize, ino int64
		err           string
	}{
		{"", 0, 0, 0, ""},
		{"64MiB", 0, 64 << 20, 16384, ""},
		{"2MiB", 0, 2 << 20, 1024, ""},
		{"8MB", 500, 8e6, 500, ""},
		{"512KiB", 0, 0, 0, `tmp_size must be a size of at least 1MiB such as "64MiB", got "512KiB"`},
		{"lots", 0, 0, 0, `tmp_size must be a size of at least 1MiB`},
		{"", 100, 0, 0, "tmp_inodes is set but tmp_size is not"},
		{"64MiB", -1, 0, 0, "tmp_inodes must be a positive number of files, got -1"},
	} {
		c := Config{RootDir: "/x", CgroupParent: "c", TmpSize: tc.size, TmpInodes: tc.inodes}
		size, inodes, err := c.tmpLimits()
		if tc.err != "" {
			must.ErrorContains(t, err, tc.err)
			must.ErrorContains(t, c.validate(), tc.err)
			continue
		}
		must.NoError(t, err)
		must.NoError(t, c.validate())
		must.Eq(t, tc.wantSize, size, must.Sprintf("%+v", tc))
		must.Eq(t, tc.ino, inodes, must.Sprintf("%+v", tc))
	}
}

// With tmp_size, an isolated task's /tmp is a bounded tmpfs, not Nomad's
// task tmp/ directory; a privileged task is not touched.
func TestBuildSpec_tmpfsTmp(t *testing.T) {
	for _, tc := range []struct {
		size       string
		privileged bool
		wantMount  bool
		wantSize   int64
	}{
		{"", false, true, 0},
		{"16MiB", false, false, 16 << 20},
		{"16MiB", true, false, 0},
	} {
		d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedPluginsOnly: false, TmpSize: tc.size})
		cfg := taskConfig(t, TaskConfig{Command: "/bin/true", Privileged: tc.privileged})
		cfg.AllocDir = t.TempDir()
		td := cfg.TaskDir()
		for _, dir := range []string{td.SharedAllocDir, td.LocalDir, td.SecretsDir, td.Dir + "/tmp"} {
			must.NoError(t, os.MkdirAll(dir, 0o755))
		}
		tc2, err := decodeTaskConfig(cfg, d.currentConfig())
		must.NoError(t, err)
		spec, err := d.buildSpec(d.currentConfig(), cfg, tc2)
		must.NoError(t, err)
		var tmp bool
		for _, m := range spec.Mounts {
			tmp = tmp || m.Target == "/tmp"
		}
		must.Eq(t, tc.wantMount, tmp, must.Sprintf("%+v", tc))
		if tc.privileged {
			must.Nil(t, spec.Isolation)
			continue
		}
		must.Eq(t, tc.wantSize, spec.Isolation.TmpSize)
	}
}

// A real task's /tmp holds tmp_size bytes and tmp_inodes files, and no
// more: the next write fails with ENOSPC in the task, the allocation's disk
// untouched.
func TestDriver_tmpfsTmpIsBounded(t *testing.T) {
	requireRoot(t)
	h, _ := harnessDriver(t, Config{TmpSize: "2MiB", TmpInodes: 100})
	script := `dd if=/dev/zero of=/tmp/big bs=64k count=64 2>&1
rm -f /tmp/big
i=0; while true > "/tmp/f$i" 2>/dev/null; do i=$((i+1)); done; echo "files=$i"
grep ' /tmp ' /proc/self/mountinfo
echo END`
	cfg := realTask(t, "tmp", TaskConfig{Command: "/bin/sh", Args: []string{"-c", script}})
	cleanup := mkAllocDir(t, h, cfg, true)
	defer cleanup()
	startTask(t, h, cfg)
	res := waitExit(t, h, cfg.ID, 30*time.Second)
	must.Eq(t, 0, res.ExitCode)
	var out string
	eventually(t, 5*time.Second, func() error {
		b, err := os.ReadFile(cfg.TaskDir().LogDir + "/tmp.stdout.0")
		out = string(b)
		if err == nil && !strings.Contains(out, "END") {
			err = os.ErrNotExist
		}
		return err
	})
	t.Logf("the task said:\n%s", out)
	must.StrContains(t, out, "No space left on device")
	must.StrContains(t, out, "files=99") // the root of the tmpfs takes one inode
	must.StrContains(t, out, "size=2048k")
	must.StrContains(t, out, "nr_inodes=100")
	entries, err := os.ReadDir(cfg.TaskDir().Dir + "/tmp")
	if err == nil {
		must.SliceEmpty(t, entries, must.Sprint("the task wrote into Nomad's tmp/ directory"))
	}
}
