package driver

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/shoenig/test/must"
)

const secretCanary = "s3cr3t-CANARY"

func TestCheckSecretsFile(t *testing.T) {
	cases := []struct {
		name string
		v    VolumeConfig
		want string
	}{
		{"unset", VolumeConfig{}, ""},
		{"relative", VolumeConfig{SecretsFile: "secrets/vol.env"}, ""},
		{"both", VolumeConfig{SecretsFile: "secrets/vol.env", Secrets: map[string]string{"k": "v"}}, "secrets and secrets_file are both set"},
		{"absolute", VolumeConfig{SecretsFile: "/etc/shadow"}, `secrets_file "/etc/shadow" must be relative to the task directory`},
		{"dotdot", VolumeConfig{SecretsFile: "secrets/../../../etc/shadow"}, "must not contain '..'"},
		{"dot", VolumeConfig{SecretsFile: "./"}, "must name a file in the task directory"},
		{"nul", VolumeConfig{SecretsFile: "a\x00b"}, "without NUL"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := checkSecretsFile("data", tc.v)
			if tc.want == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, tc.want)
			must.ErrorContains(t, err, `volume "data"`)
		})
	}
}

func TestReadSecretsFile(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "host-secret")
	must.NoError(t, os.WriteFile(outside, []byte("token="+secretCanary+"\n"), 0o600))

	cases := []struct {
		name  string
		setup func(t *testing.T, taskDir string)
		want  map[string]string
		err   string
	}{
		{"ok", func(t *testing.T, d string) {
			write(t, d, "# rendered by a template\n\ntoken="+secretCanary+"\nurl=https://x/?a=b\n")
		}, map[string]string{"token": secretCanary, "url": "https://x/?a=b"}, ""},
		{"crlf", func(t *testing.T, d string) { write(t, d, "token=v\r\n") }, map[string]string{"token": "v"}, ""},
		{"missing", func(t *testing.T, d string) {}, nil, "cannot be read in the task directory"},
		{"symlink_out", func(t *testing.T, d string) {
			must.NoError(t, os.Symlink(outside, filepath.Join(d, "secrets", "vol.env")))
		}, nil, "is a symlink"},
		{"symlinked_dir", func(t *testing.T, d string) {
			must.NoError(t, os.RemoveAll(filepath.Join(d, "secrets")))
			must.NoError(t, os.Symlink(filepath.Dir(outside), filepath.Join(d, "secrets")))
			must.NoError(t, os.Rename(outside, filepath.Join(filepath.Dir(outside), "vol.env")))
			t.Cleanup(func() { _ = os.Rename(filepath.Join(filepath.Dir(outside), "vol.env"), outside) })
		}, nil, "cannot be read in the task directory"},
		{"hard_link", func(t *testing.T, d string) {
			write(t, d, "token=v\n")
			must.NoError(t, os.Link(filepath.Join(d, "secrets", "vol.env"), filepath.Join(d, "other")))
		}, nil, "has 2 hard links"},
		{"fifo", func(t *testing.T, d string) {
			must.NoError(t, syscall.Mkfifo(filepath.Join(d, "secrets", "vol.env"), 0o600))
		}, nil, "is not a regular file"},
		{"too_large", func(t *testing.T, d string) {
			write(t, d, "token="+strings.Repeat("x", maxSecretsFileBytes)+"\n")
		}, nil, "bytes: it must be at most"},
		{"bad_line", func(t *testing.T, d string) { write(t, d, "token=v\n"+secretCanary+"\n") }, nil, "line 2 is not KEY=VALUE"},
		{"duplicate", func(t *testing.T, d string) { write(t, d, "token=a\ntoken="+secretCanary+"\n") }, nil, "line 2 sets a key an earlier line set (the key is not shown"},
		{"empty", func(t *testing.T, d string) { write(t, d, "# nothing\n") }, nil, "holds no KEY=VALUE line"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			taskDir := t.TempDir()
			must.NoError(t, os.Mkdir(filepath.Join(taskDir, "secrets"), 0o700))
			tc.setup(t, taskDir)
			got, err := readSecretsFile(taskDir, "data", "secrets/vol.env")
			if tc.err != "" {
				must.ErrorContains(t, err, tc.err)
				must.StrNotContains(t, err.Error(), secretCanary, must.Sprint("an error shows the secret"))
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, got)
		})
	}
}

func write(t *testing.T, taskDir, content string) {
	t.Helper()
	must.NoError(t, os.WriteFile(filepath.Join(taskDir, "secrets", "vol.env"), []byte(content), 0o600))
}
