package driver

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

func TestTaskCapabilities(t *testing.T) {
	defaults := []string{"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
	cases := []struct {
		name             string
		allow, add, drop []string
		want, wantAdded  []string
		wantErr          string
	}{
		{name: "defaults", allow: defaults, want: defaults, wantAdded: []string{}},
		{name: "allow narrows the defaults", allow: []string{"chown", "kill"}, want: []string{"CHOWN", "KILL"}, wantAdded: []string{}},
		{name: "drop", allow: defaults, drop: []string{"cap_kill", "MKNOD"}, want: without(defaults, "KILL", "MKNOD"), wantAdded: []string{}},
		{name: "drop all, add one", allow: defaults, drop: []string{"all"}, add: []string{"net_bind_service"}, want: []string{"NET_BIND_SERVICE"}, wantAdded: []string{"NET_BIND_SERVICE"}},
		{name: "add beyond allow", allow: defaults, add: []string{"sys_admin", "net_raw"}, wantErr: "cap_add: sys_admin, net_raw not allowed on this node"},
		{name: "allow all", allow: []string{"all"}, add: []string{"sys_time"}, want: append(defaults[:len(defaults):len(defaults)], "SYS_TIME"), wantAdded: []string{"SYS_TIME"}},
		{name: "unknown", allow: defaults, add: []string{"flying"}, wantErr: `cap_add: unknown capability "flying"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			set, added, err := taskCapabilities(tc.allow, tc.add, tc.drop)
			if tc.wantErr != "" {
				must.ErrorContains(t, err, tc.wantErr)
				return
			}
			must.NoError(t, err)
			must.SliceContainsAll(t, tc.want, set)
			must.Eq(t, len(tc.want), len(set))
			must.SliceContainsAll(t, tc.wantAdded, added)
		})
	}
}

func without(list []string, drop ...string) []string {
	var out []string
	for _, s := range list {
		keep := true
		for _, d := range drop {
			keep = keep && s != d
		}
		if keep {
			out = append(out, s)
		}
	}
	return out
}

func TestParseIDRanges(t *testing.T) {
	r, err := parseIDRanges("denied_host_uids", "0, 10-20,65534")
	must.NoError(t, err)
	for id, want := range map[uint64]bool{0: true, 1: false, 10: true, 15: true, 20: true, 21: false, 65534: true} {
		must.Eq(t, want, inRanges(r, id), must.Sprintf("id %d", id))
	}
	_, err = parseIDRanges("denied_host_uids", "5-")
	must.ErrorContains(t, err, `denied_host_uids: "5-" is not an id or a range`)
	r, err = parseIDRanges("denied_host_gids", "")
	must.NoError(t, err)
	must.SliceEmpty(t, r)
}

// Nomad's logs/ is read-only in an isolated task (and a mount point of its
// own there, which the task cannot rename away): logmon follows symlinks
// when it opens the next log file, so a task that could plant one there
// would have Nomad write a host file as root. A privileged task keeps the
// host's view.
func TestNomadDirMounts_LogsReadOnly(t *testing.T) {
	cfg := &drivers.TaskConfig{AllocDir: "/nomad/alloc/a1", Name: "t"}
	for _, tc := range []struct {
		isolated bool
		want     bool
	}{{true, true}, {false, false}} {
		var logs *executor.Mount
		for _, m := range nomadDirMounts(cfg, tc.isolated, false) {
			if m.Target == "/alloc/logs" {
				logs = &m
			}
		}
		if !tc.want {
			must.Nil(t, logs, must.Sprint("a privileged task got a logs mount of its own"))
			continue
		}
		must.NotNil(t, logs, must.Sprint("no /alloc/logs mount for an isolated task"))
		must.Eq(t, "/nomad/alloc/a1/alloc/logs", logs.Source)
		must.True(t, logs.ReadOnly)
		must.True(t, logs.NoSuid && logs.NoDev)
	}
}

// Nomad's token files in an isolated task's secrets directory are bound
// read-only over themselves: Nomad rewrites them on the host with
// os.WriteFile and os.Chown, which follow a symlink the task could
// otherwise put in their place. Other files there (a template's) stay the
// task's; a symlink is never bound.
func TestNomadDirMounts_TokensReadOnly(t *testing.T) {
	allocDir := t.TempDir()
	cfg := &drivers.TaskConfig{AllocDir: allocDir, Name: "t"}
	secrets := cfg.TaskDir().SecretsDir
	must.NoError(t, os.MkdirAll(secrets, 0o700))
	nomadFiles := []string{"nomad_token", "nomad_db.jwt", "vault_token", "consul_token",
		// Consul's service identity token, the Consul agent's TLS files of a
		// Connect-native task and a Connect sidecar's Envoy bootstrap files:
		// rewritten by Nomad before every run with os.Create.
		"si_token", "consul_ca_file.pem", "consul_cert_file.pem", "consul_key_file.pem",
		"envoy_bootstrap.json", ".envoy_bootstrap.env", ".envoy_bootstrap.cmd"}
	for _, f := range append([]string{"app.env"}, nomadFiles...) {
		must.NoError(t, os.WriteFile(filepath.Join(secrets, f), []byte("x"), 0o600))
	}
	must.NoError(t, os.Symlink("/etc/shadow", filepath.Join(secrets, "nomad_other.jwt")))

	got := map[string]executor.Mount{}
	for _, m := range nomadDirMounts(cfg, true, false) {
		if strings.HasPrefix(m.Target, "/secrets/") {
			got[m.Target] = m
		}
	}
	must.MapLen(t, len(nomadFiles), got)
	for _, name := range nomadFiles {
		m, ok := got["/secrets/"+name]
		must.True(t, ok, must.Sprintf("no read-only mount of %s", name))
		must.Eq(t, filepath.Join(secrets, name), m.Source)
		must.True(t, m.ReadOnly)
	}
	for _, m := range nomadDirMounts(cfg, false, false) {
		must.False(t, strings.HasPrefix(m.Target, "/secrets/"), must.Sprint("a privileged task got a token mount"))
	}
}

// Every source of the task's directories (alloc/, its logs/, local/,
// secrets/, tmp/ and the token files) is taken without following a
// symlink below the allocation's directory: tasks of the allocation write
// there, and one of another driver can put "alloc/logs -> /" in place of
// logs/ while no task of this driver holds it as a mount point.
func TestNomadDirMounts_SourcesBeneathAllocDir(t *testing.T) {
	allocDir := t.TempDir()
	cfg := &drivers.TaskConfig{AllocDir: allocDir, Name: "t"}
	secrets := cfg.TaskDir().SecretsDir
	must.NoError(t, os.MkdirAll(secrets, 0o700))
	must.NoError(t, os.WriteFile(filepath.Join(secrets, "nomad_token"), []byte("x"), 0o600))
	for _, isolated := range []bool{true, false} {
		mounts := nomadDirMounts(cfg, isolated, false)
		must.SliceNotEmpty(t, mounts)
		for _, m := range mounts {
			must.Eq(t, allocDir, m.Beneath, must.Sprintf("mount %s (isolated %v): its source %s may be taken through a symlink", m.Target, isolated, m.Source))
			must.True(t, mounter.PathWithin(m.Source, allocDir) && m.Source != allocDir,
				must.Sprintf("mount %s: source %s is not below %s", m.Target, m.Source, allocDir))
		}
	}
}

// A task that is not privileged may share the host's PID or IPC namespace
// only when the operator allowed it or made it the node's default: there a
// root task reaches every other root task of the node.
func TestCheckHostModes(t *testing.T) {
	cases := []struct {
		name    string
		conf    Config
		tc      TaskConfig
		wantErr string
	}{
		{"private by default", Config{DefaultPIDMode: "private", DefaultIPCMode: "private"}, TaskConfig{}, ""},
		{"task asks private", Config{DefaultPIDMode: "private", DefaultIPCMode: "private"}, TaskConfig{PIDMode: "private"}, ""},
		{"task asks host pid", Config{DefaultPIDMode: "private", DefaultIPCMode: "private"}, TaskConfig{PIDMode: "host"},
			`pid_mode = "host" is not allowed on this node`},
		{"task asks host ipc", Config{DefaultPIDMode: "private", DefaultIPCMode: "private"}, TaskConfig{IPCMode: "host"},
			`ipc_mode = "host" is not allowed on this node`},
		{"operator allowed", Config{DefaultPIDMode: "private", DefaultIPCMode: "private", AllowHostNamespaces: true},
			TaskConfig{PIDMode: "host", IPCMode: "host"}, ""},
		{"operator's default", Config{DefaultPIDMode: "host", DefaultIPCMode: "host"}, TaskConfig{PIDMode: "host", IPCMode: "host"}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.conf.checkHostModes(&tc.tc)
			if tc.wantErr == "" {
				must.NoError(t, err)
				return
			}
			must.ErrorContains(t, err, tc.wantErr)
			must.ErrorContains(t, err, "allow_host_namespaces")
		})
	}
}
