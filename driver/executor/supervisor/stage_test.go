package supervisor

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

func TestLookPath(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "tool")
	must.NoError(t, os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(dir, "data"), nil, 0o644))
	cases := []struct {
		cmd  string
		env  []string
		want string
		err  string
	}{
		{"tool", []string{"PATH=/nonexistent:" + dir}, exe, ""},
		{exe, nil, exe, ""},
		{"tool", []string{"PATH=/nonexistent"}, "", `command "tool" not found in PATH`},
		{"sh", nil, "/usr/local/sbin/sh", "skip"},
		{filepath.Join(dir, "missing"), nil, "", "no such file"},
		{"", nil, "", "command is empty"},
	}
	for _, tc := range cases {
		t.Run(tc.cmd, func(t *testing.T) {
			got, err := lookPath(tc.cmd, "", tc.env)
			switch tc.err {
			case "skip":
				must.NoError(t, err)
				must.StrHasSuffix(t, "/sh", got)
			case "":
				must.NoError(t, err)
				must.Eq(t, tc.want, got)
			default:
				must.ErrorContains(t, err, tc.err)
			}
		})
	}
	if os.Geteuid() != 0 {
		_, err := lookPath(filepath.Join(dir, "data"), "", nil)
		must.ErrorContains(t, err, "not executable")
	}
	// A relative command, or a relative PATH entry, is in the working
	// directory, not in this process's.
	parent, base := filepath.Dir(dir), filepath.Base(dir)
	for _, tc := range []struct {
		cmd string
		env []string
	}{
		{base + "/tool", nil},
		{"./" + base + "/tool", nil},
		{"tool", []string{"PATH=/nonexistent:" + base}},
	} {
		got, err := lookPath(tc.cmd, parent, tc.env)
		must.NoError(t, err, must.Sprint(tc.cmd))
		must.Eq(t, exe, got, must.Sprint(tc.cmd))
	}
	_, err := lookPath("tool/x", parent, nil)
	must.ErrorContains(t, err, `command "tool/x"`)
}

// The driver's resolved Path is what runs: no PATH search, whatever a
// directory earlier in PATH holds under the command's name.
func TestCommandPath(t *testing.T) {
	dir := t.TempDir()
	granted := filepath.Join(dir, "granted", "tool")
	job := filepath.Join(dir, "job", "tool")
	for _, p := range []string{granted, job} {
		must.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		must.NoError(t, os.WriteFile(p, []byte("#!/bin/sh\n"), 0o755))
	}
	env := []string{"PATH=" + filepath.Dir(job) + ":" + filepath.Dir(granted)}
	got, err := commandPath(&wire.Spec{Command: "tool", Env: env})
	must.NoError(t, err)
	must.Eq(t, job, got)
	got, err = commandPath(&wire.Spec{Command: "tool", Path: granted, Env: env})
	must.NoError(t, err)
	must.Eq(t, granted, got)
	_, err = commandPath(&wire.Spec{Command: "tool", Path: "granted/tool"})
	must.ErrorContains(t, err, "is not absolute")
	_, err = commandPath(&wire.Spec{Command: "tool", Path: filepath.Join(dir, "missing")})
	must.ErrorContains(t, err, "no such file")
}
