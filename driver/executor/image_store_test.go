package executor

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// busyboxBase is a base layer's entries: the host's static busybox as sh,
// cat, ls, echo and the applets more, /etc/name saying name, a file /gone
// and a directory /opq with a file /opq/old, for an upper layer to delete
// and to make opaque.
func busyboxBase(t *testing.T, name string, more ...string) []imagebuild.Entry {
	t.Helper()
	base, err := imagebuild.HostFiles(map[string]string{"/bin/busybox": "/bin/busybox"})
	must.NoError(t, err)
	for _, a := range append([]string{"sh", "cat", "ls", "echo"}, more...) {
		base = append(base, imagebuild.Symlink("bin/"+a, "busybox"))
	}
	return append(base,
		imagebuild.File("etc/name", []byte(name+"\n"), 0o644),
		imagebuild.File("gone", []byte("x\n"), 0o644),
		imagebuild.Dir("opq", 0o755),
		imagebuild.File("opq/old", []byte("x\n"), 0o644))
}

// storeImage pulls an image of layers (entrypoint /bin/sh) into a new
// store, from an OCI layout.
func storeImage(t *testing.T, layers ...v1.Layer) (*image.Store, *image.Image) {
	t.Helper()
	built, err := imagebuild.Build(imagebuild.Spec{Entrypoint: []string{"/bin/sh"}}, layers...)
	must.NoError(t, err)
	dir := t.TempDir()
	must.NoError(t, imagebuild.WriteLayout(filepath.Join(dir, "layout"), "1", built))
	store, err := image.Open(t.TempDir(), image.Options{LocalDirs: []string{dir}})
	must.NoError(t, err)
	img, err := store.Pull(context.Background(), "oci:"+filepath.Join(dir, "layout")+":1", image.PullRequest{})
	must.NoError(t, err)
	return store, img
}

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

	l0, err := imagebuild.Layer(busyboxBase(t, "base", "readlink")...)
	must.NoError(t, err)
	l1, err := imagebuild.Layer(
		imagebuild.Whiteout("gone"),
		imagebuild.Dir("opq", 0o755),
		imagebuild.Opaque("opq"),
		imagebuild.File("opq/new", []byte("x\n"), 0o644),
		imagebuild.File("etc/name", []byte("top\n"), 0o644),
		imagebuild.Symlink("escape", host))
	must.NoError(t, err)
	_, img := storeImage(t, l0, l1)
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

// The store's mount-point layer (image.Store.MountLayer), below an image's
// layers, changes nothing a task sees and only spares the writable layer
// the targets it holds. The same task runs with and without it, isolated
// and privileged, with mounts at a path the image lacks (/alloc), at a
// path a whiteout deleted (/gone), at a file an opaque directory hid
// (/opq/old), through the image's symlink (/srv-link/data, to /srv), and
// on a file the image has (/etc/name): it reads the same through each,
// lists the same root, and sees the mount through the symlink where the
// image's symlink leads, never on the host. With the layer, the writable
// layer has no /alloc of its own; without it, it has.
func TestImageRoot_MountLayer_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("test needs a static /bin/busybox")
	}
	shim := staticShim(t)
	l0, err := imagebuild.Layer(append(busyboxBase(t, "image", "tr"), imagebuild.Dir("srv", 0o755))...)
	must.NoError(t, err)
	l1, err := imagebuild.Layer(
		imagebuild.Whiteout("gone"),
		imagebuild.Dir("opq", 0o755),
		imagebuild.Opaque("opq"),
		imagebuild.Symlink("srv-link", "/srv"))
	must.NoError(t, err)
	store, img := storeImage(t, l0, l1)

	src := t.TempDir()
	var mounts []Mount
	var points []image.MountPoint
	for _, m := range []struct {
		target, content string
		dir             bool
	}{
		{"/alloc", "alloc", true},
		{"/gone", "gone", true},
		{"/opq/old", "opq-old", false},
		{"/srv-link/data", "data", true},
		{"/etc/name", "host-name", false},
	} {
		s := filepath.Join(src, strings.ReplaceAll(m.target, "/", "_"))
		if m.dir {
			must.NoError(t, os.Mkdir(s, 0o755))
			must.NoError(t, os.WriteFile(filepath.Join(s, "f"), []byte(m.content+"\n"), 0o644))
		} else {
			must.NoError(t, os.WriteFile(s, []byte(m.content+"\n"), 0o644))
		}
		mounts = append(mounts, Mount{Source: s, Target: m.target, ReadOnly: true, Propagation: PropagationPrivate})
		points = append(points, image.MountPoint{Path: m.target, Dir: m.dir})
	}
	layer, err := store.MountLayer(points)
	must.NoError(t, err)
	must.NotEq(t, "", layer)
	hostSrv := "/srv-link"
	_, err = os.Lstat(hostSrv)
	must.True(t, os.IsNotExist(err), must.Sprintf("the host has %s; the test needs it absent", hostSrv))

	const script = `
echo "root=$(ls / | tr '\n' ' ')"
echo "alloc=$(cat /alloc/f)"
echo "gone=$(cat /gone/f)"
echo "opq=$(ls /opq | tr '\n' ' ')"
echo "opqold=$(cat /opq/old)"
echo "link=$(cat /srv-link/data/f)"
echo "srv=$(cat /srv/data/f)"
echo "name=$(cat /etc/name)"
`
	for _, privileged := range []bool{false, true} {
		var runs [2]map[string]string
		for i, withLayer := range []bool{false, true} {
			tt := newTestSpec(t, "/bin/sh", "-c", script)
			tt.spec.Env = []string{"PATH=/bin"}
			tt.spec.Dir = "/"
			tt.spec.Supervisor = shim
			layers := img.Layers
			if withLayer {
				layers = append([]string{layer}, img.Layers...)
			}
			tt.spec.Image = &ImageRoot{Layers: layers, Ref: img.Ref, Digest: img.Digest}
			tt.spec.Mounts = mounts
			if privileged {
				tt.spec.Privileged = true
			} else {
				tt.spec.Capabilities = DefaultCapabilities
				tt.spec.Isolation = &Isolation{PrivatePID: true, PrivateIPC: true}
			}
			runs[i] = runLines(t, tt)
			must.Eq(t, "alloc", runs[i]["alloc"])
			must.Eq(t, "gone", runs[i]["gone"])
			must.Eq(t, "opq-old", runs[i]["opqold"])
			must.Eq(t, "data", runs[i]["link"])
			must.Eq(t, "data", runs[i]["srv"])
			must.Eq(t, "host-name", runs[i]["name"])
			_, err := os.Lstat(filepath.Join(tt.spec.StateDir, "upper", "alloc"))
			if withLayer {
				must.True(t, os.IsNotExist(err), must.Sprintf("privileged=%v: the writable layer made /alloc, which the mount-point layer has (%v)", privileged, err))
			} else {
				must.NoError(t, err, must.Sprintf("privileged=%v: without the mount-point layer the writable layer has /alloc", privileged))
			}
			_, err = os.Lstat(hostSrv)
			must.True(t, os.IsNotExist(err), must.Sprintf("a mount through the image's symlink reached the host's %s", hostSrv))
		}
		must.Eq(t, runs[0], runs[1], must.Sprintf("privileged=%v: the task saw something else with the mount-point layer", privileged))
	}
}

// An entry whose type a later layer changes is what the later layer says,
// as Docker and containerd apply them: a symlink made a directory (its
// target's files do not show through), a directory made a symlink (its
// files are gone, the link leads inside the root), a file made a
// directory and back; a hard link is one file with its layer's other
// name; a whiteout of a directory hides all of it, and the directory made
// again in a later layer starts empty.
func TestImageRoot_TypeChangesAcrossLayers_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("test needs a static /bin/busybox")
	}
	shim := staticShim(t)
	l0, err := imagebuild.Layer(append(busyboxBase(t, "base", "readlink", "stat"),
		imagebuild.File("usr/lib/libx", []byte("x\n"), 0o644),
		imagebuild.Symlink("lib", "usr/lib"),
		imagebuild.Dir("data", 0o755),
		imagebuild.File("data/old", []byte("old\n"), 0o644),
		imagebuild.File("f2d", []byte("file\n"), 0o644),
		imagebuild.Dir("d2f", 0o755),
		imagebuild.File("d2f/inner", []byte("inner\n"), 0o644),
		imagebuild.Dir("wd", 0o755),
		imagebuild.File("wd/old", []byte("old\n"), 0o644),
	)...)
	must.NoError(t, err)
	l1, err := imagebuild.Layer(
		imagebuild.Dir("lib", 0o755),
		imagebuild.File("lib/only", []byte("only\n"), 0o644),
		imagebuild.Whiteout("data"),
		imagebuild.Symlink("data", "/etc"),
		imagebuild.Dir("f2d", 0o755),
		imagebuild.File("f2d/x", []byte("x\n"), 0o644),
		imagebuild.Whiteout("d2f"),
		imagebuild.File("d2f", []byte("now a file\n"), 0o644),
		imagebuild.File("hl/a", []byte("linked\n"), 0o644),
		imagebuild.Hardlink("hl/b", "hl/a"),
		imagebuild.Whiteout("wd"),
	)
	must.NoError(t, err)
	l2, err := imagebuild.Layer(
		imagebuild.Dir("wd", 0o755),
		imagebuild.File("wd/new", []byte("new\n"), 0o644),
	)
	must.NoError(t, err)
	_, img := storeImage(t, l0, l1, l2)
	tt := newTestSpec(t, "/bin/sh", "-c", `
echo "lib=$(ls /lib | tr '\n' ' ')"
echo "data=$(readlink /data) $(cat /data/name)"
echo "f2d=$(ls /f2d | tr '\n' ' ')"
echo "d2f=$(cat /d2f)"
echo "hl=$(stat -c %i /hl/a) $(stat -c %i /hl/b) $(cat /hl/b)"
echo "wd=$(ls /wd | tr '\n' ' ')"
`)
	tt.spec.Env = []string{"PATH=/bin"}
	tt.spec.Dir = "/"
	tt.spec.Supervisor = shim
	tt.spec.Image = &ImageRoot{Layers: img.Layers, Ref: img.Ref, Digest: img.Digest}
	tt.spec.Capabilities = DefaultCapabilities
	tt.spec.Isolation = &Isolation{PrivatePID: true, PrivateIPC: true}
	got := runLines(t, tt)
	must.Eq(t, "only", strings.TrimSpace(got["lib"]))
	must.Eq(t, "/etc base", got["data"])
	must.Eq(t, "x", strings.TrimSpace(got["f2d"]))
	must.Eq(t, "now a file", got["d2f"])
	hl := strings.Fields(got["hl"])
	must.SliceLen(t, 3, hl)
	must.Eq(t, hl[0], hl[1], must.Sprint("a hard link of a layer is one file in the root"))
	must.Eq(t, "linked", hl[2])
	must.Eq(t, "new", strings.TrimSpace(got["wd"]))
}
