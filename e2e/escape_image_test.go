//go:build e2e

package e2e

// The escape suite's attacks from a task whose root is an image: every
// attack of TestEscape (escAttacks) runs from the tools image (busybox and
// perl, as the attacks need), once as the image's default user (nobody)
// and once as root, and must fail as it fails from a chroot_env root;
// victims and the plugin stay on their own roots. The image root replaces only chroot_env:
// every other layer of isolation is the same, and so must be the result.

import (
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

func TestEscapeImage(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	fixture := csiBin(t, "csi-fixture")
	dirs := newImageDirs(t)
	layout := filepath.Join(dirs.images, "layout")
	must.NoError(t, imagebuild.WriteLayout(layout, "tools", toolsImage(t)))
	a := StartAgent(t, dirs.agentOptions(AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName},
		DriverConfig: "allow_host_namespaces = true"}))
	t.Cleanup(func() { volFinalCheck(t, a) })
	escImages.Store(a, "oci:"+layout+":tools")
	t.Cleanup(func() { escImages.Delete(a) })
	e := &escEnv{a: a, fx: a.StartVolFixture(t, "escape-img", VolFixtureOptions{}), fixture: fixture}

	for _, at := range escAttacks {
		t.Run(at.name, func(t *testing.T) {
			t.Parallel()
			for _, user := range []string{"", "root"} {
				name := map[string]string{"": "user_unset", "root": "user_root"}[user]
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					at.run(t, e, user)
				})
			}
		})
	}
}
