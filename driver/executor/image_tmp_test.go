package executor

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
)

// imageTmpProbe prints what an image task sees of its /tmp and of a
// volume at /tmp/data: the mount point, file system and options of the
// volume's parent mount, the volume's marker, the image's own file in
// /tmp, and how many mounts are at /tmp. It writes through the volume
// (/tmp/data/out) and into /tmp itself (/tmp/own), and goes on past a
// failed step.
const imageTmpProbe = `
parent=$(awk '$5 == "/tmp/data" {print $2}' /proc/self/mountinfo | tail -1)
awk -v p="$parent" '$1 == p {for (i = 7; i <= NF; i++) if ($i == "-") print "parent=" $5 "\nparentfs=" $(i+1) "\nparentopts=" $(i+3)}' /proc/self/mountinfo
echo "data=$(cat /tmp/data/marker 2>&1)"
echo written > /tmp/data/out || echo out=failed
echo own > /tmp/own || echo own=failed
echo "image=$(cat /tmp/from-image 2>/dev/null || echo hidden)"
echo "tmpmounts=$(grep -c ' /tmp ' /proc/self/mountinfo)"
`

// imageTmpSpec is imageSpec running script, with a file of the image's
// own in its /tmp (/tmp/from-image, in the base layer).
func imageTmpSpec(t *testing.T, script string, privileged bool) *testTask {
	t.Helper()
	tt := imageSpec(t, script, privileged)
	must.NoError(t, os.WriteFile(filepath.Join(tt.spec.Image.Layers[0], "tmp/from-image"), []byte("image\n"), 0o644))
	return tt
}

// A volume at /tmp/data (a late mount) of a task whose root is an image is
// the task's, on whatever its /tmp is, and the task's writes through it
// land in the volume:
//   - tmp_size set: on the task's tmpfs /tmp (of that size), which hides
//     the image's own /tmp files (Docker would keep them);
//   - tmp_size unset, as the driver starts it: on Nomad's task tmp/ bound
//     at /tmp, which hides the image's files too;
//   - no mount at /tmp and no tmp_size (the driver's task tmp/ missing):
//     on a tmpfs of no set size;
//   - a privileged task (tmp_size is for the others): on the image's own
//     /tmp, in the overlay root, with the image's file there and the
//     task's own /tmp file in its writable layer.
func TestImageRoot_LateMountInsideTmp_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, tc := range []struct {
		name       string
		privileged bool
		tmpSize    int64
		taskTmp    bool // Nomad's task tmp/ bound at /tmp
		parent     string
		parentFS   string
		parentOpts string // contained in the parent's options
		image      string
	}{
		{name: "tmp_size", tmpSize: 1 << 20, parent: "/tmp", parentFS: "tmpfs", parentOpts: "size=1024k", image: "hidden"},
		{name: "task tmp dir", taskTmp: true, parent: "/tmp", image: "hidden"},
		{name: "no tmp mount", parent: "/tmp", parentFS: "tmpfs", image: "hidden"},
		{name: "privileged", privileged: true, parent: "/", parentFS: "overlay", image: "image"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vol := t.TempDir()
			must.NoError(t, os.WriteFile(filepath.Join(vol, "marker"), []byte("from-volume\n"), 0o644))
			tt := imageTmpSpec(t, imageTmpProbe, tc.privileged)
			taskTmp := ""
			if tc.privileged {
				must.Zero(t, tc.tmpSize)
			} else {
				tt.spec.Isolation.TmpSize = tc.tmpSize
			}
			if tc.taskTmp {
				taskTmp = t.TempDir()
				tt.spec.Mounts = []Mount{{Source: taskTmp, Target: "/tmp", Propagation: PropagationPrivate, NoSuid: true, NoDev: true}}
			}
			p, err := startWithLateMount(tt, vol, "/tmp/data")
			must.NoError(t, err)
			t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
			got := exitLines(t, tt, p)

			must.Eq(t, "from-volume", got["data"])
			must.Eq(t, tc.parent, got["parent"], must.Sprint("the volume's parent mount"))
			if tc.parentFS != "" {
				must.Eq(t, tc.parentFS, got["parentfs"])
			}
			must.StrContains(t, got["parentopts"], tc.parentOpts)
			must.Eq(t, tc.image, got["image"], must.Sprint("the image's own /tmp/from-image"))
			must.MapNotContainsKeys(t, got, []string{"out", "own"})
			b, err := os.ReadFile(filepath.Join(vol, "out"))
			must.NoError(t, err, must.Sprint("the task's write through /tmp/data is not in the volume"))
			must.Eq(t, "written\n", string(b))
			_, err = os.Stat(filepath.Join(vol, "own"))
			must.True(t, os.IsNotExist(err), must.Sprint("the task's own /tmp file landed in the volume"))

			// The task's own /tmp file: in Nomad's task tmp/, in the
			// writable layer of a privileged task, and in neither for a
			// tmpfs.
			upperOwn := filepath.Join(tt.spec.StateDir, "upper", "tmp", "own")
			_, err = os.Stat(upperOwn)
			must.Eq(t, tc.privileged, err == nil, must.Sprintf("the task's /tmp/own in its writable layer: %v", err))
			if tc.taskTmp {
				b, err := os.ReadFile(filepath.Join(taskTmp, "own"))
				must.NoError(t, err)
				must.Eq(t, "own\n", string(b))
			}
			want := "1"
			if tc.privileged {
				want = "0"
			}
			must.Eq(t, want, got["tmpmounts"])
		})
	}
}

// A volume at /tmp itself is an image task's /tmp: no tmpfs goes over or
// under it, tmp_size set or not, and the image's own /tmp files are hidden
// under it, for a privileged task too.
func TestImageRoot_MountAtTmp_Root(t *testing.T) {
	requireTaskRoot(t)
	const script = `
echo "data=$(cat /tmp/marker 2>&1)"
echo written > /tmp/out || echo out=failed
echo "image=$(cat /tmp/from-image 2>/dev/null || echo hidden)"
echo "tmpfs=$(awk '$5 == "/tmp" {for (i = 7; i <= NF; i++) if ($i == "-") print $(i+1)}' /proc/self/mountinfo | grep -c tmpfs)"
echo "tmpmounts=$(grep -c ' /tmp ' /proc/self/mountinfo)"
`
	for _, tc := range []struct {
		name       string
		privileged bool
		tmpSize    int64
	}{
		{name: "tmp_size", tmpSize: 1 << 20},
		{name: "no tmp_size"},
		{name: "privileged", privileged: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vol := t.TempDir()
			must.NoError(t, os.WriteFile(filepath.Join(vol, "marker"), []byte("from-volume\n"), 0o644))
			tt := imageTmpSpec(t, script, tc.privileged)
			if !tc.privileged {
				tt.spec.Isolation.TmpSize = tc.tmpSize
			}
			p, err := startWithLateMount(tt, vol, "/tmp")
			must.NoError(t, err)
			t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
			got := exitLines(t, tt, p)
			must.Eq(t, "from-volume", got["data"])
			must.Eq(t, "hidden", got["image"])
			must.Eq(t, "0", got["tmpfs"], must.Sprint("a tmpfs at /tmp over or under the volume"))
			must.Eq(t, "1", got["tmpmounts"])
			must.MapNotContainsKeys(t, got, []string{"out"})
			b, err := os.ReadFile(filepath.Join(vol, "out"))
			must.NoError(t, err)
			must.Eq(t, "written\n", string(b))
		})
	}
}
