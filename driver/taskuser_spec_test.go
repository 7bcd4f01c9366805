package driver

import (
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"
)

// A task that runs a host binary gets its user resolved once, in the
// host's user database, into its spec: the supervisor, whose spare's root
// binds chroot_env's /etc (the operator's prepared one may say otherwise),
// and every alloc exec then take those ids. An unknown user is refused at
// the start, naming it.
func TestBuildSpec_userResolvedOnTheHost(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedPluginsOnly: false, PrivilegedGrants: grantAll})
	build := func(user string, tc TaskConfig) (*executor.Spec, error) {
		cfg := taskConfig(t, tc)
		cfg.User = user
		tc2, err := decodeTaskConfig(cfg, d.currentConfig())
		must.NoError(t, err)
		return d.buildSpec(d.currentConfig(), cfg, tc2)
	}
	nobody, err := taskuser.Resolve("nobody")
	must.NoError(t, err)
	for _, tc := range []struct {
		user string
		tc   TaskConfig
		want executor.Credential
	}{
		{"", TaskConfig{Command: "/bin/true"}, executor.Credential{UID: nobody.UID, GID: nobody.GID, Groups: nobody.Groups}},
		{"nobody", TaskConfig{Command: "/bin/true"}, executor.Credential{UID: nobody.UID, GID: nobody.GID, Groups: nobody.Groups}},
		{"1234", TaskConfig{Command: "/bin/true"}, executor.Credential{UID: 1234, GID: 1234}},
		{"", TaskConfig{Command: "/bin/true", Privileged: true}, executor.Credential{}},
	} {
		spec, err := build(tc.user, tc.tc)
		must.NoError(t, err)
		must.NotNil(t, spec.Credential, must.Sprintf("user %q", tc.user))
		must.Eq(t, tc.want.UID, spec.Credential.UID, must.Sprintf("user %q", tc.user))
		must.Eq(t, tc.want.GID, spec.Credential.GID, must.Sprintf("user %q", tc.user))
		must.Eq(t, len(tc.want.Groups), len(spec.Credential.Groups), must.Sprintf("user %q", tc.user))
	}
	_, err = build("no-such-user-ncsi", TaskConfig{Command: "/bin/true"})
	must.ErrorContains(t, err, `invalid task config: user "no-such-user-ncsi" not found (a task's user is looked up in the host's user database`)
}
