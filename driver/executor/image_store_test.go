package executor

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// The contract between the image store and the task root, end to end: an
// image built from tar layers (a base with busybox, a layer that deletes a
// file with a whiteout, makes a directory opaque and plants a symlink to a
// host path), pulled by the store from an OCI layout, is the task's root
// as its layers say: the whiteout and the opaque directory apply, and the
// symlink leads inside the root, never to the host's file.
func TestImageRoot_FromStore_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("test needs a static /bin/busybox")
	}
	shim := staticShim(t)
	host := filepath.Join(t.TempDir(), "host-secret")
	must.NoError(t, os.WriteFile(host, []byte("host\n"), 0o644))

	base, err := imagebuild.HostFiles(map[string]string{"/bin/busybox": "/bin/busybox"})
	must.NoError(t, err)
	for _, a := range []string{"sh", "cat", "ls", "echo", "readlink"} {
		base = append(base, imagebuild.Symlink("bin/"+a, "busybox"))
	}
	base = append(base,
		imagebuild.File("etc/name", []byte("base\n"), 0o644),
		imagebuild.File("gone", []byte("x\n"), 0o644),
		imagebuild.Dir("opq", 0o755),
		imagebuild.File("opq/old", []byte("x\n"), 0o644))
	l0, err := imagebuild.Layer(base...)
	must.NoError(t, err)
	l1, err := imagebuild.Layer(
		imagebuild.Whiteout("gone"),
		imagebuild.Dir("opq", 0o755),
		imagebuild.Opaque("opq"),
		imagebuild.File("opq/new", []byte("x\n"), 0o644),
		imagebuild.File("etc/name", []byte("top\n"), 0o644),
		imagebuild.Symlink("escape", host))
	must.NoError(t, err)
	built, err := imagebuild.Build(imagebuild.Spec{Entrypoint: []string{"/bin/sh"}}, l0, l1)
	must.NoError(t, err)
	dir := t.TempDir()
	must.NoError(t, imagebuild.WriteLayout(filepath.Join(dir, "layout"), "1", built))

	store, err := image.Open(t.TempDir(), image.Options{LocalDirs: []string{dir}})
	must.NoError(t, err)
	img, err := store.Pull(context.Background(), "oci:"+filepath.Join(dir, "layout")+":1", image.PullRequest{})
	must.NoError(t, err)
	must.Len(t, 2, img.Layers)

	tt := newTestSpec(t, "/bin/sh", "-c", `
echo "name=$(cat /etc/name)"
if [ -e /gone ]; then echo gone=visible; else echo gone=hidden; fi
echo "opq=$(ls /opq | tr '\n' ' ')"
echo "escape=$(cat /escape 2>&1)"
`)
	tt.spec.Env = []string{"PATH=/bin"}
	tt.spec.Dir = "/"
	tt.spec.Supervisor = shim
	tt.spec.Image = &ImageRoot{Layers: img.Layers, Ref: img.Ref, Digest: img.Digest}
	tt.spec.Capabilities = DefaultCapabilities
	tt.spec.Isolation = &Isolation{PrivatePID: true, PrivateIPC: true}
	got := runLines(t, tt)
	must.Eq(t, "top", got["name"])
	must.Eq(t, "hidden", got["gone"])
	must.Eq(t, "new", strings.TrimSpace(got["opq"]))
	must.StrNotContains(t, got["escape"], "host")
}
