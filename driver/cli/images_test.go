package cli

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// writeLayout writes a one-layer image into dir/name and returns its
// reference.
func writeLayout(t *testing.T, dir, name string, files ...imagebuild.Entry) string {
	t.Helper()
	layer, err := imagebuild.Layer(files...)
	must.NoError(t, err)
	img, err := imagebuild.Build(imagebuild.Spec{}, layer)
	must.NoError(t, err)
	must.NoError(t, imagebuild.WriteLayout(filepath.Join(dir, name), "1", img))
	return "oci:" + filepath.Join(dir, name) + ":1"
}

func TestImagesCommands(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the image store sets owners of unpacked files")
	}
	root, dir := shortDir(t), shortDir(t)
	code, out, _ := runCLI("images", "-root-dir", root)
	must.Eq(t, 0, code)
	must.StrContains(t, out, "No images in the store")
	// Local sources only from the directories given (or the driver's).
	a := writeLayout(t, dir, "a", imagebuild.File("a", []byte("a"), 0o644))
	code, _, errOut := runCLI("images", "pull", "-root-dir", root, a)
	must.Eq(t, 1, code)
	must.StrContains(t, errOut, "local_image_dirs")
	code, out, errOut = runCLI("images", "pull", "-root-dir", root, "-local-image-dirs", dir, a)
	must.Eq(t, 0, code, must.Sprint(errOut))
	must.StrContains(t, out, "Pulled "+a)

	// The driver's options are the default.
	must.NoError(t, os.WriteFile(driver.ImageOptionsFile(root), []byte(`{"local_image_dirs":["`+dir+`"]}`), 0o600))
	b := writeLayout(t, dir, "b", imagebuild.File("b", []byte("b"), 0o644))
	code, out, errOut = runCLI("images", "pull", "-json", "-root-dir", root, b)
	must.Eq(t, 0, code, must.Sprint(errOut))
	var img image.Image
	must.NoError(t, json.Unmarshal([]byte(out), &img))
	must.Eq(t, b, img.Ref)

	// b is in use by a task that still has its state; its task name
	// holds terminal escapes, which reach the terminal escaped.
	taskID := "alloc-1/" + escTask + "/1"
	s, err := image.Open(root, image.Options{})
	must.NoError(t, err)
	must.NoError(t, s.Acquire(t.Context(), image.Use{TaskID: taskID, AllocID: "alloc-1", TaskName: escTask, Since: time.Now().Add(-time.Hour)}, img.Digest))
	stateDir := driver.TaskStateDir(root, taskID)
	must.NoError(t, os.MkdirAll(stateDir, 0o700))

	code, out, _ = runCLI("images", "-root-dir", root)
	must.Eq(t, 0, code)
	must.StrContains(t, out, "REFERENCE")
	must.StrContains(t, out, a)
	must.StrContains(t, out, "in use")
	must.StrNotContains(t, out, "\x1b")
	must.StrContains(t, out, Printable(escTask))
	code, out, _ = runCLI("images", "-json", "-root-dir", root)
	must.Eq(t, 0, code)
	must.StrNotContains(t, out, "\x1b")
	var v imagesView
	must.NoError(t, json.Unmarshal([]byte(out), &v))
	must.SliceLen(t, 2, v.Images)
	for _, i := range v.Images {
		if i.Digest == img.Digest {
			must.SliceLen(t, 1, i.InUseBy)
			must.Eq(t, escTask, i.InUseBy[0].TaskName)
		} else {
			must.SliceEmpty(t, i.InUseBy)
			must.False(t, i.LastUsed.IsZero())
		}
	}

	code, _, errOut = runCLI("images", "rm", "-root-dir", root, b)
	must.Eq(t, 1, code)
	must.StrContains(t, errOut, "is in use by 1 task(s)")
	code, _, errOut = runCLI("images", "rm", "-root-dir", root, img.Digest[:19])
	must.Eq(t, 1, code)
	must.StrContains(t, errOut, "in use")
	code, out, errOut = runCLI("images", "rm", "-root-dir", root, a)
	must.Eq(t, 0, code, must.Sprint(errOut))
	must.StrContains(t, out, "Removed image "+a)
	// Once the task is gone, its lease no longer holds.
	must.NoError(t, os.RemoveAll(stateDir))
	code, _, errOut = runCLI("images", "rm", "-root-dir", root, b)
	must.Eq(t, 0, code, must.Sprint(errOut))
	code, out, _ = runCLI("images", "-root-dir", root)
	must.Eq(t, 0, code)
	must.StrContains(t, out, "No images in the store")
	code, _, errOut = runCLI("images", "rm", "-root-dir", root, "nothing:1")
	must.Eq(t, 1, code)
	must.StrContains(t, errOut, `no image "nothing:1" in the store`)
	code, _, errOut = runCLI("images", "pull", "-root-dir", root)
	must.Eq(t, 2, code)
	must.StrContains(t, errOut, "images pull needs <reference>")
}
