//go:build e2e

package e2e

// A job chooses its host volumes' destinations, and Nomad takes any string
// there: a newline, an escape, a name that is another task's list of
// mount targets joined. The store's mount-point layers (root_dir/images/
// mountpoints/<hash of the list>) are shared by every task whose targets
// the image lacks are the same, so a job that could make a layer under
// another list's name would plant its entries in every later task's root.
// A layer named by its list joined with newlines was such a name: a
// destination equal to another task's list joined (less its first kind
// letter) made that list's layer. The driver leaves the targets a job
// chose out of the layers, names a layer by its list in JSON and takes no
// control character into one; here a hostile job tries, against a real
// agent, and a later, unrelated task from an image shows from inside that
// nothing the hostile job named is in its root.

import (
	"encoding/hex"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/hashicorp/nomad/api"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// listRootScript lists / and /etc from inside a task, one "entry DIR NAME"
// line per entry, every byte outside printable ASCII written \xNN, so that
// a name with a newline reads as one line; busybox's ls -la beside it is
// for the eye. It ends with DONE.
const listRootScript = `ls -la / /etc
perl -e 'for my $d ("/", "/etc") { opendir(my $h, $d) or die "$d: $!"; for (sort readdir $h) { next if $_ eq "." or $_ eq ".."; s/([^\x21-\x7e])/sprintf("\\x%02x", ord $1)/ge; print "entry $d $_\n" } }'
`

// rootEntries parses listRootScript's lines: the entries of each directory.
func rootEntries(t *testing.T, out string) map[string][]string {
	t.Helper()
	got := map[string][]string{}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == "entry" {
			got[f[1]] = append(got[f[1]], f[2])
		}
	}
	if len(got["/"]) == 0 || len(got["/etc"]) == 0 {
		t.Fatalf("the task listed no entries of / and /etc:\n%s", out)
	}
	return got
}

// escapedName is name as listRootScript writes it.
func escapedName(name string) string {
	var b strings.Builder
	for _, c := range []byte(name) {
		if c < 0x21 || c > 0x7e {
			b.WriteString(`\x` + hex.EncodeToString([]byte{c}))
			continue
		}
		b.WriteByte(c)
	}
	return b.String()
}

// firstElem is the first element of an absolute path: the entry of / it
// makes.
func firstElem(path string) string {
	return strings.SplitN(strings.TrimPrefix(path, "/"), "/", 2)[0]
}

// mountLayers reads the store's mount-point layers: for each, its list as
// the store keys it ("d/alloc" for an empty directory, "f/etc/hosts" for a
// file; a directory with entries is a parent, never a target, since no
// target in a layer lies inside another), and every path in it.
func mountLayers(t *testing.T, a *Agent) (lists map[string][]string, paths map[string][]string) {
	t.Helper()
	dir := filepath.Join(a.DriverRoot, "images", "mountpoints")
	entries, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return nil, nil
	}
	must.NoError(t, err)
	lists, paths = map[string][]string{}, map[string][]string{}
	for _, e := range entries {
		layer := filepath.Join(dir, e.Name())
		must.NoError(t, filepath.WalkDir(layer, func(p string, d fs.DirEntry, err error) error {
			if err != nil || p == layer {
				return err
			}
			rel := "/" + strings.TrimPrefix(p, layer+"/")
			paths[e.Name()] = append(paths[e.Name()], rel)
			switch {
			case d.Type().IsRegular():
				lists[e.Name()] = append(lists[e.Name()], "f"+rel)
			case d.IsDir():
				sub, err := os.ReadDir(p)
				if err != nil {
					return err
				}
				if len(sub) == 0 {
					lists[e.Name()] = append(lists[e.Name()], "d"+rel)
				}
			default:
				t.Errorf("layer %s holds %s, neither a directory nor a file (%v)", e.Name(), rel, d.Type())
			}
			return nil
		}))
		slices.Sort(lists[e.Name()])
	}
	return lists, paths
}

func TestEscapeImageMountLayer(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	u := escUniq()
	dirs := newImageDirs(t)
	layout := filepath.Join(dirs.images, "layout")
	tools := toolsImage(t)
	must.NoError(t, imagebuild.WriteLayout(layout, "tools", tools))
	volDir := filepath.Join(filepath.Dir(dirs.images), "hostile-volume")
	must.NoError(t, os.MkdirAll(volDir, 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(volDir, "from-the-volume"), []byte("hostile\n"), 0o644))
	a := StartAgent(t, dirs.agentOptions(AgentOptions{
		ClientConfig: "\n  host_volume \"hostile\" {\n    path      = \"" + volDir + "\"\n    read_only = true\n  }",
	}))

	// An ordinary task from the tools image, run to its end: what it sees
	// in its root.
	victim := func(t *testing.T) map[string][]string {
		t.Helper()
		job := a.RunJob(t, "image_task", map[string]string{"Type": "batch", "Count": "1", "Image": "oci:" + layout + ":tools",
			"Script": volHCLString(listRootScript + "echo DONE\n"), "User": "", "ReadOnly": ""})
		t.Cleanup(func() { a.stopJobs([]string{job.ID}, time.Minute) })
		al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusComplete, StatusFailed)
		out := escLogs(t, a, al.ID, "t")
		if al.ClientStatus != StatusComplete || !strings.Contains(out, "DONE") {
			t.Fatalf("the ordinary task did not run to its end:\n%s", al.Describe())
		}
		return rootEntries(t, out)
	}

	// 1. The ordinary task's own layer: the list a hostile job aims at.
	before := victim(t)
	lists, _ := mountLayers(t, a)
	must.MapLen(t, 1, lists, must.Sprintf("the store's mount-point layers after one task: %v", lists))
	var list []string
	for name, l := range lists {
		list = l
		// As on a node that has not run such a task yet (the operator may
		// remove mountpoints/ while no task from an image runs): the
		// hostile job comes first.
		must.NoError(t, os.RemoveAll(filepath.Join(a.DriverRoot, "images", "mountpoints", name)))
	}
	t.Logf("the ordinary task's mount-point layer holds %q", list)
	for _, want := range []string{"d/alloc", "d/local", "d/secrets"} {
		must.SliceContains(t, list, want, must.Sprint("the ordinary task's layer lacks one of Nomad's directories: the attack below aims at nothing"))
	}
	must.StrHasPrefix(t, "d/", list[0])

	// 2. The hostile jobs, each mounting the agent's host volume at one
	// destination: the ordinary task's list joined with newlines, less its
	// first "d" (so that "d" + the destination is that list joined:
	// "/alloc\nd/local\nd/secrets\nf/etc/hosts..."); a name with an
	// escape; a plain name. Each has a job of its own: a list with a
	// control character is refused whole, and the plain name alone shows
	// that a target the job chose stays out of the layers even where
	// nothing else would refuse it. Their image has every target of the
	// ordinary task's list, so that what they could add to a layer is only
	// what they chose.
	var have []imagebuild.Entry
	for _, e := range list {
		if e[0] == 'd' {
			have = append(have, imagebuild.Dir(e[2:], 0o755))
		} else {
			have = append(have, imagebuild.File(e[2:], nil, 0o644))
		}
	}
	haveLayer, err := imagebuild.Layer(have...)
	must.NoError(t, err)
	toolsLayers, err := tools.Layers()
	must.NoError(t, err)
	hostileImg, err := imagebuild.Build(imagebuild.Spec{Env: []string{"PATH=/usr/bin:/bin"}}, append(toolsLayers, haveLayer)...)
	must.NoError(t, err)
	must.NoError(t, imagebuild.WriteLayout(layout, "hostile", hostileImg))

	joined := strings.Join(list, "\n")[1:]
	escName := "/esc\x1b[31m" + u
	plain := "/planted-" + u
	for _, dest := range []string{joined, escName, plain} {
		rendered, err := a.RenderJob("image_task", map[string]string{"Type": "batch", "Count": "1", "Image": "oci:" + layout + ":hostile",
			"Script": volHCLString(listRootScript + `perl -e 'my $p = pack("H*", $ENV{"DEST"}); print "volume ", (-e "$p/from-the-volume" ? "seen" : "missing"), "\n"'
echo DONE
`), "User": "", "ReadOnly": ""})
		must.NoError(t, err)
		b, err := os.ReadFile(rendered.File)
		must.NoError(t, err)
		job, err := a.api.Jobs().ParseHCLOpts(&api.JobsParseRequest{JobHCL: string(b), Canonicalize: true})
		must.NoError(t, err)
		g := job.TaskGroups[0]
		g.Volumes = map[string]*api.VolumeRequest{"h": {Name: "h", Type: "host", Source: "hostile", ReadOnly: true}}
		vol, dest := "h", dest
		g.Tasks[0].VolumeMounts = append(g.Tasks[0].VolumeMounts, &api.VolumeMount{Volume: &vol, Destination: &dest})
		g.Tasks[0].Env = map[string]string{"DEST": hex.EncodeToString([]byte(dest))}
		a.TrackJob(rendered.ID)
		_, _, err = a.api.Jobs().Register(job, nil)
		must.NoError(t, err, must.Sprintf("Nomad refused the destination %q", dest))
		al := a.WaitAlloc(t, rendered.ID, 2*time.Minute, StatusComplete, StatusFailed)
		out := escLogs(t, a, al.ID, "t")
		// Nomad passes the destination on as it is, and the driver runs
		// the task with its volume there, the target made in the task's
		// own writable layer at its start (docs/images.md: a target the
		// job chose is not in a mount-point layer).
		if al.ClientStatus != StatusComplete || !strings.Contains(out, "DONE") {
			t.Fatalf("the hostile task with destination %q did not run to its end:\n%s", dest, al.Describe())
		}
		must.StrContains(t, out, "volume seen", must.Sprintf("the hostile task does not see its volume at %q", dest))
		must.SliceContains(t, rootEntries(t, out)["/"], escapedName(firstElem(dest)), must.Sprintf("the hostile task's own root has no %q", firstElem(dest)))
	}

	// 3. The ordinary task again, on the same node: its root is what it
	// was, with none of the hostile names in it or in /etc.
	after := victim(t)
	hostileNames := []string{escapedName(firstElem(joined)), escapedName(firstElem(escName)), escapedName(firstElem(plain))}
	t.Logf("the names the hostile jobs made in their own roots: %q", hostileNames)
	for _, d := range []string{"/", "/etc"} {
		for _, name := range after[d] {
			must.StrNotContains(t, name, `\x`, must.Sprintf("the ordinary task's %s holds %q, a name with a control character", d, name))
			must.SliceNotContains(t, hostileNames, name, must.Sprintf("the ordinary task's %s holds %q, a hostile job's name", d, name))
		}
		must.Eq(t, before[d], after[d], must.Sprintf("the ordinary task's %s changed after the hostile jobs ran", d))
	}

	// 4. The store keeps the ordinary task's layer alone, made anew; no
	// layer holds a name any hostile job chose, nor a control character.
	lists, paths := mountLayers(t, a)
	for name, ps := range paths {
		for _, p := range ps {
			must.False(t, strings.ContainsFunc(p, unicode.IsControl), must.Sprintf("mount-point layer %s holds %q", name, p))
			for _, dest := range []string{joined, escName, plain} {
				top := "/" + firstElem(dest)
				must.False(t, p == top || strings.HasPrefix(p, top+"/"),
					must.Sprintf("mount-point layer %s holds %q, made from the hostile destination %q", name, p, dest))
			}
		}
	}
	must.MapLen(t, 1, lists, must.Sprintf("the store's mount-point layers after the hostile jobs: %v", lists))
	for _, l := range lists {
		must.Eq(t, list, l)
	}
}
